"""`log_sync`: every rank's metrics and log lines, gathered to rank 0."""

from __future__ import annotations

import logging
import socket
import statistics
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from dsdebug.callbacks.log_sync.timeline import STATS, append_records, write_merged
from dsdebug.config.args import Rule, integer, number, one_of
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.step_clock import StepClock
from dsdebug.distributed.timing import CommTracker, register_ddp_hook
from dsdebug.distributed import collectives

__all__ = ["LogSync"]

log = logging.getLogger(__name__)



class _LineBuffer(logging.Handler):
    """Keeps this rank's log records (as dicts) until the next gather."""

    def __init__(self, level: int, max_lines: int) -> None:
        super().__init__(level)
        self.max_lines, self.records, self.dropped = max_lines, [], 0

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) >= self.max_lines:
            self.dropped += 1
            return
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not break logging
            message = str(record.msg)
        self.records.append({"time": record.created, "level": record.levelname, "logger": record.name,
                             "message": message})

    def take(self, rank: int) -> list[dict]:
        records, self.records = self.records, []
        if self.dropped:
            records.append({"time": time.time(), "level": "WARNING", "logger": __name__,
                            "message": f"log_sync dropped {self.dropped} lines (max_lines_per_sync)"})
            self.dropped = 0
        return [dict(rec, rank=rank) for rec in records]


class LogSync(DebugCallback):
    """Cross-rank view of a run: per-rank step time, compute/comm split, loss and memory,
    gathered every ``every_n_steps`` (an all_gather on every rank) and logged as
    min/mean/max with the rank that holds the min/max; a straggler finding; all ranks' log
    lines merged into one timeline on rank 0 (works across nodes: lines travel by
    collective, not by shared disk). Per-rank log files stay Hydra's (``train.log``,
    ``rank<N>.log``). With W&B, a failed job's run is finished as failed (exit code 1,
    ``status``/``exception`` in its summary) instead of being left running.

    Catches: a slow rank (data loading, a throttled or shared device, uneven batches) that
    every other rank waits for. In synchronous training every rank's *wall* step time is the
    same (the others wait in collectives), so the straggler is found by *compute* time =
    step time - time in collectives (`CommTracker`; DDP buckets via a comm hook).

    ``python train.py +callbacks=log_sync trainer=ddp_sim strategy=zero3 logger=many callbacks.log_sync.every_n_steps=5``

    | metric / finding / file | meaning |
    |---|---|
    | ``ranks/<stat>_min``, ``_mean``, ``_max`` | over ranks, mean of the steps since the last gather (the first ``warmup_steps`` skipped); stat: ``step_time`` (s, batch end to batch end, validation and checkpoint saves excluded), ``compute_time`` (s, step minus collectives), ``comm_time`` (s), ``loss`` (local, before any reduction), ``mem_mb`` (RSS on CPU, CUDA max allocated on GPU) |
    | ``ranks/<stat>_min_rank``, ``_max_rank`` | the rank holding the min / max |
    | ``straggler`` (warning) | a rank's compute time > ``straggler_factor`` x the median of the others (and by more than ``straggler_min_excess_s``) in ``straggler_patience`` consecutive windows; names the rank, once per rank |
    | ``wandb_failed_run`` (info) | a W&B run was finished as failed after an exception |
    | ``timeline.jsonl`` | rank 0: every rank's log lines and metric snapshots, one JSON per line, time-ordered per gather |
    | ``logs_merged.log`` | rank 0 at the end: the timeline as text, sorted by time, ``[rank r]`` prefix |

    Resume: nothing is carried over (``state_attrs`` is empty): a straggler streak is about the hosts the
    ranks ran on, which a resumed job may not get again, and only rank 0 knows which ranks it named.
    """

    name = "log_sync"
    state_attrs = ()  # straggler streaks name ranks of this job's hosts; the named-ranks set is rank 0's own
    runtime_attrs = ("buffer", "tracker")  # a log handler (with its lock) on this process's root logger

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(1),
        "straggler_factor": number(1, open_low=True, finite=False),
        "straggler_min_excess_s": number(0, note="seconds", finite=False),
        "straggler_patience": integer(1),
        "warmup_steps": integer(0),
        "log_level": one_of("DEBUG", "INFO", "WARNING", "ERROR", any_case=True),
        "max_lines_per_sync": integer(1),
    }

    def __init__(self, every_n_steps: int = 10, straggler_factor: float = 1.3, straggler_min_excess_s: float = 0.05,
                 straggler_patience: int = 2, warmup_steps: int = 2, timeline: bool = True, log_level: str = "INFO",
                 max_lines_per_sync: int = 5000, finish_wandb_on_exception: bool = True, on_error: str = "warn") -> None:
        super().__init__(on_error)
        self.check_declared(every_n_steps=every_n_steps, straggler_factor=straggler_factor,
                            straggler_min_excess_s=straggler_min_excess_s, straggler_patience=straggler_patience,
                            warmup_steps=warmup_steps, log_level=log_level, max_lines_per_sync=max_lines_per_sync)
        self.every_n_steps, self.factor, self.min_excess_s = every_n_steps, float(straggler_factor), float(straggler_min_excess_s)
        self.timeline, self.log_level, self.max_lines = bool(timeline), str(log_level).upper(), max_lines_per_sync
        self.patience, self.finish_wandb = straggler_patience, bool(finish_wandb_on_exception)
        self._streak: dict[int, int] = {}  # rank -> consecutive windows as the straggler
        self.tracker: CommTracker | None = None
        self.clock: StepClock | None = None
        self.buffer: _LineBuffer | None = None
        self._start_buffer()
        self.offsets: list[float] = [0.0]
        self.hosts: list[str] = []
        self.flagged: set[int] = set()
        self._reset_window()
        self._last_sync = -1
        # the first steps are not representative: allocations, lazy init, and DDP's bucket
        # rebuild in step 2 (a C++ broadcast that no Python hook sees, so waiting looks like compute)
        self._warmup = warmup_steps

    def _start_buffer(self) -> None:
        if self.timeline:  # from construction on (every rank builds its callbacks): setup logs included
            self.buffer = _LineBuffer(getattr(logging, self.log_level), self.max_lines)
            logging.getLogger().addHandler(self.buffer)

    def restore_runtime(self) -> None:
        self._start_buffer()  # a spawned process (ddp_spawn) collects its own lines from here on

    def _reset_window(self) -> None:
        self._n, self._step_s, self._comm_s, self._loss, self._first_step = 0, 0.0, 0.0, None, None

    # ---- every rank ------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.clock = StepClock()
        if trainer.world_size > 1:
            self.tracker = CommTracker.acquire()
            self.offsets = self._clock_offsets(trainer)  # COLLECTIVE

    def _clock_offsets(self, trainer: Any) -> list[float]:
        """COLLECTIVE. Each rank's wall clock minus rank 0's, for ranks on another host (same host: one clock)."""
        collectives.barrier(trainer, "log_sync_clock")
        stamps = collectives.all_gather_object((socket.gethostname(), time.time()))
        host0, t0 = stamps[0]
        self.hosts = [host for host, _ in stamps]  # the merged timeline names each line's host
        return [0.0 if host == host0 else t - t0 for host, t in stamps]

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.tracker is not None:
            register_ddp_hook(trainer, self.tracker)  # DDP's bucket allreduces count as comm time

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.clock is not None:
            self.clock.batch_start()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.clock is not None:
            self.clock.val_start()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.clock is not None:
            self.clock.val_end()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        window = self.clock.batch_end(self.tracker) if self.clock is not None else None
        if window is not None and self._warmup:
            self._warmup, window = self._warmup - 1, None
        if window is not None:
            self._n += 1
            self._step_s += window[0]
            self._comm_s += window[1]
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):  # summed on its device: no host sync per step
                self._loss = loss.detach().float() if self._loss is None else self._loss + loss.detach().float()
            if self._first_step is None:
                self._first_step = trainer.global_step
        # global_step and the window's batch count are the same on every rank: all or none gather
        step = trainer.global_step
        if self._n and self.due(step) and step != self._last_sync:
            self._last_sync = step
            self._sync(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # COLLECTIVE: every rank reaches on_train_end with the same window count and last sync
        if self._n and trainer.global_step != self._last_sync:
            self._sync(trainer)
        elif self.timeline:
            self._gather_lines(trainer, [])  # the lines logged since the last gather
        if self.timeline and trainer.is_global_zero:
            write_merged(Path(trainer.default_root_dir))

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # No collectives here: the other ranks may be anywhere (or dead).
        run_dir = Path(trainer.default_root_dir)
        if self.buffer is not None:  # best effort: straight to the file (shared run dir)
            append_records(run_dir, self.buffer.take(trainer.global_rank))
            if trainer.is_global_zero:
                write_merged(run_dir)
        if self.finish_wandb and trainer.is_global_zero:
            self._finish_wandb(trainer, exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.release(trainer)

    def release(self, trainer: Any) -> None:
        """The logging handler and the collective timing removed (base.py)."""
        if self.buffer is not None:
            logging.getLogger().removeHandler(self.buffer)
            self.buffer = None
        if self.tracker is not None:
            self.tracker.release()
            self.tracker = None

    # ---- the gather (COLLECTIVE: every rank, same step) -------------------------------
    def _sync(self, trainer: Any) -> None:
        n = max(self._n, 1)
        loss = float(self._loss.item()) / n if self._loss is not None else float("nan")
        local = torch.tensor([self._step_s / n, (self._step_s - self._comm_s) / n, self._comm_s / n, loss,
                              _memory_mb(trainer)], dtype=torch.float64, device=trainer.strategy.root_device)
        first = self._first_step if self._first_step is not None else trainer.global_step
        self._reset_window()
        rows = collectives.all_gather(trainer, local).reshape(-1, len(STATS)).cpu().tolist()  # COLLECTIVE
        metrics: dict[str, float] = {}
        for i, stat in enumerate(STATS):
            values = [row[i] for row in rows]
            lo, hi = min(range(len(values)), key=values.__getitem__), max(range(len(values)), key=values.__getitem__)
            metrics.update({f"ranks/{stat}_min": values[lo], f"ranks/{stat}_min_rank": lo,
                            f"ranks/{stat}_mean": sum(values) / len(values),
                            f"ranks/{stat}_max": values[hi], f"ranks/{stat}_max_rank": hi})
        for logger in trainer.loggers:  # loggers write on rank 0 only
            logger.log_metrics(metrics, step=trainer.global_step)
        self._check_straggler(trainer, rows, first)
        if self.timeline:
            self._gather_lines(trainer, rows)  # COLLECTIVE

    def _check_straggler(self, trainer: Any, rows: list[list[float]], first: int) -> None:
        if len(rows) < 2:
            return
        compute = [row[1] for row in rows]
        slow = max(range(len(compute)), key=compute.__getitem__)
        median = statistics.median(compute[:slow] + compute[slow + 1:])
        if compute[slow] <= self.factor * median or compute[slow] - median <= self.min_excess_s:
            self._streak.clear()
            return
        self._streak = {slow: self._streak.get(slow, 0) + 1}  # one noisy window is not a straggler
        if self._streak[slow] < self.patience or slow in self.flagged or not trainer.is_global_zero:
            return  # decided identically on every rank; rank 0 reports
        self.flagged.add(slow)
        waiting = min(range(len(rows)), key=lambda r: rows[r][1])
        self.report(
            trainer, "warning", "straggler",
            f"rank {slow} is a straggler: {compute[slow]:.3f} s of compute per step vs {median:.3f} s median of the "
            f"other ranks ({compute[slow] / max(median, 1e-9):.1f}x) in steps {first}-{trainer.global_step}, and so in "
            f"{self.patience} gathers in a row; the others wait for it in collectives (rank {waiting}: "
            f"{rows[waiting][2]:.3f} s/step)",
            advice=f"look at what rank {slow} does outside collectives: data loading (num_workers, slow storage), "
                   "a throttled or shared device/host, longer sequences or bigger batches on that rank; "
                   "ranks/compute_time_max_rank shows it over time",
            details={"per_rank": {r: dict(zip(STATS, row)) for r, row in enumerate(rows)}, "factor": self.factor},
            rank=slow)

    def _gather_lines(self, trainer: Any, rows: list[list[float]]) -> None:
        records = self.buffer.take(trainer.global_rank) if self.buffer is not None else []
        gathered = collectives.all_gather_object(records)  # COLLECTIVE
        if not trainer.is_global_zero:
            return
        now = time.time()
        hosts = self.hosts or [None] * len(gathered)
        merged = [dict(rec, time=rec["time"] - self.offsets[rank], host=hosts[rank])
                  for rank, recs in enumerate(gathered) for rec in recs]
        merged += [{"time": now, "rank": r, "kind": "metrics", "step": trainer.global_step, **dict(zip(STATS, row))}
                   for r, row in enumerate(rows)]
        append_records(Path(trainer.default_root_dir), sorted(merged, key=lambda rec: rec["time"]))

    def _finish_wandb(self, trainer: Any, exception: BaseException) -> None:
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and getattr(logger, "_experiment", None) is not None:
                run = logger.experiment
                run.summary.update({"status": "failed", "failed_at_step": trainer.global_step,
                                    "exception": f"{type(exception).__name__}: {exception}"[:1000]})
                run.finish(exit_code=1)
                self.report(trainer, "info", "wandb_failed_run", f"W&B run {run.id} finished as failed (exit code 1)",
                            details={"run_dir": str(getattr(run, "dir", ""))}, rank=None)


def _memory_mb(trainer: Any) -> float:
    device = trainer.strategy.root_device
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, KiB on Linux
