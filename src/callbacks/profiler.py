"""`Profiler`: where does a training step's time go? torch.profiler over a window of steps.

The config example and the table of metrics and findings: the class docstring (`Profiler`).
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function, schedule

from dsdebug.config.args import Rule, boolean, integer, number
from dsdebug.callbacks.base import DebugCallback
from dsdebug.data.loader_facts import describe_train_loader

__all__ = ["Profiler"]

log = logging.getLogger(__name__)
_COMM_BACKEND = re.compile(r"^(gloo:|nccl)")  # gloo worker-thread ops; NCCL kernels (ncclDevKernel_*, ncclKernel_*)
_DATA = "enumerate(DataLoader)"
_PHASES = ("forward", "backward", "optimizer")


class Profiler(DebugCallback):
    """`Profiler`: where does a training step's time go? torch.profiler over a window of steps.

    Catches: slow training with no obvious cause -- an input pipeline that starves the model
    (data wait dominates), a step dominated by communication, or a handful of ops eating the
    time. Over a window of steps (``wait`` -> ``warmup`` -> ``active``, ``repeat`` times) it runs
    ``torch.profiler`` on every rank and:

    - prints the top-``top_n`` ops sorted by self device time (self CUDA time on GPU, self CPU
      time otherwise) and saves the table (``profiler/top_ops_rank<r>.txt`` and ``.json``);
    - exports a Chrome/Perfetto trace per rank (``profiler/trace_rank<r>.json``; later cycles
      ``trace_rank<r>_cycle<c>.json``), with ``dsdebug/forward|backward|optimizer|validation``
      ranges so the phases are visible at a glance;
    - logs a step-time breakdown per window and reports where the time goes (info), and a
      ``data_bound`` warning when data wait exceeds ``data_warn_fraction`` of the step.

    How the breakdown is measured (per active step, averaged over the window):
    - forward = ``on_train_batch_start`` -> ``on_before_backward``; backward = ->
      ``on_after_backward``; optimizer = -> ``on_train_batch_end`` (clipping, optimizer step,
      ZeRO's post-step gathers). Wall-clock, with ``torch.cuda.synchronize()`` at each boundary
      on GPU (only inside the active window), so async kernels land in the right phase.
    - data = time inside ``DataLoader.__next__`` (PyTorch's own ``enumerate(DataLoader)#...``
      profiler ranges) outside validation: what the loop waited for the input pipeline.
    - comm = wall time with a collective in flight: the union of the backend's own execution
      intervals (NCCL kernels on the GPU, ``gloo:*`` ops on gloo's worker threads on CPU; the
      main thread's ``c10d::*`` calls only enqueue async work and are the fallback). It OVERLAPS
      the phases above (DDP reduces during backward), so it is not part of their sum; a large
      comm time that does not hide behind backward shows up as a long backward/optimizer.
    - step = data + forward + backward + optimizer (validation, checkpoints and logging between
      steps excluded).

    Rank awareness: every rank profiles itself and writes its own files; no collectives. Rank 0
    logs the metrics and the summary; a ``data_bound`` warning names the rank it happened on.
    After the last cycle the profiler is stopped: no further cost.

    Example::

        python train.py +callbacks=profiler callbacks.profiler.wait=10 callbacks.profiler.active=5 \\
            callbacks.profiler.with_stack=true

    | metric key | meaning |
    |---|---|
    | ``time/step_ms`` | data + forward + backward + optimizer, mean per step in the window |
    | ``time/data_ms`` | waiting for the train DataLoader |
    | ``time/forward_ms`` / ``time/backward_ms`` / ``time/optimizer_ms`` | the phases above |
    | ``time/comm_ms`` | inside collectives (overlaps the phases) |
    | ``time/data_fraction`` | data_ms / step_ms |

    | finding code | severity | meaning |
    |---|---|---|
    | ``step_breakdown`` | info | where the time goes, top op, trace path |
    | ``data_bound`` | warning | data wait > ``data_warn_fraction`` of the step: names the DataLoader |

    Resume: nothing is carried over (``state_attrs`` is empty): a resumed process profiles its own
    window (``wait`` steps after its start).
    """
    name = "profiler"
    state_attrs = ()  # the profiler and its window belong to this process (every rank profiles itself)
    runtime_attrs = ("_prof", "_trainer")  # torch's profiler and the Trainer: started again in the new process

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "wait": integer(0),
        "warmup": integer(0),
        "active": integer(1),
        "repeat": integer(1),
        "top_n": integer(1),
        "profile_memory": boolean(),
        "record_shapes": boolean(),
        "with_stack": boolean(),
        "data_warn_fraction": number(0, 1, open_low=True),
    }

    def __init__(self, wait: int = 5, warmup: int = 1, active: int = 3, repeat: int = 1, top_n: int = 15,
                 profile_memory: bool = True, record_shapes: bool = True, with_stack: bool = False,
                 data_warn_fraction: float = 0.3, on_error: str = "warn") -> None:
        super().__init__(on_error)
        self.check_declared(wait=wait, warmup=warmup, active=active, repeat=repeat, top_n=top_n,
                            profile_memory=profile_memory, record_shapes=record_shapes, with_stack=with_stack,
                            data_warn_fraction=data_warn_fraction)
        self.wait, self.warmup, self.active, self.repeat, self.top_n = wait, warmup, active, repeat, top_n
        self.profile_memory, self.record_shapes, self.with_stack = profile_memory, record_shapes, with_stack
        self.data_warn_fraction = float(data_warn_fraction)
        self._prof: profile | None = None
        self._started = False
        self._cycle = 0
        self._times: list[dict[str, float]] = []  # one dict of hook timestamps per active step
        self._ranges: list[Any] = []
        self._trainer = None
        self._cuda = torch.cuda.is_available()

    # ---- the window (every rank) ------------------------------------------------------
    def _recording(self) -> bool:
        return self._prof is not None and self._prof.current_action in (ProfilerAction.RECORD,
                                                                       ProfilerAction.RECORD_AND_SAVE)

    def _mark(self, key: str, open_range: str | None = None) -> None:
        if not self._recording():
            return
        while self._ranges:  # close the previous phase's range
            self._ranges.pop().__exit__(None, None, None)
        if self._cuda:
            torch.cuda.synchronize()
        if key == "start":
            self._times.append({})
        if self._times:
            self._times[-1][key] = time.perf_counter()
        if open_range:
            r = record_function(f"dsdebug/{open_range}")
            r.__enter__()
            self._ranges.append(r)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._prof is None:
            if self._started:
                return
            self._started, self._trainer = True, trainer
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
            self._prof = profile(activities=activities, record_shapes=self.record_shapes,
                                 profile_memory=self.profile_memory, with_stack=self.with_stack,
                                 schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active,
                                                   repeat=self.repeat),
                                 on_trace_ready=self._on_trace_ready)
            self._prof.start()
        elif self._cycle >= self.repeat:
            self._stop()  # every cycle written: detach the profiler, no further cost
            return
        else:
            self._prof.step()  # ends the previous ProfilerStep; may call _on_trace_ready
        self._mark("start", "forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._mark("before_backward", "backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._mark("after_backward", "optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._mark("end")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._recording() and not trainer.sanity_checking:
            r = record_function("dsdebug/validation")
            r.__enter__()
            self._ranges.append(r)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        while self._ranges:
            self._ranges.pop().__exit__(None, None, None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def release(self, trainer: Any) -> None:
        """The profiler and its record_function ranges stopped (base.py)."""
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            self._stop()
        except Exception:  # noqa: BLE001 - never hide the exception that ended the run
            log.exception("profiler: could not write the trace of the interrupted window")

    def _stop(self) -> None:
        while self._ranges:
            self._ranges.pop().__exit__(None, None, None)
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()  # a window cut short by the end of training still writes its trace

    # ---- end of an active window (every rank; rank 0 logs) --------------------------
    def _on_trace_ready(self, prof: profile) -> None:
        trainer, cycle = self._trainer, self._cycle
        self._cycle += 1
        rank = trainer.global_rank
        out = Path(trainer.default_root_dir) / "profiler"
        out.mkdir(parents=True, exist_ok=True)
        suffix = f"rank{rank}" + (f"_cycle{cycle}" if cycle else "")
        trace = out / f"trace_{suffix}.json"
        prof.export_chrome_trace(str(trace))
        sort_key = "self_device_time_total" if self._cuda else "self_cpu_time_total"
        averages = prof.key_averages()
        table = averages.table(sort_by=sort_key, row_limit=self.top_n)
        (out / f"top_ops_{suffix}.txt").write_text(table)
        rows = sorted(({"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
                        "cpu_total_us": e.cpu_time_total, "self_device_us": e.self_device_time_total}
                       for e in averages if not e.key.startswith(("ProfilerStep", "dsdebug/"))),
                      key=lambda r: r["self_device_us" if self._cuda else "self_cpu_us"], reverse=True)[: self.top_n]
        (out / f"top_ops_{suffix}.json").write_text(json.dumps({"sort_by": sort_key, "rows": rows}, indent=1))
        if rank == 0:
            log.info("profiler: top %d ops by %s (rank 0, trace %s)\n%s", self.top_n, sort_key, trace, table)
        steps = [t for t in self._times if all(k in t for k in ("start", "before_backward", "after_backward", "end"))]
        self._times = []
        if not steps:
            return
        n = len(steps)
        ms = {"forward": sum(t["before_backward"] - t["start"] for t in steps) * 1e3 / n,
              "backward": sum(t["after_backward"] - t["before_backward"] for t in steps) * 1e3 / n,
              "optimizer": sum(t["end"] - t["after_backward"] for t in steps) * 1e3 / n}
        data_us, comm_us = self._event_times(prof)
        ms["data"], ms["comm"] = data_us / 1e3 / n, comm_us / 1e3 / n
        ms["step"] = ms["data"] + sum(ms[p] for p in _PHASES)
        frac = ms["data"] / ms["step"] if ms["step"] > 0 else 0.0
        metrics = {f"time/{k}_ms": v for k, v in ms.items()} | {"time/data_fraction": frac}
        (out / f"breakdown_{suffix}.json").write_text(json.dumps({"steps": n, **metrics}, indent=1))
        share = ", ".join(f"{k} {ms[k]:.1f} ms ({ms[k] / max(ms['step'], 1e-9):.0%})" for k in ("data", *_PHASES))
        top = rows[0]["name"] if rows else "?"
        if rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            self.report(trainer, "info", "step_breakdown",
                        f"{n} profiled steps, {ms['step']:.1f} ms/step on rank 0: {share}; collectives "
                        f"{ms['comm']:.1f} ms (overlapping); top op {top}; trace {trace}",
                        details={"metrics": metrics, "top_ops": rows[:5], "trace": str(trace)}, rank=None)
        if frac > self.data_warn_fraction:
            self.report(trainer, "warning", "data_bound",
                        f"rank {rank} waits for the {describe_train_loader(trainer)} {frac:.0%} of each step "
                        f"({ms['data']:.1f} of {ms['step']:.1f} ms, over {n} steps): the input pipeline is the "
                        "bottleneck", advice="raise data.num_workers (with persistent workers), pin_memory=true on "
                        "GPU, and move tokenisation/augmentation out of __getitem__/collate (pre-tokenise)",
                        details={"metrics": metrics, "loader": describe_train_loader(trainer)})

    @staticmethod
    def _event_times(prof: profile) -> tuple[float, float]:
        """(µs in train DataLoader.__next__, µs with a collective in flight), validation excluded.

        Collectives: the backend's own execution -- NCCL kernels on the GPU, gloo's worker
        threads on CPU -- as a union of intervals (wall time with communication in flight);
        the main thread's ``c10d::`` calls only enqueue async work, they are the fallback."""
        events = list(prof.events())
        val = [(e.time_range.start, e.time_range.end) for e in events if e.name == "dsdebug/validation"]
        in_val = lambda e: any(a <= e.time_range.start < b for a, b in val)  # noqa: E731
        data = sum(e.cpu_time_total for e in events if e.name.startswith(_DATA) and not in_val(e))
        backend = [e for e in events if _COMM_BACKEND.match(e.name) and not in_val(e)]
        cuda = [e for e in backend if e.device_type != torch.autograd.DeviceType.CPU]
        comm = cuda or backend or [e for e in events if e.name.startswith("c10d::") and not in_val(e)]
        spans = sorted((e.time_range.start, e.time_range.end) for e in comm)
        busy, end = 0.0, float("-inf")
        for a, b in spans:  # union of intervals
            if b > end:
                busy += b - max(a, end)
                end = b
        return data, busy

