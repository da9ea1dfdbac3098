"""torch's flight recorder, dumped by the hang watchdog of `comm_debug`, in the form `torchfrtrace` reads.

The recorder keeps the last ``TORCH_FR_BUFFER_SIZE`` collectives of every process group (sequence
id, op, sizes, state, Python stack). It must be sized before the process group exists; `CommDebug`
sets the variable at construction, so with comm_debug off nothing is recorded (zero cost). On a
CPU build ``_dump_nccl_trace`` does not exist, but the generic ``_dump_fr_trace`` records gloo
collectives too. Its gloo dump leaves ``pg_config`` unnamed (``{'': ...}``), and torch's analyzer
then fails with ``KeyError: ('0', 0)``; here the group table is filled from the live process
groups (name, description, global ranks), as NCCL's dump has it.

Each rank writes ``<run_dir>/flight_recorder/rank_<r>`` (the prefix NCCL's dump-on-timeout uses,
``TORCH_FR_DUMP_TEMP_FILE``); with every rank's file in one folder::

    torchfrtrace <run_dir>/flight_recorder -p rank_       # which collective each rank is missing
    torchfrtrace <run_dir>/flight_recorder -p rank_ -v    # every recorded collective
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

__all__ = ["BUFFER_ENV", "DIR", "PREFIX", "dump_flight_recorder", "dump_path"]

log = logging.getLogger(__name__)

DIR = "flight_recorder"
PREFIX = "rank_"
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"  # torch < 2.7: TORCH_NCCL_TRACE_BUFFER_SIZE


def dump_path(run_dir: str | Path, rank: int | str) -> Path:
    return Path(run_dir) / DIR / f"{PREFIX}{rank}"


def _group_table() -> dict[str, dict[str, str]]:
    """Every live process group as the analyzer expects it: name -> {name, desc, ranks}."""
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    table = {}
    for group, name in list(world.pg_names.items()):
        try:
            ranks = dist.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001 - a group this rank is not part of
            continue
        table[str(name)] = {"name": str(name), "desc": str(getattr(group, "group_desc", "") or ""),
                            "ranks": str(sorted(ranks))}
    return table


def dump_flight_recorder(run_dir: str | Path, rank: int) -> Path | None:
    """Write this rank's flight-recorder dump; None when the recorder is off or unavailable."""
    if int(os.environ.get(BUFFER_ENV) or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or 0) <= 0:
        return None
    try:
        import torch
        import torch.distributed as dist

        c10d = torch._C._distributed_c10d
        dump = getattr(c10d, "_dump_nccl_trace", None) if torch.cuda.is_available() else None
        dump = dump or getattr(c10d, "_dump_fr_trace", None)
        if dump is None or not dist.is_initialized():
            return None
        trace = pickle.loads(dump())  # torch's own bytes, from this process
        named = {e["process_group"][0] for e in trace.get("entries", []) if e.get("process_group")}
        if not named <= set(trace.get("pg_config") or {}):
            trace["pg_config"] = {**(trace.get("pg_config") or {}), **_group_table()}
            trace["pg_config"].pop("", None)
        path = dump_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(trace))
        return path
    except Exception:  # noqa: BLE001 - best effort, never in the way of the hang report
        log.debug("no flight recorder dump", exc_info=True)
        return None
