"""`DebugCallback`: what every debug check shares — reporting, the error policy, argument checks,
the every-N-steps cadence, and the running state a resume restores.

Rank rules (a collective on some ranks only is a hang):
- `report` is local: any rank may call it, for its own findings.
- `any_rank` is a collective: call it on every rank at the same point, to agree on a
  decision (e.g. "some rank saw a NaN") before acting on it.
- The error policy acts where the finding is reported, so a check whose errors can stop or
  skip must agree with `any_rank` first and then report on every rank (rank=None).

Error policy (``on_error``), for findings of severity ``error``:
- ``warn`` (default): report and carry on;
- ``skip``: ask the LightningModule to skip this optimizer step (``skip_optimizer_step``),
  for checks that run before the update;
- ``stop``: the run saves a checkpoint and stops, exiting non-zero (code 3).

Arguments: each check declares its rules on the class, ``arg_rules = {"key": rule}`` (the rules of
``config/args.py``), and ``__init__`` applies them with ``check_declared(key=value)``; a bad value is one
``ConfigError`` naming ``callbacks.<name>.<key>`` and what is valid. The declarations are data: the config
layer reads them, from ``config/check_args.json`` (``python -m dsdebug.callbacks.arg_table`` writes it),
to refuse a bad value before torch is imported. A rule that depends on another argument's value is
applied in ``__init__`` with ``check_args(key=(value, rule))``, when the check is built.

Cadence: ``due(step)`` is true every ``every_n_steps`` steps (0 or None: never).

Running state (EMAs, windows, baselines, counters) survives a resume: a check names the attributes
that hold it in ``state_attrs``; ``state_dict`` saves them in the checkpoint (plain containers and
tensors only, so ``torch.load(weights_only=True)`` reads them back) and ``load_state_dict`` puts
them back, in the container types the fresh check holds (a deque keeps its maxlen). Lightning saves
rank 0's state and hands it to every rank, so only state every rank holds alike belongs there
(values after an all-reduce, decisions taken on every rank): a rank's own memory baseline does not.

Pickling (``ddp_spawn`` sends the callbacks to its processes): ``runtime_attrs`` names the
process-bound attributes (threads, locks, log handlers, the Trainer) the copy leaves out (None);
``setup`` builds them again, ``restore_runtime`` re-creates what ``__init__`` had set up.

Fault isolation (``isolation.py``): every hook a check defines runs inside a guard; an exception
from the check's own code becomes one ``<check>/check_failed`` error finding and switches that check off
(on every rank, before its next collective), and the run goes on. ``debug.strict=true`` /
``DSDEBUG_STRICT=1`` re-raise instead. Collectives go through ``dsdebug.distributed.collectives`` (they
agree first); hooks a check puts on the user's model are wrapped with ``self.guarded(fn, where)``.
``isolated = False`` opts a class out (the doctor: it is the run).

Standalone (a plain ``L.Trainer``, no framework): every check's ``setup`` first calls
`attach_channel`, which points an unconfigured findings channel at
``<trainer.log_dir>/findings.jsonl`` (docs/standalone.md). Subclasses that define their own
``setup`` get this too (``__init_subclass__`` wraps it), so no check can forget it.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any, ClassVar

from lightning.pytorch import Callback, Trainer

from dsdebug.callbacks import isolation
from dsdebug.config.args import Rule, one_of
from dsdebug.distributed.collectives import any_rank
from dsdebug.errors import ConfigError
from dsdebug.findings import Finding, auto_configure, get_channel, needs_auto
from dsdebug.findings.sinks import attach_dashboards

__all__ = ["DebugCallback", "POLICIES", "any_rank"]

POLICIES = ("warn", "skip", "stop")


def attach_channel(trainer: Any) -> None:
    """Point the findings channel at this run when nobody configured it (a plain Lightning project).

    COLLECTIVE when it acts: ``trainer.log_dir`` broadcasts rank 0's logger version, so every rank
    calls this at the same point (each check's ``setup``, same callback order on every rank; the
    decision ``needs_auto`` is alike on every rank). Rank 0 also attaches the findings to the
    Trainer's TensorBoard/W&B loggers (once per channel, under the framework too) and, in a plain
    project, records how the run ends and its scalars for the report (``report/run_record.py``)."""
    if not isinstance(trainer, Trainer):
        return  # not a real Trainer (a unit test's stand-in): the channel stays as it is
    if needs_auto(trainer):
        channel = auto_configure(trainer.log_dir or trainer.default_root_dir, trainer)
        if trainer.global_rank == 0:  # the findings on the user's dashboards; metrics.json + history.jsonl
            from dsdebug.report.run_record import record_run

            record_run(trainer, channel.path.parent, attach_dashboards(channel, trainer.loggers))
    if trainer.global_rank == 0:  # under dsdebug-train too; idempotent (one sink per channel)
        attach_dashboards(get_channel(), trainer.loggers)


def _plain(value: Any) -> Any:
    """``value`` in containers ``torch.load(weights_only=True)`` accepts (deque/set -> list, numpy -> Python)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, deque, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [_plain(v) for v in items]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a tensor
        return value.detach().cpu().clone()
    if hasattr(value, "item") and hasattr(value, "dtype"):  # a numpy scalar
        return value.item()
    return value


def _like(current: Any, saved: Any) -> Any:
    """``saved`` in the container type the fresh check holds (a deque keeps its maxlen)."""
    if isinstance(current, deque):
        return deque(saved, maxlen=current.maxlen)
    if isinstance(current, (set, frozenset)):
        return type(current)(saved)
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


class DebugCallback(Callback):
    #: the callback's config name (``callbacks.<name>``), also the ``check`` of its findings
    name: str = "debug"
    #: attributes holding the running state a resume restores (see the module docstring)
    state_attrs: ClassVar[tuple[str, ...]] = ()
    #: the error policies this check takes (``skip`` needs a check that judges before the update) ...
    policies: ClassVar[tuple[str, ...]] = POLICIES
    #: ... and why one is missing (shown in the error)
    policy_note: ClassVar[str] = ""
    #: process-bound objects (threads, locks, handlers, the Trainer) left out when the check is pickled
    #: (``ddp_spawn`` sends callbacks to its processes); the copy holds None and re-creates them in setup
    runtime_attrs: ClassVar[tuple[str, ...]] = ()
    #: hooks run inside the fault-isolation guard (isolation.py); False only for what must fail the run
    isolated: ClassVar[bool] = True
    #: the rules of this check's arguments (see the module docstring); ``on_error``'s follows ``policies``
    arg_rules: ClassVar[dict[str, Rule]] = {}

    def __init__(self, on_error: str = "warn") -> None:
        self.check_declared(on_error=on_error)
        self.on_error = on_error

    @classmethod
    def declared_rules(cls) -> dict[str, Rule]:
        """Every declared argument rule of this check: ``on_error`` (from ``policies``), then ``arg_rules``."""
        return {"on_error": one_of(*cls.policies, note=cls.policy_note), **cls.arg_rules}

    def check_declared(self, **values: Any) -> None:
        """``key=value`` for each declared argument: the first value its rule refuses is a ConfigError."""
        rules = self.declared_rules()
        self.check_args(**{key: (value, rules[key]) for key, value in values.items()})

    def check_args(self, **checks: tuple[Any, Rule]) -> None:
        """``key=(value, rule)`` for each argument: the first value its rule refuses is a ConfigError
        ``callbacks.<name>.<key>=<value> is invalid; valid: <what the rule takes>``."""
        for key, (value, (test, valid)) in checks.items():
            if not test(value):
                raise ConfigError(f"callbacks.{self.name}.{key}={value!r} is invalid; valid: {valid}")

    def due(self, step: int, every: int | None = None) -> bool:
        """Whether ``step`` falls on the cadence ``every`` (default: ``self.every_n_steps``); 0/None: never."""
        every = getattr(self, "every_n_steps", None) if every is None else every
        return bool(every) and step % every == 0

    def read_queued(self, trainer: Any) -> None:
        """Judge now the per-step values this check keeps on the device between its batched host reads
        (``read_every_n_steps``). Called by ``state_dict`` before the state is taken, so a checkpoint holds every
        step it covers judged: a resumed run ends with the state of an uninterrupted one. COLLECTIVE where the
        check's reads are: Lightning's ``dump_checkpoint`` takes every callback's state on every rank, at the same
        step. Default: nothing queued."""

    def state_dict(self) -> dict[str, Any]:
        """The running state of ``state_attrs``, saved in every checkpoint Lightning writes (the steps queued
        for a batched read judged first: ``read_queued``)."""
        ref = self.__dict__.get("_isolation_trainer")  # set in setup (isolation.py); None outside a fit
        trainer = ref() if ref is not None else None
        if trainer is not None:
            self.read_queued(trainer)
        return {attr: _plain(getattr(self, attr)) for attr in self.state_attrs if hasattr(self, attr)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved (resume); keys this version does not keep are ignored."""
        for attr, value in state_dict.items():
            if attr in self.state_attrs:
                setattr(self, attr, _like(getattr(self, attr, None), value))

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned process gets (``ddp_spawn``): everything but ``runtime_attrs`` (None there)."""
        state = self.__dict__.copy()
        state.pop("_isolation_trainer", None)  # a weak reference to the Trainer (isolation.py)
        for attr in self.runtime_attrs:
            if attr in state:
                state[attr] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.restore_runtime()

    def restore_runtime(self) -> None:
        """After unpickling, in the new process: re-create what construction set up (default: nothing;
        what ``setup`` builds is built there again)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._attach_in_setup()
        isolation.isolate(cls)  # every hook it defines, inside the guard (outermost: around attach_channel)

    @classmethod
    def _attach_in_setup(cls) -> None:
        own = cls.__dict__.get("setup")
        if own is None or getattr(own, "_attaches_channel", False):
            return

        @functools.wraps(own)
        def setup(self: Any, trainer: Any, pl_module: Any, stage: str) -> None:
            attach_channel(trainer)  # COLLECTIVE when it acts (see attach_channel)
            return own(self, trainer, pl_module, stage)

        setup._attaches_channel = True  # type: ignore[attr-defined]
        cls.setup = setup  # type: ignore[method-assign]

    def guarded(self, fn: Any, where: str) -> Any:
        """``fn`` (a hook this check puts on the user's model or tensors) inside this check's fault
        isolation: an exception is this check's ``check_failed``, and nothing runs once it is off."""
        return isolation.guarded(self, fn, where)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Nothing of its own; the guard closes the checks' side channel after the last check's teardown."""

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """The run ends with an exception: the steps still queued for a batched read judged first
        (``read_queued``), on one process only -- with several, the reads are collectives and the other ranks
        may be anywhere (or dead)."""
        if getattr(trainer, "world_size", 1) == 1:
            self.read_queued(trainer)

    def release(self, trainer: Any) -> None:
        """Undo what this check put on the process and the user's model (threads, watchdogs, module and
        autograd hooks, logging handlers, torch flags, environment variables), as its end-of-run hooks do.
        Idempotent, local (no collective). The guard calls it when the check is switched off (a failure:
        isolation.py) and again at ``teardown``/``on_exception`` of a check that is off, whose own hooks no
        longer run: a switched-off check must leave nothing running (a hang watchdog that ends a healthy run
        when its heartbeats stop). Default: nothing to undo."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        attach_channel(trainer)  # COLLECTIVE when it acts (see attach_channel)

    def report(self, trainer: Any, severity: str, code: str, message: str, advice: str = "",
               details: dict | None = None, rank: int | None | str = "self", step: int | None | str = "self") -> Finding:
        finding = Finding(
            check=self.name, severity=severity, code=code, message=message, advice=advice,
            step=trainer.global_step if step == "self" and trainer is not None else (None if step == "self" else step),
            rank=trainer.global_rank if rank == "self" and trainer is not None else (None if rank == "self" else rank),
            details=details or {},
        )
        get_channel().report(finding)
        if severity == "error":
            self._apply_policy(trainer, finding)
        return finding

    def report_capped(self, trainer: Any, severity: str, code: str, message: str, advice: str = "",
                      details: dict | None = None, rank: int | None = None, step: int | None | str = "self",
                      limit: int = 5) -> None:
        """Report a decision EVERY rank took alike: rank 0 writes; the ``limit``-th finding of a code says
        that later ones are only counted (in ``self._counts``); an error still applies the policy on
        every rank. Local: no collective."""
        counts = self.__dict__.setdefault("_counts", {})
        n = counts[code] = counts.get(code, 0) + 1
        if n == limit:
            message += f" (further {code} findings are only counted)"
        if n <= limit and (trainer is None or trainer.global_rank == 0):
            self.report(trainer, severity, code, message, advice, details, rank=rank, step=step)
        elif severity == "error":
            if step == "self":
                step = trainer.global_step if trainer is not None else None
            self._apply_policy(trainer, Finding(self.name, severity, code, message, advice, step=step, rank=rank))

    def _apply_policy(self, trainer: Any, finding: Finding) -> None:
        if trainer is None or self.on_error == "warn":
            return
        if self.on_error == "skip":
            setattr(trainer.lightning_module, "skip_optimizer_step", True)
        elif self.on_error == "stop":
            channel = get_channel()
            if channel.stop_request is None:
                channel.stop_request = finding
            trainer.should_stop = True

    any_rank = staticmethod(any_rank)  # dsdebug.distributed.collectives.any_rank: COLLECTIVE


isolation.isolate(DebugCallback)  # the base's own hooks (setup, teardown, state_dict, load_state_dict)
