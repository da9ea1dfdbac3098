"""`StepClock`: one rank's step windows (and the seconds of each spent in collectives), shared by
comm_debug and log_sync."""

from __future__ import annotations

import time

from dsdebug.distributed.timing import CommTracker

__all__ = ["StepClock"]


class StepClock:
    """One rank's step windows: train batch end -> next train batch end (data loading and
    every hook included), validation and checkpoint saves excluded. Times are this rank's
    perf_counter."""

    def __init__(self) -> None:
        self.start: float | None = None
        self._val: list[tuple[float, float]] = []
        self._val_start: float | None = None

    def batch_start(self) -> None:
        if self.start is None:  # first batch: the sanity check before it is not a step
            self.start, self._val = time.perf_counter(), []

    def val_start(self) -> None:
        self._val_start = time.perf_counter()

    def val_end(self) -> None:
        if self._val_start is not None:
            self._val.append((self._val_start, time.perf_counter()))
            self._val_start = None

    def batch_end(self, tracker: CommTracker | None) -> tuple[float, float] | None:
        """(step seconds, seconds in collectives) of the window that just ended."""
        now, start, vals = time.perf_counter(), self.start, self._val
        self.start, self._val = now, []
        if start is None:
            return None
        from dsdebug.checkpoint.integrity import SAVE_WINDOWS

        vals = vals + [(s, e) for s, e in SAVE_WINDOWS if s >= start and e <= now]
        step = now - start - sum(e - s for s, e in vals)
        comm = 0.0
        if tracker is not None:
            comm = tracker.busy_s(start, now) - sum(tracker.busy_s(s, e) for s, e in vals)
        return step, max(0.0, min(comm, step))
