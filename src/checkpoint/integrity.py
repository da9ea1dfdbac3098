"""Checkpoint integrity: a manifest per checkpoint, written last and atomically.

A checkpoint is a file (DDP) or a DeepSpeed directory of per-rank shards. DeepSpeed writes its
own ``latest`` tag file on rank 0 *before* its final barrier, so it can name a tag whose other
shards are still being written; Lightning's ``ModelCheckpoint`` deletes the oldest checkpoint
right after ``save_checkpoint`` returns, checked or not. Here:

1. every rank writes its shards, then the barrier at the end of ``trainer.save_checkpoint``;
2. rank 0 reads every file back: size, sha256, and the zip CRCs of torch's archive format
   (a torn write fails that test), then writes ``manifest.json`` (inside a DeepSpeed dir, or
   ``<file>.manifest.json`` next to a file) through a temp file + fsync + rename;
3. only then ``checkpoints/latest`` (the name of the newest verified checkpoint) is replaced,
   and only then may an old checkpoint be rotated away (``VerifiedModelCheckpoint``).

A checkpoint without a manifest is incomplete. Resuming re-hashes every file against the
manifest; a missing, truncated or altered file is a one-line error naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import zipfile
from collections import deque
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from dsdebug.errors import ConfigError

__all__ = ["CheckpointError", "FORMAT", "LATEST", "MANIFEST", "SAVE_WINDOWS", "VerifiedModelCheckpoint",
           "atomic_write_text", "checkpoint_meta", "finalize_checkpoint", "has_manifest", "manifest_path",
           "read_manifest", "save_verified", "verify_checkpoint", "write_manifest"]

log = logging.getLogger(__name__)

FORMAT = "dsdebug.checkpoint-manifest/1"
MANIFEST = "manifest.json"
LATEST = "latest"
_CHUNK = 8 << 20


#: (start, end) perf_counter of this process's recent checkpoint saves: step timers (log_sync,
#: comm_debug) leave them out, as they leave out validation. Rank 0 also writes the manifest, so
#: with saves counted it would look like a straggler.
SAVE_WINDOWS: deque[tuple[float, float]] = deque(maxlen=64)


class CheckpointError(ConfigError):
    """A checkpoint that is incomplete, truncated or corrupted (one line, exit 2)."""


def manifest_path(ckpt: Path) -> Path:
    ckpt = Path(ckpt)
    return ckpt / MANIFEST if ckpt.is_dir() else ckpt.with_name(ckpt.name + ".manifest.json")


def _payload_files(ckpt: Path) -> list[Path]:
    if ckpt.is_file():
        return [ckpt]
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST and ".tmp-" not in p.name)


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _check_archive(path: Path) -> None:
    """torch.save writes a zip archive with a CRC per record: a torn or partial write fails here."""
    if not zipfile.is_zipfile(path):
        if path.suffix in (".pt", ".ckpt", ".pth"):
            raise CheckpointError(f"checkpoint file {path} is not a complete torch archive (truncated or corrupted)")
        return
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({e})") from e
    if bad is not None:
        raise CheckpointError(f"checkpoint file {path} is corrupted (CRC mismatch in record {bad})")


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def write_manifest(ckpt: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Read every file of ``ckpt`` back, then write its manifest (last, atomically)."""
    ckpt = Path(ckpt)
    base = ckpt if ckpt.is_dir() else ckpt.parent
    files: dict[str, dict[str, Any]] = {}
    for path in _payload_files(ckpt):
        _check_archive(path)
        size, sha = _digest(path)
        files[str(path.relative_to(base))] = {"size": size, "sha256": sha}
    if not files:
        raise CheckpointError(f"checkpoint {ckpt} has no files")
    manifest = {"format": FORMAT, "checkpoint": ckpt.name, "created": time.time(), **meta, "files": files}
    atomic_write_text(manifest_path(ckpt), json.dumps(manifest, indent=1))
    return manifest


def read_manifest(ckpt: Path) -> dict[str, Any]:
    path = manifest_path(ckpt)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {ckpt} has no manifest ({path.name}): its save did not finish; "
            "use another checkpoint or resume=latest_valid"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint manifest {path} is unreadable ({e}); use resume=latest_valid") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint manifest {path} is not a {FORMAT} manifest")
    return manifest


def verify_checkpoint(ckpt: Path, full: bool = True) -> dict[str, Any]:
    """Check every file against the manifest (sizes always, sha256 when ``full``)."""
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    base = ckpt if ckpt.is_dir() else ckpt.parent
    hint = "; use resume=latest_valid to fall back to the previous good checkpoint"
    for rel, info in manifest["files"].items():
        path = base / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing (listed in {manifest_path(ckpt).name}){hint}")
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered: {size} bytes, manifest says {info['size']}{hint}"
            )
        if full and _digest(path)[1] != info["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupted: sha256 differs from the manifest{hint}")
    return manifest


def has_manifest(ckpt: Path) -> bool:
    return manifest_path(ckpt).is_file()


def checkpoint_meta(trainer: Any) -> dict[str, Any]:
    """What a resume needs to know before loading: where in training, and how it was sharded."""
    strategy = trainer.strategy
    config = getattr(strategy, "config", None) or {}
    return {
        "global_step": int(trainer.global_step),
        "epoch": int(trainer.current_epoch),
        "world_size": int(trainer.world_size),
        "strategy": type(strategy).__name__,
        "zero_stage": config.get("zero_optimization", {}).get("stage") if config else None,
        "precision": str(trainer.precision),
    }


def finalize_checkpoint(trainer: Any, path: str | Path) -> None:
    """After ``trainer.save_checkpoint(path)`` on every rank: manifest, verify, move ``latest``.

    Rank 0 does the file work; the outcome is broadcast so every rank raises together."""
    path = Path(path)
    error = None
    if trainer.is_global_zero:
        try:
            write_manifest(path, checkpoint_meta(trainer))
            verify_checkpoint(path, full=False)
            atomic_write_text(path.parent / LATEST, path.name + "\n")
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = str(e) if isinstance(e, CheckpointError) else f"verifying checkpoint {path} failed: {e}"
    if trainer.world_size > 1:
        error = trainer.strategy.broadcast(error, src=0)
    if error is not None:
        raise CheckpointError(error)


def save_verified(trainer: Any, path: str | Path, weights_only: bool = False) -> None:
    """``trainer.save_checkpoint`` plus the manifest; a failed write removes the partial files
    and names the file and what is left, instead of leaving a half checkpoint behind."""
    path = Path(path)
    started = time.perf_counter()
    try:
        _save_and_finalize(trainer, path, weights_only)
    finally:
        SAVE_WINDOWS.append((started, time.perf_counter()))


def _save_and_finalize(trainer: Any, path: Path, weights_only: bool) -> None:
    try:
        trainer.save_checkpoint(path, weights_only)
    except Exception as e:  # noqa: BLE001 - ENOSPC arrives as OSError or torch's RuntimeError
        if trainer.is_global_zero:
            _remove(path)
        if _is_storage_error(e, path):
            raise CheckpointError(_write_failure(path, e)) from e
        raise  # e.g. a peer rank died mid-save: not a storage problem
    finalize_checkpoint(trainer, path)


def _is_storage_error(exc: BaseException, path: Path) -> bool:
    """ENOSPC reaches us as OSError, or from torch's zip writer as a RuntimeError
    ("file write failed", "unexpected pos ..."): also look at the free space itself."""
    text = str(exc)
    if isinstance(exc, OSError) or any(t in text for t in (
            "file write failed", "unexpected pos", "No space left", "Disk quota", "File too large")):
        return True
    try:
        return shutil.disk_usage(path.parent).free < 64 * 2**20
    except OSError:
        return False


def _write_failure(path: Path, exc: BaseException) -> str:
    cause = " ".join(str(exc).split())[:200] or type(exc).__name__
    try:
        free = shutil.disk_usage(path.parent).free
        space = f"; {free / 2**20:.1f} MiB free on that disk"
    except OSError:
        space = ""
    kept = [p.name for p in sorted(path.parent.glob("*.ckpt")) if p != path and has_manifest(p)]
    return (f"writing checkpoint {path} failed ({cause}){space}; partial files removed, "
            f"verified checkpoints kept: {', '.join(kept) or 'none'}; free space or point "
            "model_checkpoint.dirpath / paths.output_dir at a disk with room")


def _remove(path: Path) -> None:
    try:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
        m = path.with_name(path.name + ".manifest.json")
        if m.exists():
            m.unlink()
    except OSError as e:
        log.warning("could not remove %s: %s", path, e)


class VerifiedModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, where a save is complete only once its manifest is written
    and verified; the rotation of old checkpoints (``save_top_k``) runs after that, so a failed
    or torn save never costs the previous good checkpoints."""

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        save_verified(trainer, filepath, self.save_weights_only)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            from weakref import proxy

            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        if trainer.is_global_zero and not has_manifest(Path(self._last_checkpoint_saved or "")):
            log.warning("not rotating %s: the newest checkpoint is not verified", filepath)
            return
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            m = Path(filepath).with_name(Path(filepath).name + ".manifest.json")
            if m.exists():
                m.unlink()
