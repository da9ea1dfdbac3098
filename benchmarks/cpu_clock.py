"""Per-rank CPU time over a step window, the same on both sides of a benchmark.

Wall time on a shared VM moves with the neighbours; a process's CPU time (user + sys of all its
threads, ``time.process_time``) barely does. Every rank stamps ``(time.time(), process_time)``
after optimizer step ``start`` and after step ``end``, and at the end also each thread's CPU
seconds (psutil), so a background thread's share (liveness, heartbeat) is visible by name.

* raw loop: ``stamp()`` after ``engine.step()`` (``raw_loop.py``).
* train.py: ``CpuClock``, a Lightning callback added on the command line, never part of conf/::

    PYTHONPATH=benchmarks python train.py ... +callbacks.cpu_clock._target_=cpu_clock.CpuClock \\
        +callbacks.cpu_clock.out=DIR +callbacks.cpu_clock.start=10 +callbacks.cpu_clock.end=40

  It writes ``DIR/rank<R>.json``. Its per-step cost is one integer comparison.
  ``ablate=[lightning_sigterm]`` switches off Lightning's per-step SIGTERM broadcast (every rank,
  so the ranks stay in step): a benchmark switch to measure that collective's share.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

ABLATIONS = ("lightning_sigterm",)


def stamp(threads: bool = True) -> dict[str, Any]:
    """Wall and process CPU seconds now (and each thread's CPU seconds: ~1 ms, at the window's ends only)."""
    return {"wall": time.time(), "cpu": time.process_time(), "rusage": rusage(),
            **({"threads": thread_cpu()} if threads else {})}


RUSAGE_FIELDS = ("ru_utime", "ru_stime", "ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw")


def rusage() -> dict[str, float]:
    """getrusage(RUSAGE_SELF): user / sys seconds, page faults and context switches of this process so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return {f[3:]: getattr(r, f) for f in RUSAGE_FIELDS}


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + sys) of each live thread of this process, by thread name."""
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "other (torch/gloo/C++)")
        out[name] = round(out.get(name, 0.0) + t.user_time + t.system_time, 4)
    return out


def window(stamps: dict[int, dict[str, Any]], start: int, end: int, rank: int, threads: int) -> dict[str, Any]:
    """One rank's record for the window (start, end]: wall, process CPU and each thread's CPU seconds."""
    a, b = stamps[start], stamps[end]
    per_thread = {name: round(t - a.get("threads", {}).get(name, 0.0), 4) for name, t in b.get("threads", {}).items()}
    return {"rank": rank, "pid": os.getpid(), "torch_threads": threads, "start": start, "end": end,
            "wall_s": b["wall"] - a["wall"], "cpu_s": b["cpu"] - a["cpu"], "threads_cpu_s": per_thread,
            "rusage": {k: round(v - a.get("rusage", {}).get(k, 0), 4) for k, v in b.get("rusage", {}).items()}}


class CpuClock(Callback):
    def __init__(self, out: str, start: int, end: int, ablate: list[str] | tuple[str, ...] = (),
                 profile: bool = False) -> None:
        bad = [a for a in ablate if a not in ABLATIONS]
        if bad:
            raise ValueError(f"cpu_clock.ablate: {bad[0]!r} is not valid; valid: {', '.join(ABLATIONS)}")
        self.out, self.start, self.end, self.ablate = Path(out), int(start), int(end), list(ablate)
        self.stamps: dict[int, dict[str, Any]] = {}
        self.profiler: Any = None
        if profile:  # cProfile of the main thread over the window: where the CPU goes (slows Python down)
            import cProfile

            self.profiler = cProfile.Profile()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if "lightning_sigterm" in self.ablate:  # every rank has this callback: all skip it together
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step  # optimizer steps completed
        if step in (self.start, self.end) and step not in self.stamps:
            self.stamps[step] = stamp()
            if self.profiler is not None:
                self.profiler.enable() if step == self.start else self.profiler.disable()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        import torch

        if self.start in self.stamps and self.end in self.stamps:
            self.out.mkdir(parents=True, exist_ok=True)
            record = window(self.stamps, self.start, self.end, trainer.global_rank, torch.get_num_threads())
            (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
            if self.profiler is not None:
                self.profiler.dump_stats(str(self.out / f"rank{trainer.global_rank}.prof"))


def read_ranks(out: Path) -> list[dict[str, Any]]:
    """Every rank's record under ``out``, by rank."""
    return sorted((json.loads(p.read_text()) for p in Path(out).glob("rank*.json")), key=lambda r: r["rank"])


def summarize_ranks(records: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per-step wall ms (rank 0) and CPU ms (every rank, and their sum)."""
    return {"wall_ms": records[0]["wall_s"] / steps * 1000.0,
            "cpu_ms_per_rank": [r["cpu_s"] / steps * 1000.0 for r in records],
            "cpu_ms": sum(r["cpu_s"] for r in records) / steps * 1000.0,
            "torch_threads": [r["torch_threads"] for r in records],
            # page faults and system time per step, every rank summed (glibc malloc handing memory
            # back to the OS shows here: docs/benchmarks.md 2b)
            "minflt_per_step": sum(r.get("rusage", {}).get("minflt", 0) for r in records) / steps,
            "sys_ms": sum(r.get("rusage", {}).get("stime", 0.0) for r in records) / steps * 1000.0,
            "threads_cpu_s": [r["threads_cpu_s"] for r in records]}
