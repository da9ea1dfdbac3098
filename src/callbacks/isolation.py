"""Fault isolation: a check never kills the run it watches.

Every Lightning hook a check (``DebugCallback``) defines runs inside a guard (``isolate``, applied by
``DebugCallback.__init_subclass__``, so a check cannot forget it and a plain Lightning project gets it
too). An exception raised by the check's code becomes one ``error`` finding ``<check>/check_failed``
(the hook, the exception, the step, the rank, the traceback's last frames in ``details``) and the check
is switched off for the rest of the run: its hooks return at once, the module and tensor hooks it
registered through ``guarded`` do nothing. The run goes on and ends with its own status.

Across ranks (a check's collective on some ranks only is a hang): the checks' collectives go through
``distributed/collectives.py``, which agrees on a side channel first (``distributed/check_sync.py``).
A failure posts a notice there without waiting; the other ranks meet it at their next collective of
that check (or of any check, or the close at the end of the fit) and switch the check off before it, so
no rank is left inside a collective the failed rank will never join. Inside a block of collectives
agreed once (``collective_region``: ZeRO-3 gathers, a rerun of the model) no notice can reach a rank that
is already in it: a failure there is reported (``in_region`` in its details) and ends the run; so is one
inside ``changing_training_state`` (a rollback's load: a half-changed model must not go on training).

Let through, never isolated: user errors (``ConfigError``: a bad config value a check finds is the
user's to fix, one line, exit 2), ``StoppedByCheck``, Lightning's clean stop (``_TunerExitException``,
the doctor's), a broken process group (``torch.distributed.DistError``: the run's failure, not the
check's; likewise any error raised inside one of the checks' collectives, marked by
``distributed/collectives.py``: gloo's are plain RuntimeErrors), and ``KeyboardInterrupt``/``SystemExit``.

Strict mode re-raises instead (the test suite and developers: the checks' own bugs must fail tests):
``debug.strict=true`` in the run's config (``set_strict``), else the environment variable
``DSDEBUG_STRICT=1``. Default: isolate.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import traceback
import weakref
from typing import Any, Callable, Iterator

from dsdebug.distributed import check_sync
from dsdebug.errors import ConfigError, PreemptedAtStartup, StoppedByCheck
from dsdebug.findings import Finding, get_channel

__all__ = ["HOOKS", "guarded", "is_off", "isolate", "set_strict", "strict"]

log = logging.getLogger(__name__)

#: the Lightning Callback methods a check may define, each run inside the guard
HOOKS = (
    "setup", "teardown", "state_dict", "load_state_dict", "on_exception",
    "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "on_save_checkpoint", "on_load_checkpoint",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end",
    "on_test_batch_start", "on_test_batch_end",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_predict_batch_start", "on_predict_batch_end",
)
_NO_TRAINER = ("state_dict", "load_state_dict")  # called without the trainer
_TRACEBACK_FRAMES = 8

_strict: bool | None = None  # set_strict: the run's config; None = the environment decides


def set_strict(value: bool | None) -> None:
    """``debug.strict`` of the run's config: True re-raises a check's exception, False isolates it,
    None leaves it to ``DSDEBUG_STRICT``."""
    global _strict
    _strict = None if value is None else bool(value)


def strict() -> bool:
    if _strict is not None:
        return _strict
    return os.environ.get("DSDEBUG_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


def _let_through() -> tuple[type[BaseException], ...]:
    out: list[type[BaseException]] = [ConfigError, StoppedByCheck, PreemptedAtStartup]
    try:
        from lightning.pytorch.utilities.exceptions import _TunerExitException

        out.append(_TunerExitException)
    except ImportError:  # pragma: no cover - Lightning without it
        pass
    import torch.distributed as dist

    if hasattr(dist, "DistError"):
        out.append(dist.DistError)
    return tuple(out)


_LET_THROUGH: tuple[type[BaseException], ...] | None = None


# ---- one fit's checks: their ids on the side channel, which one closes it ---------------------------
class _Session:
    """The checks of one Trainer's fit (or validate/test): their ids, the side channel, the last check."""

    def __init__(self, trainer: Any) -> None:
        from dsdebug.callbacks.base import DebugCallback  # the guard's own package; base imports this module

        checks = [cb for cb in getattr(trainer, "callbacks", []) or []
                  if isinstance(cb, DebugCallback) and type(cb).isolated]
        self.ids = {id(cb): i for i, cb in enumerate(checks[:check_sync.CAPACITY])}
        self.last = id(checks[-1]) if checks else None
        timeout = getattr(getattr(trainer, "strategy", None), "_timeout", None)  # the run's (comm_debug may set it)
        self.sync = check_sync.CheckSync.create(timeout) if self.ids else None  # COLLECTIVE (default group)
        self.closed = False

    def close(self) -> set[int]:
        if self.closed or self.sync is None:
            return set()
        self.closed = True
        failed = self.sync.close()  # COLLECTIVE (side group): every rank, after the checks' last collective
        self.sync.destroy()
        return failed


_sessions: "weakref.WeakKeyDictionary[Any, _Session]" = weakref.WeakKeyDictionary()


def _session(trainer: Any) -> _Session | None:
    try:
        return _sessions.get(trainer)
    except TypeError:  # not weak-referenceable (a unit test's stand-in)
        return None


def _open_session(check: Any, trainer: Any) -> None:
    """At ``setup``: the first check of the trainer's list opens the fit's session (every rank)."""
    from dsdebug.callbacks.base import DebugCallback
    from lightning.pytorch import Trainer

    if not isinstance(trainer, Trainer):
        return
    first = next((cb for cb in trainer.callbacks if isinstance(cb, DebugCallback) and type(cb).isolated), None)
    if first is check:
        old = _sessions.get(trainer)
        if old is not None and not old.closed and old.sync is not None:
            old.sync.destroy()  # a fit that ended without its teardown (an exception): its channel is dropped
        _sessions[trainer] = _Session(trainer)
    session = _sessions.get(trainer)
    if session is not None:
        check.__dict__["_isolation_off"] = None  # a new fit runs every check again


# ---- the guard --------------------------------------------------------------------------------------
def is_off(check: Any) -> bool:
    return check.__dict__.get("_isolation_off") is not None


def _trainer_of(check: Any, hook: str, args: tuple) -> Any:
    if hook in _NO_TRAINER:
        ref = check.__dict__.get("_isolation_trainer")
        return ref() if ref is not None else None
    return args[0] if args else None


def _switch_off(check: Any, reason: str, trainer: Any = None) -> None:
    """Off for the rest of the fit, and what it put on the process released at once (``release``)."""
    check.__dict__["_isolation_off"] = reason
    _release(check, trainer)


def _release(check: Any, trainer: Any) -> None:
    """``check.release(trainer)`` (idempotent, local); never raises into the run."""
    release = getattr(check, "release", None)
    if release is None:
        return
    try:
        release(trainer)
    except Exception as e:  # noqa: BLE001 - the run goes on; the log says what may be left behind
        log.warning("isolation: %s (switched off) could not release what it set up: %s: %s", check.name,
                    type(e).__name__, e)


def in_region(exc: BaseException) -> bool:
    """Raised inside a block of collectives (``collective_region``) of a distributed run: the other ranks may
    be inside it, waiting for this one, where no notice reaches them."""
    return bool(getattr(exc, "dsdebug_in_region", False))


_CHANGING = "it failed while changing what trains (the weights or the optimizer may be half changed)"


@contextlib.contextmanager
def changing_training_state() -> Iterator[None]:
    """A block of a check that changes what trains (a rollback loading weights and optimizer state): an
    exception in it cannot be isolated -- switched off, the check would leave a half-loaded model training,
    on some ranks only -- so it is reported and ends the run, as inside a block of collectives."""
    try:
        yield
    except BaseException as exc:
        with contextlib.suppress(Exception):
            exc.dsdebug_fatal = _CHANGING  # type: ignore[attr-defined]
        raise


def fatal_reason(exc: BaseException) -> str | None:
    """Why ``exc`` must end the run rather than switch its check off; None: it can be isolated."""
    if in_region(exc):
        return "it failed inside a block of collectives the other ranks may be waiting in"
    return getattr(exc, "dsdebug_fatal", None)


def _fail(check: Any, trainer: Any, hook: str, exc: BaseException) -> None:
    """Report ``check_failed`` (this rank) and switch the check off; tell the other ranks (async). Raised
    inside a block of collectives (``in_region``): reported, and the caller re-raises (the run stops)."""
    fatal = fatal_reason(exc)
    if getattr(exc, "dsdebug_reported", False):  # a module hook's failure, met again by the hook around it
        return
    rank = getattr(trainer, "global_rank", None)
    step = getattr(trainer, "global_step", None)
    what = f"{type(exc).__name__} {str(exc)[:300]!s}" if str(exc) else type(exc).__name__
    if isinstance(exc, KeyError):
        what = f"KeyError {exc.args[0]!r}" if exc.args else "KeyError"
    where = f"at step {step}" if step is not None else "at setup"
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(frames[-_TRACEBACK_FRAMES:])
    _switch_off(check, f"{type(exc).__name__} in {hook}", trainer)
    session = _session(trainer)
    check_id = session.ids.get(id(check)) if session is not None else None
    if not fatal and session is not None and session.sync is not None and check_id is not None:
        try:
            session.sync.notice(check_id)  # local, async: the other ranks drop its next collective
        except Exception as e:  # the side channel itself is broken (a rank died): the run will see it
            log.warning("isolation: could not tell the other ranks that %s failed: %s", check.name, e)
    try:
        get_channel().report(Finding(
            check=check.name, severity="error", code="check_failed",
            message=f"a check failed: {check.name}, {what} in {hook} {where}"
                    + (f" on rank {rank}" if rank is not None else "")
                    + (f"; {fatal}, so the run stops here (switching the check off could not undo that)" if fatal else
                       "; it was switched off for the rest of the run (on every rank), which goes on"),
            advice=("details.traceback says what failed (a bug in the check: please report it); "
                    f"~callbacks.{check.name} removes the check, and the run can resume from its last checkpoint"
                    if fatal else
                    "the run itself is unaffected, only this check's judgement is missing from here on: this is a "
                    "bug in the check (traceback in this finding's details.traceback), please report it; "
                    f"debug.strict=true re-raises instead, ~callbacks.{check.name} removes the check"),
            step=step, rank=rank,
            details={"hook": hook, "exception": type(exc).__name__, "error": str(exc)[:2000],
                     "traceback": tail, "in_region": in_region(exc), "fatal": fatal},
        ))
        with contextlib.suppress(Exception):
            exc.dsdebug_reported = True  # type: ignore[attr-defined]
    except Exception as e:  # the channel must not fail either; the log line is the last resort
        log.error("isolation: %s failed in %s (%s) and its finding could not be written: %s", check.name, hook,
                  what, e)


def _call(check: Any, fn: Callable, hook: str, args: tuple, kwargs: dict) -> Any:
    global _LET_THROUGH
    default = {} if hook == "state_dict" else None
    if check.__dict__.get("_isolation_running"):  # a hook calling another (super().setup): one guard
        return fn(check, *args, **kwargs)
    trainer = _trainer_of(check, hook, args)
    if hook == "setup":
        try:
            check.__dict__["_isolation_trainer"] = weakref.ref(trainer)
        except TypeError:
            check.__dict__["_isolation_trainer"] = None
        _open_session(check, trainer)  # COLLECTIVE (first check, distributed): every rank
    session = _session(trainer)
    check_id = session.ids.get(id(check)) if session is not None else None
    sync = session.sync if session is not None else None
    if sync is not None and check_id is not None and check_id in sync.failed and not is_off(check):
        _switch_off(check, "failed on another rank", trainer)
        log.info("isolation: %s switched off here: it failed on another rank", check.name)
    try:
        if is_off(check):
            if hook in ("teardown", "on_exception"):  # its own end-of-run cleanup does not run: release
                _release(check, trainer)
            return default
        check.__dict__["_isolation_running"] = True
        try:
            # a check past the side channel's capacity has no id: it agrees with nobody (alike on every rank)
            with check_sync.running(sync if check_id is not None else None, -1 if check_id is None else check_id):
                return fn(check, *args, **kwargs)
        except check_sync.CheckAborted:
            _switch_off(check, "failed on another rank", trainer)
            log.info("isolation: %s switched off here before its collective in %s: it failed on another rank",
                     check.name, hook)
            return default
        except Exception as exc:
            if _LET_THROUGH is None:
                _LET_THROUGH = _let_through()
            if isinstance(exc, _LET_THROUGH) or getattr(exc, "dsdebug_collective", False) or strict():
                raise
            _fail(check, trainer, hook, exc)
            if fatal_reason(exc):
                raise
            return default
        finally:
            check.__dict__["_isolation_running"] = False
    finally:
        if hook == "teardown" and session is not None and session.last == id(check):
            _close(check, session, trainer)


def _close(check: Any, session: _Session, trainer: Any) -> None:
    """The last check's teardown: every rank closes the side channel (answers notices still in flight)."""
    try:
        failed = session.close()  # COLLECTIVE (side group)
    except Exception as e:  # a rank died: nothing left to agree on
        log.warning("isolation: the checks' side channel did not close: %s", e)
        return
    if failed:
        names = {i: type(cb).__name__ for cb in getattr(trainer, "callbacks", []) for i in
                 [session.ids.get(id(cb))] if i is not None}
        log.info("isolation: checks switched off during the run: %s", ", ".join(sorted(names.get(i, str(i))
                                                                                        for i in failed)))


def isolate(cls: type, hooks: tuple[str, ...] = HOOKS) -> None:
    """Wrap every hook ``cls`` itself defines (not inherited ones: those are wrapped where defined)."""
    for hook in hooks:
        fn = cls.__dict__.get(hook)
        if fn is None or not callable(fn) or getattr(fn, "_isolated", False):
            continue

        def make(fn: Callable = fn, hook: str = hook) -> Callable:
            @functools.wraps(fn)
            def guarded_hook(self: Any, *args: Any, **kwargs: Any) -> Any:
                if not type(self).isolated:
                    return fn(self, *args, **kwargs)
                return _call(self, fn, hook, args, kwargs)

            guarded_hook._isolated = True  # type: ignore[attr-defined]
            return guarded_hook

        setattr(cls, hook, make())


class _Guarded:
    """``fn`` inside ``check``'s guard (see ``guarded``). A class, not a closure: the user's model holds it (a
    module hook), and a model or a check that reaches it must still pickle (ddp_spawn)."""

    def __init__(self, check: Any, fn: Callable, where: str) -> None:
        self.check, self.fn, self.where = check, fn, where
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _LET_THROUGH
        check = self.check
        if is_off(check):
            return None
        if not type(check).isolated:
            return self.fn(*args, **kwargs)
        try:
            return self.fn(*args, **kwargs)
        except Exception as exc:
            if _LET_THROUGH is None:
                _LET_THROUGH = _let_through()
            if isinstance(exc, _LET_THROUGH) or getattr(exc, "dsdebug_collective", False) or strict():
                raise
            ref = check.__dict__.get("_isolation_trainer")
            _fail(check, ref() if ref is not None else None, self.where, exc)
            if fatal_reason(exc):
                raise
            return None


def guarded(check: Any, fn: Callable, where: str) -> Callable:
    """``fn`` (a module forward hook, a tensor gradient hook, ...) run inside ``check``'s guard: nothing
    once the check is off; an exception is the check's failure (``check_failed``, ``where`` as its
    hook) and returns None (the hook changes nothing). For hooks a check registers on the user's model."""
    return _Guarded(check, fn, where)
