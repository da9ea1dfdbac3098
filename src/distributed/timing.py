"""Timing and byte counting of every collective this process runs (`CommTracker`), and the DDP
comm-hook side of it: DDP's C++ reducer calls the process group directly, not
``torch.distributed.all_reduce``, so its gradient buckets are only seen through a comm hook.

Bytes are the payload this rank hands to the collective (``numel * element_size`` of the input:
the tensor of an all_reduce/broadcast, this rank's shard of an all_gather, the full input of a
reduce_scatter), summed per collective name. A compressed DDP hook (fp16/bf16, PowerSGD) calls
``torch.distributed.all_reduce`` on the compressed tensors, so its bytes are the compressed ones.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import defaultdict, deque
from typing import Any

__all__ = ["CommTracker", "payload_bytes", "register_ddp_hook"]

log = logging.getLogger(__name__)

# torch.distributed entry points that DeepSpeed's comm backend, Lightning and user code call
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
                "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "barrier",
                "monitored_barrier", "all_to_all", "all_to_all_single", "all_gather_object",
                "broadcast_object_list", "gather", "scatter", "gather_object", "scatter_object_list",
                "_broadcast_coalesced")  # DDP's buffer/parameter broadcast


class CommTracker:
    """Process-wide record of collectives: how many were entered (``seq``), which are in
    flight, and when each finished, so a window's comm time is the union of their spans.

    Wraps the ``torch.distributed`` collectives (module attributes, which DeepSpeed's
    ``deepspeed.comm`` backend, Lightning's reduce/gather and user code call) and DeepSpeed's
    cached all-gather/reduce-scatter functions; DDP's C++ reducer is reached through a comm
    hook (`register_ddp_hook`). An async op counts until its future completes. Shared by
    reference count (`acquire`/`release`); the last release restores the originals."""

    _instance: CommTracker | None = None

    @classmethod
    def acquire(cls) -> CommTracker:
        if cls._instance is None:
            cls._instance = cls()
            cls._instance._install()
        cls._instance._users += 1
        return cls._instance

    def release(self) -> None:
        self._users -= 1
        if self._users <= 0 and CommTracker._instance is self:
            self._uninstall()
            CommTracker._instance = None

    def __init__(self) -> None:
        self._users = 0
        self.seq = 0  # outermost collectives entered by this process
        self.last: tuple[str, int, float] | None = None  # (name, seq, wall time) of the last entered
        self.inflight: dict[int, tuple[str, float, int]] = {}  # token -> (name, perf start, seq)
        self._done: deque[tuple[float, float]] = deque(maxlen=20_000)  # (start, end), completion order
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._local = threading.local()
        self._originals: dict[str, Any] = {}
        self._patched: list[tuple[Any, str, Any]] = []
        self.ddp_models: set[int] = set()
        self.bytes: defaultdict[str, int] = defaultdict(int)  # collective name -> bytes handed to it

    def enter(self, name: str) -> int:
        token = next(self._tokens)
        self.seq += 1
        self.inflight[token] = (name, time.perf_counter(), self.seq)
        self.last = (name, self.seq, time.time())
        return token

    def exit(self, token: int) -> None:  # may run on a backend thread (future callbacks)
        entry = self.inflight.pop(token, None)
        if entry is not None:
            with self._lock:
                self._done.append((entry[1], time.perf_counter()))

    def busy_s(self, lo: float, hi: float) -> float:
        """Seconds within [lo, hi] (perf_counter) when at least one collective was running."""
        spans = [(start, hi) for _, start, _ in list(self.inflight.values())]
        with self._lock:
            for start, end in reversed(self._done):
                if end < lo:
                    break
                spans.append((start, end))
        total, cur_s, cur_e = 0.0, None, None
        for s, e in sorted((max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi):
            if cur_e is None or s > cur_e:
                total += 0.0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + (0.0 if cur_e is None else cur_e - cur_s)

    def original(self, name: str) -> Any:
        import torch.distributed as dist

        return self._originals.get(name, getattr(dist, name))

    def _wrap(self, name: str, fn: Any) -> Any:
        tracker = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            local = tracker._local
            if getattr(local, "depth", 0):  # nested in a tracked collective (all_gather_object -> all_gather)
                return fn(*args, **kwargs)
            token = tracker.enter(name)
            try:
                tracker.bytes[name] += payload_bytes(name, args, kwargs)
            except Exception:  # noqa: BLE001 - the run's collective must go on whatever the count does
                log.debug("comm tracker: no byte count for %s", name, exc_info=True)
            local.depth = 1
            try:
                work = fn(*args, **kwargs)
            except BaseException:
                tracker.exit(token)
                raise
            finally:
                local.depth = 0
            if work is not None and hasattr(work, "get_future"):  # async_op=True: done when the future is
                try:
                    work.get_future().add_done_callback(lambda _f: tracker.exit(token))
                    return work
                except Exception:  # noqa: BLE001 - a backend without futures: count the launch only
                    pass
            tracker.exit(token)
            return work

        return timed

    def _install(self) -> None:
        import sys

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        wrapped = {}
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._originals[name], wrapped[name] = fn, self._wrap(name, fn)
                for owner in (dist, c10d):
                    if getattr(owner, name, None) is fn:
                        self._patched.append((owner, name, fn))
                        setattr(owner, name, wrapped[name])
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        cdb = getattr(ds_comm, "cdb", None)
        for attr in ("all_gather_function", "reduce_scatter_function"):  # cached at DeepSpeed's init
            fn = getattr(cdb, attr, None)
            name = getattr(fn, "__name__", "")
            if fn is not None and self._originals.get(name) is fn:
                self._patched.append((cdb, attr, fn))
                setattr(cdb, attr, wrapped[name])

    def _uninstall(self) -> None:
        for owner, attr, fn in reversed(self._patched):
            setattr(owner, attr, fn)
        self._patched.clear()


def _timed_allreduce_hook(state, bucket):  # unannotated: DDP rejects any annotation but its own types
    """DDP's default allreduce (mean) hook, timed: launch -> the bucket's future completes."""
    tracker, group = state
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    token = tracker.enter(f"ddp.allreduce(bucket {bucket.index()})")
    tracker.bytes["all_reduce"] += tensor.numel() * tensor.element_size()
    tensor.div_(group.size())
    fut = tracker.original("all_reduce")(tensor, group=group, async_op=True).get_future()

    def done(f: Any) -> Any:
        tracker.exit(token)
        return f.value()[0]

    return fut.then(done)


def register_ddp_hook(trainer: Any, tracker: CommTracker) -> str | None:
    """Time DDP's bucket allreduces; None on success or when not DDP, else why not."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(trainer.strategy, "model", None)
    if not isinstance(model, DistributedDataParallel) or id(model) in tracker.ddp_models:
        return None
    if getattr(trainer.strategy, "comm_hook", "none") != "none":
        return None  # the configured hook calls torch.distributed.all_reduce: the tracker sees it
    try:
        model.register_comm_hook(state=(tracker, model.process_group), hook=_timed_allreduce_hook)
    except RuntimeError as e:  # the user's own comm hook is registered (only one is allowed)
        return str(e).splitlines()[0]
    tracker.ddp_models.add(id(model))
    return None


# where the payload a rank sends sits in each collective's arguments: (position, keyword)
_INPUT_ARG = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
              "gather": (0, "tensor"), "all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor"),
              "_all_gather_base": (1, "input_tensor"), "reduce_scatter": (1, "input_list"),
              "reduce_scatter_tensor": (1, "input"), "_reduce_scatter_base": (1, "input"),
              "all_to_all": (1, "input_tensor_list"), "all_to_all_single": (1, "input"),
              "scatter": (1, "scatter_list"), "_broadcast_coalesced": (1, "tensors")}


def payload_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """Bytes of the tensor(s) this rank hands to collective ``name`` (0 for object/barrier calls)."""
    where = _INPUT_ARG.get(name)
    if where is None:
        return 0
    value = args[where[0]] if len(args) > where[0] else kwargs.get(where[1])
    return _nbytes(value)


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.numel()) * int(value.element_size())
    return 0
