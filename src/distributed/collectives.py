"""The collectives the checks make, in one place (a collective on some ranks only is a hang).

Every one is COLLECTIVE: every rank calls it at the same point. Inside a check's hook each first agrees
with the other ranks on the side channel (``check_sync.before_collective``), so a check that failed on
another rank drops its collective there too (``CheckAborted``) instead of waiting forever. Checks call
these, never ``trainer.strategy.reduce`` / ``torch.distributed`` directly (tests/callbacks/test_isolation.py
holds the rule); a block of library collectives (ZeRO-3 gathers, a forward under ZeRO-3) is wrapped in
``collective_region()``.

An error inside the collective itself is marked as the run's failure (``_the_runs_failure``).

On one process each returns its input (``reduce``, ``broadcast``), ``[input]`` shapes (``all_gather``)
or the flag, without a collective.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, TypeVar

import torch

from dsdebug.distributed.check_sync import CheckAborted, before_collective, collective_region

__all__ = ["all_gather", "all_gather_object", "any_rank", "barrier", "broadcast", "collective_region",
           "gather_object", "reduce"]


F = TypeVar("F", bound=Callable[..., Any])


def _the_runs_failure(fn: F) -> F:
    """An error of the collective itself (a peer died, the process group broke: gloo raises a plain
    RuntimeError) is the run's failure, not the check's: marked ``dsdebug_collective`` so the fault isolation
    lets it through (isolation.py) instead of calling it a check's bug."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CheckAborted:
            raise
        except Exception as exc:
            with contextlib.suppress(Exception):
                exc.dsdebug_collective = True  # type: ignore[attr-defined]
            raise

    return call  # type: ignore[return-value]


def _distributed(trainer: Any) -> bool:
    return trainer is not None and trainer.world_size > 1


@_the_runs_failure
def any_rank(trainer: Any, flag: bool) -> bool:
    """True if ``flag`` is True on any rank. COLLECTIVE: every rank must call it."""
    if not _distributed(trainer):
        return bool(flag)
    before_collective()
    t = torch.tensor([1.0 if flag else 0.0], device=trainer.strategy.root_device)
    return bool(trainer.strategy.reduce(t, reduce_op="max").item() > 0)


@_the_runs_failure
def reduce(trainer: Any, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``tensor`` reduced over ranks (``sum``/``max``/``min``/``mean``), on the strategy's device; on one
    process ``tensor`` itself. COLLECTIVE."""
    if not _distributed(trainer):
        return tensor
    before_collective()
    return trainer.strategy.reduce(tensor.to(trainer.strategy.root_device), reduce_op=op)


@_the_runs_failure
def all_gather(trainer: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` stacked: ``[world, *shape]`` (on one process ``[1, *shape]``). COLLECTIVE."""
    if not _distributed(trainer):
        return tensor.unsqueeze(0)
    before_collective()
    return trainer.strategy.all_gather(tensor.to(trainer.strategy.root_device))


@_the_runs_failure
def broadcast(trainer: Any, obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (any picklable value) on every rank. COLLECTIVE."""
    if not _distributed(trainer):
        return obj
    before_collective()
    return trainer.strategy.broadcast(obj, src=src)


@_the_runs_failure
def barrier(trainer: Any, name: str | None = None) -> None:
    """Every rank waits here for the others. COLLECTIVE."""
    if not _distributed(trainer):
        return
    before_collective()
    trainer.strategy.barrier(name)


@_the_runs_failure
def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, through the default process group; ``[obj]``
    without one. COLLECTIVE."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return [obj]
    before_collective()
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@_the_runs_failure
def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` on rank ``dst`` (in rank order), None elsewhere. COLLECTIVE."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return [obj]
    before_collective()
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out
