"""Rollback mechanics for `loss_spike` (policy=rollback): the last verified checkpoint, loading it
mid-fit, and the record of skipped batches (``<run_dir>/skipped_batches.json``).

- `newest_verified`: rank 0 only (file work); the caller broadcasts its answer.
- `load_weights_and_optimizer`: EVERY rank (DeepSpeed's load is a collective under ZeRO).
  Weights and optimizer state come from the checkpoint; the step counter, the LR schedule and
  the data iterator keep moving forward (PaLM: the batches between the checkpoint and the spike
  are thereby skipped).
- The skip record names batch positions (per rank, in the epoch's order) with the batch geometry,
  so a resume from an earlier checkpoint drops them (``LMDataModule.exclude_batches``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from dsdebug.checkpoint.integrity import CheckpointError, atomic_write_text, has_manifest, read_manifest, verify_checkpoint

__all__ = ["FORMAT", "SKIP_FILE", "append_record", "checkpoint_dir", "convert_range", "exclusions_for_resume",
           "load_weights_and_optimizer", "newest_verified", "position_ranges", "read_record"]

log = logging.getLogger(__name__)

SKIP_FILE = "skipped_batches.json"
FORMAT = "dsdebug.skipped-batches/1"


def checkpoint_dir(trainer: Any) -> Path:
    cb = trainer.checkpoint_callback
    if cb is not None and getattr(cb, "dirpath", None):
        return Path(cb.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def newest_verified(ckpt_dir: Path, before_step: int) -> tuple[str, int] | None:
    """(path, global_step) of the newest checkpoint at or before ``before_step`` whose files match
    its manifest (sha256); corrupt ones are passed over with a log line. Rank 0 only."""
    found = []
    for p in ckpt_dir.glob("*.ckpt") if ckpt_dir.is_dir() else ():
        if not has_manifest(p):
            continue
        try:
            step = int(read_manifest(p).get("global_step", -1))
        except CheckpointError:
            continue
        if 0 <= step <= before_step:
            found.append((step, p))
    for step, p in sorted(found, reverse=True):
        try:
            verify_checkpoint(p, full=True)
        except CheckpointError as e:
            log.warning("loss_spike rollback: passing over %s: %s", p.name, e)
            continue
        return str(p), step
    return None


def load_weights_and_optimizer(trainer: Any, pl_module: Any, path: str) -> None:
    """EVERY rank: weights + optimizer state from ``path``; step counters and LRs stay as they are."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    lrs = [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers]
    if isinstance(trainer.strategy, DeepSpeedStrategy):
        engine = trainer.strategy.deepspeed_engine
        counters = {k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps")}
        loaded, _ = engine.load_checkpoint(path, tag="checkpoint", load_optimizer_states=True,
                                           load_lr_scheduler_states=False,
                                           load_module_strict=not trainer.strategy.exclude_frozen_parameters)
        if loaded is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {path}")
        for k, v in counters.items():  # keep moving forward: the checkpoint's counters are older
            setattr(engine, k, v)
    else:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        pl_module.load_state_dict(ckpt["state_dict"])
        trainer.strategy.load_optimizer_state_dict(ckpt)
    for opt, groups in zip(trainer.optimizers, lrs):  # the schedule's current LR, not the checkpoint's
        for g, lr in zip(opt.param_groups, groups):
            g["lr"] = lr


def position_ranges(seen: list[tuple[int, int, int]], first_step: int, last_step: int) -> list[tuple[int, int, int]]:
    """(epoch, first, last) batch-position ranges of the steps first_step..last_step, from the
    (global_step, epoch, batch_idx) records of the micro-batches seen."""
    by_epoch: dict[int, list[int]] = {}
    for step, epoch, idx in seen:
        if first_step <= step <= last_step:
            by_epoch.setdefault(epoch, []).append(idx)
    return [(e, min(v), max(v)) for e, v in sorted(by_epoch.items())]


def read_record(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return data.get("rollbacks", []) if isinstance(data, dict) and data.get("format") == FORMAT else []


def append_record(run_dir: Path, entry: dict) -> Path:
    """Rank 0: add one rollback's skipped batches to ``<run_dir>/skipped_batches.json`` (atomic)."""
    path = run_dir / SKIP_FILE
    entries = read_record(path) + [entry]
    atomic_write_text(path, json.dumps({"format": FORMAT, "rollbacks": entries}, indent=1))
    return path


def convert_range(first: int, last: int, old: tuple[int, int], new: tuple[int, int]) -> tuple[int, int]:
    """Batch positions under (world_size, batch_size) ``old`` -> the positions under ``new`` that
    hold any of the same samples (the sampler deals one permutation out rank by rank)."""
    if old == new or not all(old):
        return first, last
    g_old, g_new = old[0] * old[1], new[0] * new[1]
    return first * g_old // g_new, -(-(last + 1) * g_old // g_new) - 1


def exclusions_for_resume(records: list[dict], resume_step: int, geometry: tuple[int, int]) -> list[tuple[int, int, int]]:
    """(epoch, first, last) ranges to drop on a resume from a checkpoint at ``resume_step``: those of
    rollbacks whose skipped steps lie after it (earlier ones were already behind that checkpoint)."""
    out = []
    for r in records:
        if int(r.get("spike_step", -1)) < resume_step:
            continue
        old = (int(r.get("world_size", 0)), int(r.get("batch_size", 0)))
        for epoch, first, last in r.get("batches", []):
            out.append((int(epoch), *convert_range(int(first), int(last), old, geometry)))
    return sorted(set(out))
