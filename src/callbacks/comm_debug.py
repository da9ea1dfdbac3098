"""`comm_debug`: communication debugging — NCCL/torch debug env, collective timeout, comm
time per step, and a hang watchdog that names the rank that is behind.

`StepClock` (per-rank step windows, ``callbacks/step_clock.py``) and `CommTracker` (``dsdebug.distributed.timing``:
times every collective of the process and counts its bytes) are shared with `log_sync`, to tell
a straggler from the ranks waiting for it.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

from dsdebug.distributed.flight_recorder import dump_path
from dsdebug.config.args import Rule, integer, number, one_of, seconds
from dsdebug.callbacks.step_clock import StepClock
from dsdebug.callbacks.base import DebugCallback
from dsdebug.distributed.timing import CommTracker, register_ddp_hook

__all__ = ["CommDebug", "DISTRIBUTED_DEBUG_LEVELS", "NCCL_DEBUG_LEVELS"]

log = logging.getLogger(__name__)

def _pg_timeout() -> str:
    """The default process group's timeout as its backend holds it (what a hang waits for)."""
    try:
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
        return str(group._get_backend(group._device_types[0]).options._timeout)
    except Exception:  # noqa: BLE001 - no process group (single process) or another backend
        return "n/a"


NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
DISTRIBUTED_DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")


class CommDebug(DebugCallback):
    """Makes communication failures loud and attributable instead of a silent 30-minute hang.

    Catches a rank that never reaches a collective (stuck in data loading, I/O, a
    rank-conditional code path): after ``hang_timeout_s`` without progress the watchdog dumps
    every rank's stacks, names the rank that is behind and where it is, and ends the job
    (exit 124; no rank left behind). Measures the share of each step spent in collectives.
    Sets, on every rank before the process group exists (child ranks inherit and re-apply
    them; restored at teardown): ``NCCL_DEBUG`` (+ ``NCCL_DEBUG_SUBSYS``, per-process
    ``NCCL_DEBUG_FILE`` in the run dir), ``TORCH_DISTRIBUTED_DEBUG``,
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``TORCH_NCCL_BLOCKING_WAIT``, torch's flight recorder
    ``TORCH_FR_BUFFER_SIZE`` (gloo and NCCL collectives) + ``TORCH_NCCL_DUMP_ON_TIMEOUT`` +
    ``TORCH_FR_DUMP_TEMP_FILE`` (``<run_dir>/flight_recorder/rank_<r>``; before torch 2.7:
    ``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``). The process-group
    timeout (``collective_timeout_s``) is set on the live group at setup (Lightning creates it
    before any callback hook runs). NCCL settings are inert on gloo; the watchdog, the flight
    recorder and comm timing work on both. The watchdogs talk through the rendezvous store, not
    the filesystem: run dirs local to each node are fine (each rank dumps into its own).
    Without ``run_dir`` (a plain Lightning project) the run dir is ``trainer.default_root_dir``,
    known at setup: the dump path is set and ``flight_recorder/`` made there (nothing is created
    at construction), and NCCL logs to the console (it opens ``NCCL_DEBUG_FILE`` with its first
    communicator, before any hook).

    ``python train.py +callbacks=comm_debug strategy=zero3 trainer=ddp_sim callbacks.comm_debug.hang_timeout_s=120``

    | metric / finding | meaning |
    |---|---|
    | ``comm/ms`` | ms this step (rank 0) with a collective running (union of spans; DDP buckets via a comm hook) |
    | ``comm/share`` | ``comm/ms`` / step time, in [0, 1] |
    | ``comm/bytes_per_step/<collective>`` | bytes rank 0 handed to that collective this step (``all_reduce``: DDP's gradient buckets, compressed ones as sent) |
    | ``settings`` (info) | the debug env and timeout in effect |
    | ``comm_summary`` (info) | mean comm share and bytes per step per collective over the run |
    | ``ddp_hook_unavailable`` (info) | DDP comm time not measured: another comm hook is registered |
    | ``hang`` (error) | no progress for ``hang_timeout_s``: names the rank(s) behind and where they are; stacks in ``hang_rank<r>.txt``, collectives in ``flight_recorder/rank_<r>`` (``torchfrtrace``); exit 124 |

    Resume: nothing is carried over (``state_attrs`` is empty): comm shares and byte counters are this
    process's, the watchdog and its tracker live with the process group.
    """

    name = "comm_debug"
    state_attrs = ()  # per-process: comm timing, byte counters, the watchdog thread and the live process group
    runtime_attrs = ("tracker", "watchdog")  # a lock and a thread + store: built again in setup
    _fits = 0

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "nccl_debug": one_of(None, *NCCL_DEBUG_LEVELS, any_case=True),
        "distributed_debug": one_of(None, *DISTRIBUTED_DEBUG_LEVELS, any_case=True),
        "async_error_handling": one_of(None, 0, 1, 2, 3),
        "trace_buffer_size": integer(0),
        "collective_timeout_s": seconds(),
        "hang_timeout_s": seconds(),
        "hang_poll_s": number(0, open_low=True, note="seconds", finite=False),
    }

    def __init__(self, run_dir: str | None = None, nccl_debug: str | None = "INFO", nccl_debug_subsys: str | None = None,
                 nccl_debug_file: bool = True, distributed_debug: str | None = "INFO",
                 async_error_handling: int | None = 1, blocking_wait: bool = False, trace_buffer_size: int = 2000,
                 dump_on_timeout: bool = True, collective_timeout_s: float | None = 600,
                 measure_comm: bool = True, hang_timeout_s: float | None = 300, hang_poll_s: float = 2.0,
                 on_error: str = "warn") -> None:
        super().__init__(on_error)
        self.check_declared(nccl_debug=nccl_debug, distributed_debug=distributed_debug,
                            async_error_handling=async_error_handling, trace_buffer_size=trace_buffer_size,
                            collective_timeout_s=collective_timeout_s, hang_timeout_s=hang_timeout_s,
                            hang_poll_s=hang_poll_s)
        # None (a plain project): the run dir is the Trainer's default_root_dir, known at setup
        self.run_dir = Path(run_dir) if run_dir else None
        self.collective_timeout_s = collective_timeout_s or None
        self.measure_comm = bool(measure_comm)
        self.hang_timeout_s, self.hang_poll_s = float(hang_timeout_s or 0), float(hang_poll_s)
        # Every rank, at construction: before the process group (and NCCL) exist, and before
        # rank 0 launches the children, which inherit os.environ and re-apply it here.
        self._dump_on_timeout = bool(trace_buffer_size and dump_on_timeout)
        self.env = self._apply_env(nccl_debug, nccl_debug_subsys, nccl_debug_file, distributed_debug,
                                   async_error_handling, blocking_wait, trace_buffer_size, dump_on_timeout)
        self.tracker: CommTracker | None = None
        self.clock: StepClock | None = None
        self.watchdog: Any = None
        self._shares: list[float] = []
        self._bytes_seen: dict[str, int] = {}  # the tracker's byte counters at the last step end
        self._bytes_steps: list[dict[str, int]] = []

    def _apply_env(self, nccl_debug, subsys, to_file, dist_debug, async_eh, blocking, buffer, dump) -> dict[str, str]:
        want = {
            "NCCL_DEBUG": nccl_debug and str(nccl_debug).upper(),
            "NCCL_DEBUG_SUBSYS": subsys,
            # NCCL opens its log file with its first communicator, before any callback hook runs: without a
            # run_dir given here, NCCL's lines go to the console (no files in the current directory)
            "NCCL_DEBUG_FILE": str(self.run_dir / "nccl_%h_%p.log") if nccl_debug and to_file and self.run_dir
            else None,
            "TORCH_DISTRIBUTED_DEBUG": dist_debug and str(dist_debug).upper(),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": None if async_eh is None else str(async_eh),
            "TORCH_NCCL_BLOCKING_WAIT": "1" if blocking else None,
            "TORCH_FR_BUFFER_SIZE": str(buffer) if buffer else None,  # was TORCH_NCCL_TRACE_BUFFER_SIZE
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1" if buffer and dump else None,
            # read when a dump is written, not when the group is made: without a run_dir it is set at setup
            "TORCH_FR_DUMP_TEMP_FILE": str(dump_path(self.run_dir, "")) if buffer and dump and self.run_dir
            else None,
        }
        applied = {k: str(v) for k, v in want.items() if v is not None}
        self._env_before = {k: os.environ.get(k) for k in applied}  # restored at teardown
        os.environ.update(applied)
        if "TORCH_DISTRIBUTED_DEBUG" in applied:
            import torch.distributed as dist

            dist.set_debug_level_from_env()  # read once at import; re-read so this rank matches the children
        return applied

    # ---- every rank ------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        import torch.distributed as dist

        if self.run_dir is None:  # a plain project: the Trainer's dir, now that there is one
            self.run_dir = Path(trainer.default_root_dir)
            if self._dump_on_timeout:
                self._env_before.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.environ.get("TORCH_FR_DUMP_TEMP_FILE"))
                self.env["TORCH_FR_DUMP_TEMP_FILE"] = os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(
                    dump_path(self.run_dir, ""))
        if self._dump_on_timeout:  # NCCL's dump-on-timeout writes there, and needs the folder
            dump_path(self.run_dir, "").parent.mkdir(parents=True, exist_ok=True)
        if self.collective_timeout_s and dist.is_available() and dist.is_initialized():
            timeout = timedelta(seconds=float(self.collective_timeout_s))
            dist.distributed_c10d._set_pg_timeout(timeout)  # the process group exists by now: set it there
            trainer.strategy._timeout = timeout  # and for groups created later
        level = dist.get_debug_level().name if dist.is_available() else "n/a"
        log.info("comm_debug rank %d: %s; torch distributed debug level %s; process-group timeout %s",
                 trainer.global_rank, " ".join(f"{k}={v}" for k, v in sorted(self.env.items())), level, _pg_timeout())
        if trainer.is_global_zero:
            self.report(trainer, "info", "settings", f"communication debug settings for {trainer.world_size} rank(s)",
                        details={"env": self.env, "collective_timeout_s": self.collective_timeout_s,
                                 "hang_timeout_s": self.hang_timeout_s or None, "debug_level": level}, rank=None)
        if self.measure_comm or self.hang_timeout_s:
            self.tracker, self.clock = CommTracker.acquire(), StepClock()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.tracker is not None:
            reason = register_ddp_hook(trainer, self.tracker)
            if reason and trainer.is_global_zero:
                self.report(trainer, "info", "ddp_hook_unavailable",
                            f"DDP bucket allreduce time is not measured: {reason}",
                            advice="remove the other DDP comm hook to measure comm time and track hangs in it")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.tracker is not None:
            self._bytes_seen = dict(self.tracker.bytes)  # DDP's initial broadcast is not a step's
        if self.hang_timeout_s:
            from dsdebug.distributed.hang_watchdog import HangWatchdog, watchdog_store

            CommDebug._fits += 1  # every rank counts the same fits: one key space per fit in the store
            self.watchdog = HangWatchdog(
                Path(trainer.default_root_dir), trainer.global_rank, trainer.world_size, self.hang_timeout_s,
                self.hang_poll_s, self.tracker, lambda analysis, beats: self._report_hang(trainer, analysis, beats),
                reap_children=trainer.local_rank == 0, store=watchdog_store(CommDebug._fits)).start()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.clock is not None:
            self.clock.batch_start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(trainer.global_step)
        if self.clock is None:
            return
        window = self.clock.batch_end(self.tracker)
        if window and self.measure_comm and window[0] > 0:
            step_s, comm_s = window
            self._shares.append(comm_s / step_s)
            # no sync_dist: every rank logs its own value, the loggers keep rank 0's
            pl_module.log_dict({"comm/ms": comm_s * 1e3, "comm/share": comm_s / step_s, **self._step_bytes()},
                               on_step=True, on_epoch=False)

    def _step_bytes(self) -> dict[str, float]:
        now = dict(self.tracker.bytes)
        step = {name: n - self._bytes_seen.get(name, 0) for name, n in now.items()}
        self._bytes_seen = now
        self._bytes_steps.append(step)
        return {f"comm/bytes_per_step/{name}": float(n) for name, n in step.items()}

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.clock is not None:
            self.clock.val_start()

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(trainer.global_step)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.clock is not None:
            self.clock.val_end()
        if self.watchdog is not None:
            self.watchdog.progress(trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop_watchdog()
        if self._shares and trainer.is_global_zero:
            mean = sum(self._shares) / len(self._shares)
            names = sorted({name for step in self._bytes_steps for name in step})
            per_step = {n: sum(s.get(n, 0) for s in self._bytes_steps) / len(self._bytes_steps) for n in names}
            sent = ", ".join(f"{n} {b / 1e6:.3g} MB" for n, b in per_step.items() if b)
            self.report(trainer, "info", "comm_summary",
                        f"rank 0 spent {mean:.0%} of its step time in collectives ({len(self._shares)} steps)"
                        + (f"; per step it sent {sent}" if sent else ""),
                        details={"mean_share": mean, "max_share": max(self._shares), "bytes_per_step": per_step},
                        rank=None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.watchdog is not None and self.watchdog.fired:
            self.watchdog.wait_for_exit()  # the watchdog is reporting the hang and ends the process
        self._stop_watchdog()

    def release(self, trainer: Any) -> None:
        """The hang watchdog stopped (its heartbeats end with the check: it would call a healthy run hung),
        the collective timing unhooked (base.py)."""
        self._stop_watchdog()
        if self.tracker is not None:
            self.tracker.release()
            self.tracker = None

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.release(trainer)
        if stage == "fit":  # the children are gone; leave the process environment as we found it
            for key, value in self._env_before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    # ---- watchdog thread, on the rank that claimed the hang flag -----------------------
    def _report_hang(self, trainer: Any, analysis: dict, beats: dict[int, dict]) -> None:
        from dsdebug.distributed.flight_recorder import DIR
        from dsdebug.distributed.hang_analysis import describe_hang
        from dsdebug.distributed.hang_watchdog import HANG_EXIT_CODE

        culprits, steps = analysis["culprits"], {b.get("step") for b in beats.values()}
        self.report(
            trainer, "error", "hang", describe_hang(analysis, beats, self.hang_timeout_s),
            advice="read hang_rank<r>.txt in the run dir for every thread's stack; fix what keeps the named rank "
                   "from reaching the collective (rank-conditional code, data/I/O stall); the collectives each "
                   "rank entered: `torchfrtrace <run_dir>/flight_recorder -p rank_` (copy every node's "
                   "flight_recorder/ files into one folder first); if the step is just slow (e.g. a big "
                   "checkpoint), raise callbacks.comm_debug.hang_timeout_s",
            details={**analysis, "heartbeats": beats, "dumps": [f"hang_rank{r}.txt" for r in sorted(beats)],
                     "flight_recorder": [f"{DIR}/rank_{r}" for r in sorted(beats)] if self.env.get(
                         "TORCH_FR_BUFFER_SIZE") else [],
                     "exit_code": HANG_EXIT_CODE},
            rank=culprits[0] if len(culprits) == 1 else None, step=min(steps) if len(steps) == 1 else None)
