"""`RankFiles`: every rank's findings and per-rank files reach rank 0's run dir, shared or not.

Normally every rank writes into one shared run dir (findings.jsonl lines, ``repro/rank<r>.json``,
``profiler/*_rank<r>.*``, ...). Where each node has its own copy of the run dir (node-local disk,
or nodes that composed different ``hydra.run.dir``), rank 0's dir would hold only its own node's
ranks and the report would silently cover part of the job. So:

1. ``setup`` (every rank): write the marker ``ranks/rank<r>.json`` (rank, host, pid, run dir and a
   random token) into this rank's run dir, then one ``all_gather_object`` of the markers
   (COLLECTIVE). A rank shares rank 0's dir iff it sees rank 0's marker with rank 0's token in its
   own dir (and rank 0 sees its marker); each rank decides that locally, no second collective.
   Rank 0 writes ``ranks/world.json``: every rank with host, pid, run dir and ``shared``.
2. ``on_fit_end`` (every rank, COLLECTIVE: one ``gather_object`` to rank 0): a rank that does not
   share rank 0's dir sends its findings (the records this process reported) and its small per-rank
   text files (names containing ``rank<r>``, ``.json``/``.jsonl``/``.txt``, <= 2 MiB each; its
   marker included). Rank 0 appends the findings lines it does not have yet (so nothing is
   duplicated if both sides got the visibility test wrong) and writes the files it lacks.
   ``world.json`` then lists the ranks ``collected``.

Crash paths: no collective after an exception (the other ranks may be dead), so a node-local rank
whose run ended early is not collected; the report names it ("not heard from") with its host and
where its files are. log_sync's timeline travels by its own collectives.

Framework integrity: added by the entry point to every fit, like the liveness callback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from dsdebug.findings import get_channel
from dsdebug.findings.channel import FINDINGS_FILE
from dsdebug.findings.ranks import name_ranks

__all__ = ["RankFiles", "merge_payloads", "rank_payload"]

log = logging.getLogger(__name__)

MARKERS = "ranks"
WORLD = "world.json"
MAX_FILE_BYTES = 2 << 20
_TEXT = (".json", ".jsonl", ".txt")


def marker_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / MARKERS / f"rank{rank}.json"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, record: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)


def rank_payload(run_dir: Path, rank: int) -> dict[str, Any]:
    """What rank 0 needs from a rank whose run dir it cannot see: findings lines and small per-rank files."""
    run_dir = Path(run_dir)
    own = re.compile(rf"(?:^|[_.\-])rank{rank}(?:[_.\-]|$)")
    files: dict[str, str] = {}
    for path in sorted(run_dir.rglob("*")):
        if (path.is_file() and path.suffix in _TEXT and own.search(path.stem + path.suffix)
                and ".tmp-" not in path.name and path.stat().st_size <= MAX_FILE_BYTES):
            try:
                files[str(path.relative_to(run_dir))] = path.read_text(errors="replace")
            except OSError:
                continue
    return {"rank": rank, "findings": [f.to_json() for f in get_channel().local], "files": files}


def merge_payloads(run_dir: Path, payloads: list[dict[str, Any] | None]) -> list[int]:
    """Rank 0: append the findings lines it lacks, write the files it lacks; returns the ranks merged."""
    run_dir = Path(run_dir).resolve()
    path = run_dir / FINDINGS_FILE
    have = set(path.read_text(errors="replace").splitlines()) if path.is_file() else set()
    merged = []
    for payload in payloads:
        if not payload:
            continue
        new = [line for line in payload.get("findings", []) if line not in have]
        have.update(new)
        if new:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, "".join(line + "\n" for line in new).encode())  # one write, like the channel
            finally:
                os.close(fd)
        for rel, text in payload.get("files", {}).items():
            target = (run_dir / rel).resolve()
            if run_dir not in target.parents or target.exists():
                continue  # outside the run dir, or already here (the dir is shared after all)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        merged.append(int(payload["rank"]))
    return merged


class RankFiles(Callback):
    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.sees_rank0 = True
        self.shared: list[bool] = []  # rank 0: per rank, whether its marker is in this run dir
        self.world: list[dict[str, Any]] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.world is not None:
            return
        run_dir, rank = Path(trainer.default_root_dir), trainer.global_rank
        me = {"rank": rank, "world_size": trainer.world_size, "host": socket.gethostname(), "pid": os.getpid(),
              "run_dir": str(run_dir.resolve()), "token": self.token, "time": time.time()}
        _write_json(marker_path(run_dir, rank), me)
        if trainer.world_size > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, me)  # COLLECTIVE: every marker is written before it returns
        else:
            gathered = [me]
        self.world = gathered
        self.sees_rank0 = rank == 0 or self._visible(run_dir, gathered[0])
        self.shared = [self._visible(run_dir, m) for m in gathered] if rank == 0 else []
        if trainer.is_global_zero:
            self._write_world(run_dir, collected=[])

    @staticmethod
    def _visible(run_dir: Path, marker: dict[str, Any]) -> bool:
        seen = _read_json(marker_path(run_dir, marker["rank"]))
        return isinstance(seen, dict) and seen.get("token") == marker["token"]

    def _write_world(self, run_dir: Path, collected: list[int]) -> None:
        ranks = [{k: m[k] for k in ("rank", "host", "pid", "run_dir")} | {"shared": shared}
                 for m, shared in zip(self.world or [], self.shared)]  # as seen at setup, before any merge
        for entry in ranks:
            if entry["rank"] in collected:
                entry["collected"] = True
        _write_json(Path(run_dir) / MARKERS / WORLD, {"world_size": len(ranks), "ranks": ranks})
        apart = [e["rank"] for e in ranks if not e["shared"]]
        if apart and not collected:
            hosts = {e["rank"]: e["host"] for e in ranks}
            log.info("rank_files: %s write into another run dir than rank 0 (node-local?); their findings and "
                     "files are collected at the end of fit", name_ranks(apart, hosts))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.world is None or trainer.world_size <= 1:
            return
        import torch.distributed as dist

        run_dir = Path(trainer.default_root_dir)
        payload = None if self.sees_rank0 else rank_payload(run_dir, trainer.global_rank)
        gathered: list[Any] | None = [None] * trainer.world_size if trainer.is_global_zero else None
        dist.gather_object(payload, gathered, dst=0)  # COLLECTIVE: every rank, payload or None
        if not trainer.is_global_zero or not any(gathered or []):
            return
        collected = merge_payloads(run_dir, gathered or [])
        self._write_world(run_dir, collected)
        hosts = {m["rank"]: m["host"] for m in self.world}
        log.info("rank_files: merged the findings and per-rank files of %s into %s", name_ranks(collected, hosts),
                 run_dir)
