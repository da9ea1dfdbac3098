"""A preemption signal while a run is still starting: recorded, not fatal.

Schedulers send SIGUSR1/SIGTERM at any moment, also in the first minute of a job (imports,
DeepSpeed init, a first-use op build), long before the preemption callback
(``checkpoint/preemption.py``) exists. Without a handler such a signal kills the process by its
default action (exit 138/143) and a requeue script that waits for status ``preempted`` never
requeues. So:

- ``record_from_now()``, the first thing the entry point does (train.py, ``dsdebug.train``; stdlib
  only, before any heavy import), installs a handler that only remembers the first signal;
- once the config is composed, ``settle(signals)`` gives the signals the run does not treat as
  preemption (``preemption.signals``; all of them with ``preemption.enabled=false``) their default
  action back (one that already arrived acts now) and records the extra ones it names;
- ``trainer/cli.py`` and ``trainer/entry.py`` ask ``received()`` at each stage before fit and end
  the run as ``preempted`` (exit 0, nothing to save); inside fit ``PreemptionCheckpoint`` takes the
  recorded signal over (``take_over``) and the ranks agree at ``on_train_start``.

Main thread only (Python's rule for signal handlers); a handler someone else installed is left alone.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["DEFAULT_SIGNALS", "is_recorder", "received", "received_name", "record_from_now", "settle",
           "stop_if_received", "take_over"]

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")  # conf/train.yaml preemption.signals

_received: int | None = None
_recording: set[int] = set()


def _record(signum: int, frame: Any) -> None:
    global _received
    if _received is None:
        _received = signum


def _install(signum: int) -> None:
    if signal.getsignal(signum) in (signal.SIG_DFL, None):
        signal.signal(signum, _record)
        _recording.add(signum)


def record_from_now(names: tuple[str, ...] = DEFAULT_SIGNALS) -> None:
    """Record these signals from now on (main thread; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in names:
        _install(getattr(signal, name))


def settle(names: list[str] | tuple[str, ...]) -> None:
    """The config is known: record exactly ``names`` (the run's preemption signals). A signal
    recorded so far that is not among them gets its default action now."""
    if threading.current_thread() is not threading.main_thread():
        return
    global _received
    wanted = {getattr(signal, n) for n in names if hasattr(signal, n) and n != "SIGINT"}  # Ctrl-C stays Ctrl-C
    for signum in sorted(_recording - wanted):
        _recording.discard(signum)
        if signal.getsignal(signum) is _record:
            signal.signal(signum, signal.SIG_DFL)
    if _received is not None and _received not in wanted:
        late, _received = _received, None
        signal.raise_signal(late)  # what it would have done without us
    for signum in sorted(wanted - _recording):
        _install(signum)


def received() -> int | None:
    """The first preemption signal this process got since ``record_from_now``, if any."""
    return _received


def received_name() -> str | None:
    return signal.Signals(_received).name if _received is not None else None


def stop_if_received(stage: str) -> None:
    """Before fit, in the one process of a run our launcher starts (no rank has been started yet,
    no peer waits for it): a recorded signal ends the run here. Under an external launcher (torchrun,
    srun) every rank goes on to fit, where the ranks agree (PreemptionCheckpoint.on_train_start)."""
    import os

    from dsdebug.distributed.launch_env import detect
    from dsdebug.errors import PreemptedAtStartup

    if _received is None or os.environ.get("DSDEBUG_LAUNCHER_PID"):  # our own child rank: rank 0 waits for it
        return
    world = detect()
    if world is None or world.world == 1:
        raise PreemptedAtStartup(received_name(), stage)


def is_recorder(handler: Any) -> bool:
    """``handler`` is ours: whoever installs handlers after us may treat it as the default."""
    return handler is _record


def take_over(original_handlers: dict[int, Any]) -> dict[int, Any]:
    """For code that installs its own handlers and restores the ones it found afterwards
    (Lightning's signal connector): restore the default action instead of the recorder."""
    return {s: (signal.SIG_DFL if is_recorder(h) else h) for s, h in original_handlers.items()}
