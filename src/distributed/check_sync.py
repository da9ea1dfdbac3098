"""Keeps the checks' collectives aligned across ranks when a check fails on some ranks only.

The hazard: a check raises on rank 1 just before an all-reduce that rank 0 is already inside. The
failed check is switched off on rank 1 (callbacks/isolation.py), rank 1 goes on to the next step's
gradient all-reduce, and both ranks wait for each other forever. So every collective a check makes
is first *agreed* here, on a side channel that the failing rank can answer without knowing what the
others are doing.

The protocol (one ``CheckSync`` per fit, made by every rank at the first check's ``setup``):

- The side channel is a gloo process group of its own: its order of operations is independent of the
  training's collectives, and its tensors live on the host (no device sync on a GPU).
- Before each collective of check ``c`` (``before_collective``; the helpers in ``collectives.py`` call
  it, and ``collective_region`` for a block of library collectives such as ZeRO-3 gathers), every rank
  all-reduces a *header*: how many ranks stand at which position (a check's collective, a notice, the
  close at the end of the fit) and which checks have failed anywhere.
- A rank whose check failed posts a *notice* (a header at the notice position, its failure marked)
  asynchronously and goes on: it never blocks, so it cannot deadlock with the training.
- A rank reading a header: a check marked failed is switched off here too (``failed``); if that is the
  check it is about to run a collective for, the collective is dropped (``CheckAborted``: the notice
  answered this header, nothing to redo); if not every rank stood at this position (a notice or a
  failed check's header answered it), it posts the header again until every rank does. Other
  mismatches mean the ranks' checks diverged (a check's rank-rule bug): ``ChecksDiverged``.
- ``close`` at the end of the fit (every rank, the last check's ``teardown``) answers any notice still
  in flight, so a failure after a check's last collective is still known everywhere.

Cost: one all-reduce of ``2 * CAPACITY + 2`` int32 (~2 KB) on the host per collective a check makes;
nothing when no check makes one, nothing on one process. Rank rules: every method here except
``notice`` is COLLECTIVE on the side group (every rank, same order), ``notice`` is local (async).

What it cannot do: a rank that fails *inside* a collective region (between two of DeepSpeed's
gathers) leaves the others inside the training's process group, where no side channel reaches.
Regions hold library calls only (a ZeRO-3 gather, a probe's forward); a check's own logic runs
outside them.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from datetime import timedelta
from typing import Any, Iterator

import torch

__all__ = ["CAPACITY", "CheckAborted", "ChecksDiverged", "CheckSync", "before_collective", "collective_region",
           "current_check", "in_region"]

log = logging.getLogger(__name__)

CAPACITY = 256  # check slots per fit (ids 0..CAPACITY-1); a fit holds ~20 checks
_NOTICE, _CLOSE = 0, CAPACITY + 1  # positions; check id c stands at c + 1

# (sync, check id, inside a region?) of the check hook running now; set by the guard (callbacks/isolation.py)
_current: contextvars.ContextVar[tuple[CheckSync | None, int, bool] | None] = contextvars.ContextVar(
    "dsdebug_check", default=None)


class CheckAborted(Exception):
    """This check failed on another rank: its collective here is dropped and the check switched off."""


class ChecksDiverged(RuntimeError):
    """The ranks stand at different checks' collectives with no failure to explain it (a rank-rule bug)."""


class CheckSync:
    """The side channel of one fit (see the module docstring). ``group``: a gloo process group of
    every rank (``create``); ``world``: its size."""

    def __init__(self, group: Any, world: int, rank: int) -> None:
        self.group, self.world, self.rank = group, world, rank
        self.failed: set[int] = set()  # check ids failed on some rank, as far as this rank knows
        self.headers = 0  # headers this rank exchanged (tests, the cost table)
        self._in_flight: list[tuple[Any, torch.Tensor]] = []  # notices posted, not yet known complete

    @classmethod
    def create(cls, timeout: timedelta | None = None) -> CheckSync | None:
        """A side group over every rank, or None on one process. COLLECTIVE (default group): every rank,
        same point (the first check's ``setup``). ``timeout``: the run's process-group timeout (a header
        waits as long as the run's collectives do); None: the backend's default. A side group that cannot be
        made (no gloo in this build) leaves the checks without agreement, with a warning: the run goes on."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return None
        from torch.distributed.distributed_c10d import _get_default_timeout, get_backend

        if not isinstance(timeout, timedelta):
            timeout = _get_default_timeout(get_backend())
        try:
            group = dist.new_group(backend="gloo", timeout=timeout if isinstance(timeout, timedelta) else None)
        except Exception as e:  # noqa: BLE001 - alike on every rank (the build's backends)
            log.warning("fault isolation: no side channel for the checks (%s: %s): a check that fails on one rank "
                        "only may leave the others waiting in its next collective", type(e).__name__, e)
            return None
        return cls(group, dist.get_world_size(), dist.get_rank())

    # ---- the header -------------------------------------------------------------------------
    def _header(self, position: int, also_failed: int | None = None) -> torch.Tensor:
        t = torch.zeros(2 * CAPACITY + 2, dtype=torch.int32)
        t[position] = 1
        for c in self.failed | ({also_failed} if also_failed is not None else set()):
            t[CAPACITY + 2 + c] = 1
        return t

    def _exchange(self, position: int) -> torch.Tensor:
        t = self._header(position)
        _all_reduce()(t, group=self.group)  # COLLECTIVE (side group): every rank, host memory
        self.headers += 1
        self.failed.update(int(c) for c in torch.nonzero(t[CAPACITY + 2:]).flatten().tolist())
        return t

    def _explained(self, at: torch.Tensor, position: int) -> bool:
        """Whether the ranks not at ``position`` stood at a notice or at a failed check's collective."""
        others = [p for p in torch.nonzero(at).flatten().tolist() if p != position]
        return all(p == _NOTICE or (0 < p <= CAPACITY and p - 1 in self.failed) for p in others)

    def _settle(self, position: int, check: int | None) -> None:
        while True:
            at = self._exchange(position)[:CAPACITY + 2]
            if check is not None and check in self.failed:
                raise CheckAborted(f"check {check} failed on another rank")
            if int(at[position]) == self.world:
                return
            if not self._explained(at, position):
                where = {p: int(n) for p, n in enumerate(at.tolist()) if n}
                raise ChecksDiverged(f"ranks stand at different check collectives (position: ranks {where}; "
                                     f"this rank at {position}): a check decided a collective on some ranks only")

    # ---- the three acts -----------------------------------------------------------------------
    def agree(self, check: int) -> None:
        """Before a collective of ``check``: returns when every rank stands there; raises CheckAborted
        when the check failed on some rank. COLLECTIVE (side group)."""
        if check in self.failed:
            raise CheckAborted(f"check {check} failed on another rank")
        self._settle(check + 1, check)

    def notice(self, check: int) -> None:
        """This rank's ``check`` failed: tell the others without waiting for them. Local (async)."""
        self.failed.add(check)
        t = self._header(_NOTICE, also_failed=check)
        self._in_flight.append((_all_reduce()(t, group=self.group, async_op=True), t))
        self._in_flight = [(w, x) for w, x in self._in_flight if not w.is_completed()]

    def close(self) -> set[int]:
        """End of the fit: answer the notices still in flight; returns every check failed on some rank.
        COLLECTIVE (side group): every rank, once, after the checks' last collective."""
        self._settle(_CLOSE, None)
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()
        return set(self.failed)

    def destroy(self) -> None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)


def _all_reduce() -> Any:
    """torch's all_reduce itself, not comm_debug's timing wrapper (distributed/timing.py): the headers are
    the checks' bookkeeping, not the run's communication."""
    import torch.distributed as dist

    fn = dist.all_reduce
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


# ---- what the collective helpers call ------------------------------------------------------------
def current_check() -> tuple[CheckSync | None, int, bool] | None:
    return _current.get()


def in_region() -> bool:
    now = _current.get()
    return bool(now and now[2])


def before_collective() -> None:
    """Agree before a collective of the check running now (none running, one process, inside a region:
    nothing to do). COLLECTIVE when it acts."""
    now = _current.get()
    if now is None or now[0] is None or now[2]:
        return
    now[0].agree(now[1])


@contextlib.contextmanager
def collective_region() -> Iterator[None]:
    """A block of library collectives (ZeRO-3 gathers, a probe's forward under ZeRO-3), agreed once at
    its entry instead of at each collective inside it. COLLECTIVE when it acts (see the module docstring
    for what a failure inside it cannot be saved from)."""
    now = _current.get()
    if now is None or now[0] is None or now[2]:
        yield
        return
    now[0].agree(now[1])
    token = _current.set((now[0], now[1], True))
    try:
        yield
    except BaseException as exc:  # marked for the guard: the other ranks may be inside the block, waiting
        with contextlib.suppress(Exception):
            exc.dsdebug_in_region = True  # type: ignore[attr-defined]
        raise
    finally:
        _current.reset(token)


@contextlib.contextmanager
def running(sync: CheckSync | None, check: int) -> Iterator[None]:
    """Mark ``check``'s hook as the one running (the guard, around each hook call)."""
    token = _current.set((sync, check, False))
    try:
        yield
    finally:
        _current.reset(token)
