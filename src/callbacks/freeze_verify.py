"""`FreezeVerify`: freeze parameters by name, then prove what learns and what doesn't.

The config example and the table of metrics and findings: the class docstring (`FreezeVerify`).
"""

from __future__ import annotations

import fnmatch
import re
from functools import partial
from typing import Any, Callable, ClassVar

import torch

from dsdebug.config.args import Rule, integer
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import display_name, grad_source, optimizer_param_lrs
from dsdebug.errors import ConfigError
from dsdebug.findings import Finding
from dsdebug.distributed import collectives

__all__ = ["FreezeVerify"]

_REASONS = {  # code -> (message stem, advice), checked in this order
    "frozen_outside_config": ("requires_grad=False was set outside freeze_verify (model code?) although the "
                              "config trains them",
                              "find where the model freezes it, or list it in callbacks.freeze_verify.freeze"),
    "not_in_optimizer": ("trainable but in no optimizer param group", "build the optimizer after freezing, from "
                         "requires_grad parameters (configure_optimizers)"),
    "lr_zero_param": ("lr=0 in its optimizer param group", "check the param groups / scheduler for that group"),
    "unused_param": ("no gradient ever, and its module never ran in forward", "the forward pass never uses it: "
                     "delete it, or wire it in (DDP needs find_unused_parameters otherwise)"),
    "detached_param": ("no gradient ever although its module ran in forward", "its output is cut from the loss "
                       "(.detach(), torch.no_grad(), .data, a non-differentiable op)"),
    "zero_grad_param": ("every gradient exactly zero", "its output is multiplied by 0 / masked out / a dead "
                        "activation; check the path from it to the loss"),
    "not_updated": ("non-zero gradients and lr > 0, but unchanged", "steps skipped (grad_monitor on_error=skip?) "
                    "or updates below the weights' precision (raise the LR or use fp32 master weights)"),
    "frozen_param_changed": ("frozen by the config, yet their values changed", "tied to a trainable parameter, or "
                             "an optimizer built before freezing, or an in-place update in forward"),
    # the base an adapter (model.adapter, LoRA) froze on purpose: pl_module.intended_frozen
    "base_param_changed": ("frozen base of model.adapter, yet their values changed", "a base weight left "
                           "requires_grad=True, an optimizer group holding the base, or weight decay a custom "
                           "optimizer applies to frozen parameters: build the optimizer from the adapter's "
                           "parameters only"),
    "base_trainable": ("frozen base of model.adapter, yet requires_grad=True", "something unfroze it after the "
                       "adapter froze the base (model code, a callback): freeze it again or leave it out of the base"),
    "base_in_optimizer": ("frozen base of model.adapter, yet in an optimizer param group", "build the optimizer "
                          "from requires_grad parameters only (a custom configure_optimizers?): an optimizer "
                          "that decays every parameter of its groups moves the base"),
    "base_changed_on_resume": ("frozen base of model.adapter, yet different after the resume from what the first "
                               "fit started with", "the checkpoint lacks the base (saved without frozen "
                               "parameters?) or the base was rebuilt differently (another seed, another "
                               "model.net.name_or_path): resume from a full checkpoint"),
}


class FreezeVerify(DebugCallback):
    """`FreezeVerify`: freeze parameters by name, then prove what learns and what doesn't.

    Catches (the "freeze all but one layer and check it trains" experiment): parameters that
    should learn but don't, and says why -- frozen in the model code (``requires_grad=False``
    although the config trains them), never called in forward, called but detached (no
    gradient reaches them), gradient always exactly zero, lr=0 in their param group, not in the
    optimizer, or unchanged for another reason -- and frozen parameters that change anyway.

    Freezing happens in ``setup`` (stage fit), which Lightning runs before the strategy builds
    the optimizer / DeepSpeed engine, so frozen parameters are never handed to the optimizer.
    Evidence is collected for ``check_after_steps`` steps, then every hook is removed: gradient
    hooks on trainable parameters (they fire on each rank's local gradient, before any
    reduction, under DDP and every ZeRO stage), forward hooks on the modules owning them, and an
    exact fingerprint of each parameter's local data at the start and at the check (ZeRO-3:
    this rank's partition and its fp32 master copy; ZeRO-1/2: the parameter and this rank's fp32
    master fragment). One all-reduce (max) combines the ranks -- no parameter is gathered.

    Example::

        python train.py +callbacks=freeze_verify 'callbacks.freeze_verify.train_only=[model.layers.0.*]' \\
            strategy=zero3 trainer=ddp_sim

    Patterns match the net's parameter names (``model.layers.0.mlp.gate_proj.weight``; the
    LightningModule's ``net.`` prefix is optional): fnmatch on the whole name, or
    ``re:<regex>`` searched in it. It logs no metrics.

    | finding code | severity | meaning |
    |---|---|---|
    | ``freeze_applied`` | info | what the patterns froze (counts, elements) |
    | ``frozen_outside_config`` | error | should train, but ``requires_grad=False`` was set elsewhere (model code) |
    | ``not_in_optimizer`` | error | trainable, but no param group of the optimizer holds it |
    | ``lr_zero_param`` | error | its param group's learning rate is 0 |
    | ``unused_param`` | error | no gradient ever; its module never ran in forward |
    | ``detached_param`` | error | no gradient ever, although its module ran (detach / no_grad / .data) |
    | ``zero_grad_param`` | error | gradients arrived but were exactly zero |
    | ``not_updated`` | error | non-zero gradients, lr > 0, yet unchanged (skipped steps, update below precision) |
    | ``frozen_param_changed`` | error | frozen by the config, yet changed (tied weights, optimizer built before freezing) |
    | ``freeze_verified`` | info | all trainable parameters changed and all frozen ones did not |

    Adapters (``+model/adapter=lora``, which adds this check): the module's ``intended_frozen`` names
    the base the adapter froze on purpose; those parameters are held to not moving (never re-frozen
    here: a base left trainable is reported, not silently fixed), checked again at the end of fit
    (per-parameter sums, one all-reduce under ZeRO-3), and against the sums the first fit started
    with after a resume:

    | finding code | severity | meaning |
    |---|---|---|
    | ``base_param_changed`` | error | a frozen base parameter moved (named) |
    | ``base_trainable`` | error | a base parameter has requires_grad=True |
    | ``base_in_optimizer`` | error | a base parameter sits in an optimizer param group |
    | ``base_changed_on_resume`` | error | after a resume the base differs from the one the first fit started from |

    Resume: the evidence comes from this fit's hooks and fingerprints, so a resumed fit verifies its
    own first ``check_after_steps`` steps; ``_base_sums`` (an adapter's frozen base, per parameter)
    is carried over.
    """
    name = "freeze_verify"
    policies = ("warn", "stop")
    policy_note = "skip: the check runs after the updates"
    state_attrs = ("_base_sums",)  # the adapter base's sums at the first fit's start (all ranks alike)

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "check_after_steps": integer(1),
        "max_names": integer(1),
    }

    def __init__(self, train_only: Any = (), freeze: Any = (), check_after_steps: int = 3, max_names: int = 10,
                 on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(check_after_steps=check_after_steps, max_names=max_names)
        self.train_only, self.freeze = self._patterns("train_only", train_only), self._patterns("freeze", freeze)
        self.check_after_steps, self.max_names = check_after_steps, max_names
        self._handles: list[Any] = []
        self._pending = False
        self._base_sums: list[list[float]] = []

    def _patterns(self, key: str, value: Any) -> list[tuple[str, Callable[[str], bool]]]:
        items = [value] if isinstance(value, str) else list(value or ())
        out = []
        for raw in map(str, items):
            if raw.startswith("re:"):
                try:
                    rx = re.compile(raw[3:])
                except re.error as e:
                    raise ConfigError(f"callbacks.{self.name}.{key}: bad regex {raw!r} ({e}); valid: "
                                      "fnmatch patterns or re:<python regex>") from None
                out.append((raw, lambda n, rx=rx: rx.search(n) is not None))
            else:
                out.append((raw, lambda n, raw=raw: fnmatch.fnmatchcase(n, raw)))
        return out

    # ---- setup: every rank, before the optimizer exists ------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        named = list(pl_module.named_parameters())
        self._names = [display_name(n) for n, _ in named]
        self._params = [p for _, p in named]
        aliases: dict[int, list[str]] = {}  # tied weights have several names: match them all
        for n, p in pl_module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(n)
        for key, patterns in (("train_only", self.train_only), ("freeze", self.freeze)):
            for raw, match in patterns:
                if not any(match(n) or match(display_name(n)) for names in aliases.values() for n in names):
                    raise ConfigError(f"callbacks.{self.name}.{key}: pattern {raw!r} matches no parameter; names "
                                      f"look like {', '.join(self._names[:3])}")

        def trains(n: str) -> bool:
            def hits(patterns: list) -> bool:
                return any(m(n) or m(display_name(n)) for _, m in patterns)
            return (not self.train_only or hits(self.train_only)) and not hits(self.freeze)

        intended = frozenset(getattr(pl_module, "intended_frozen", None) or ())
        if intended and self.check_after_steps < 2:
            raise ConfigError(f"callbacks.{self.name}.check_after_steps={self.check_after_steps} with model.adapter: "
                              "LoRA's A matrices get no gradient on the first step (B starts at zero); valid: >= 2")
        self._by_design = [any(n in intended for n in aliases[id(p)]) for p in self._params]
        self._expected = []
        for by_design, p in zip(self._by_design, self._params):
            if by_design:  # the adapter's base: never trains, whatever the patterns say
                self._expected.append(False)
                continue
            verdicts = {n: trains(n) for n in aliases[id(p)]}
            if len(set(verdicts.values())) > 1:
                raise ConfigError(f"callbacks.{self.name}: {' and '.join(verdicts)} are one tied tensor, but the "
                                  "patterns train one name and freeze the other; valid: patterns that agree on both")
            self._expected.append(next(iter(verdicts.values())))
        if not any(self._expected):
            raise ConfigError(f"callbacks.{self.name}: train_only/freeze leave no parameter to train")
        self._frozen_before = [e and not p.requires_grad for e, p in zip(self._expected, self._params)]
        froze = 0
        for expected, by_design, p in zip(self._expected, self._by_design, self._params):
            if not expected and not by_design and p.requires_grad:
                p.requires_grad_(False)
                froze += 1
        if (self.train_only or self.freeze) and trainer.global_rank == 0:
            numel = [getattr(p, "ds_numel", p.numel()) for p in self._params]
            train = sum(n for n, e in zip(numel, self._expected) if e)
            self.report(trainer, "info", "freeze_applied",
                        f"training {sum(self._expected)}/{len(numel)} parameters ({train / 1e6:.3g}M of "
                        f"{sum(numel) / 1e6:.3g}M elements); froze {froze} (train_only="
                        f"{[r for r, _ in self.train_only]}, freeze={[r for r, _ in self.freeze]})",
                        details={"trainable": [d for d, e in zip(self._names, self._expected) if e]}, rank=None)

    # ---- evidence: every rank, local only --------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._source = grad_source(trainer.strategy)
        self._target = trainer.global_step + self.check_after_steps
        if any(self._by_design):  # COLLECTIVE under ZeRO-3 (every rank): the base's sums
            self._base_start = self._sums(trainer)
            if self._base_sums:  # a resume: against what the first fit started from
                self._report_moved(trainer, self._base_sums, self._base_start, "base_changed_on_resume")
            else:
                self._base_sums = self._base_start
        self._fp0 = [self._fingerprint(p) for p in self._params]
        n = len(self._params)
        self._got, self._called = [False] * n, [False] * n
        self._nonzero: list[torch.Tensor | None] = [None] * n
        owners: dict[int, list[int]] = {}
        index = {id(p): i for i, p in enumerate(self._params)}
        for module in pl_module.modules():
            owned = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if owned:
                owners[id(module)] = owned
                self._handles.append(module.register_forward_hook(self.guarded(partial(self._on_forward, owned),
                                                                               "a module forward hook")))
        for i, p in enumerate(self._params):
            if p.requires_grad:
                self._handles.append(p.register_hook(self.guarded(partial(self._on_grad, i), "a gradient hook")))
        self._pending = True

    def _on_forward(self, owned: list[int], *_: Any) -> None:
        for i in owned:
            self._called[i] = True

    def _on_grad(self, i: int, grad: torch.Tensor) -> None:
        self._got[i] = True
        nz = (grad != 0).any()  # a tensor: no device sync here
        self._nonzero[i] = nz if self._nonzero[i] is None else (self._nonzero[i] | nz)

    def _fingerprint(self, p: torch.Tensor) -> tuple[int, int]:
        """Exact change detector of this rank's data of p (+ its fp32 master part), no copy kept."""
        lp = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        hp = None
        if self._source == "zero3" and p.requires_grad and getattr(p, "_z3_optimizer", None) is not None:
            from deepspeed.utils import safe_get_local_fp32_param

            hp = safe_get_local_fp32_param(p)
        elif self._source == "zero12" and getattr(p, "_hp_mapping", None) is not None:
            hp = p._hp_mapping.get_hp_fragment()
        return _hash(lp), _hash(hp) if hp is not None else 0

    # ---- the check: EVERY rank at the same step (one all-reduce) -----------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._pending and trainer.global_step >= self._target:
            self._finish(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # fewer steps than check_after_steps (short run, early stop): verify what there is
        if self._pending and trainer.global_step > self._target - self.check_after_steps:
            self._finish(trainer)
        if any(self._by_design) and getattr(self, "_base_start", None) is not None:
            # after the window: the base must still be what this fit started with (COLLECTIVE under ZeRO-3)
            self._report_moved(trainer, self._base_start, self._sums(trainer), "base_param_changed")

    # ---- the adapter's frozen base: sums of each parameter, partitions added up ----------
    def _sums(self, trainer: Any) -> list[list[float]]:
        rows = []
        for by_design, p in zip(self._by_design, self._params):
            if by_design:  # in float64 chunks: bounded memory on a 7B model's embedding
                flat = (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).detach().reshape(-1)
                total = squares = 0.0
                for start in range(0, flat.numel(), 1 << 24):
                    part = flat[start:start + (1 << 24)].double()
                    total, squares = total + float(part.sum()), squares + float(part.pow(2).sum())
                rows.append([total, squares])
        sums = torch.tensor(rows, dtype=torch.float64)
        if trainer.world_size > 1 and self._source == "zero3":  # partitions: add the ranks' parts
            sums = collectives.reduce(trainer, sums, "sum").cpu()
        return sums.tolist()

    def _report_moved(self, trainer: Any, before: list[list[float]], after: list[list[float]], code: str) -> None:
        names = [n for n, d in zip(self._names, self._by_design) if d]
        if len(before) != len(names):
            moved = names  # another net: every base parameter is suspect
        else:
            moved = [n for n, a, b in zip(names, before, after)
                     if any(abs(x - y) > 1e-6 * max(1.0, abs(x)) for x, y in zip(a, b))]
        if not moved:
            return
        stem, advice = _REASONS[code]
        listed = ", ".join(moved[: self.max_names]) + (f" (+{len(moved) - self.max_names} more)"
                                                      if len(moved) > self.max_names else "")
        message = f"{len(moved)} adapter base parameter(s) -- {stem}: {listed}"
        if trainer.global_rank == 0:  # the sums agree on every rank; rank 0 writes it
            self.report(trainer, "error", code, message, advice, {"params": moved, "reason": stem}, rank=None)
        else:
            self._apply_policy(trainer, Finding(self.name, "error", code, message, advice,
                                                step=trainer.global_step, rank=None))

    def release(self, trainer: Any) -> None:
        """The forward and gradient hooks off the user's model (base.py)."""
        self._pending = False
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _finish(self, trainer: Any) -> None:
        self.release(trainer)
        self._verify(trainer)

    def _verify(self, trainer: Any) -> None:
        changed = [a != self._fingerprint(p) for a, p in zip(self._fp0, self._params)]
        nonzero = [bool(t) if t is not None else False for t in self._nonzero]
        evidence = torch.tensor([changed, self._got, nonzero, self._called], dtype=torch.float32)
        if trainer.world_size > 1:  # COLLECTIVE: every rank reaches this at the same global_step
            evidence = collectives.reduce(trainer, evidence, "max").cpu()
        changed, got, nonzero, called = (row.bool().tolist() for row in evidence)
        lrs = optimizer_param_lrs(trainer)
        by_code: dict[str, list[int]] = {}
        for i, p in enumerate(self._params):
            code = self._diagnose(i, p, changed[i], got[i], nonzero[i], called[i], lrs)
            if code:
                by_code.setdefault(code, []).append(i)
        steps = trainer.global_step - (self._target - self.check_after_steps)
        for code, idx in by_code.items():
            stem, advice = _REASONS[code]
            names = [self._names[i] for i in idx]
            listed = ", ".join(names[: self.max_names]) + (f" (+{len(names) - self.max_names} more)"
                                                          if len(names) > self.max_names else "")
            what = ("frozen parameter(s) changed" if code == "frozen_param_changed" else "adapter base parameter(s)"
                    if code.startswith("base_") else "parameter(s) did not learn")
            message = f"{len(names)} {what} in {steps} steps -- {stem}: {listed}"
            details = {"params": names, "reason": stem, "steps": steps}
            if trainer.global_rank == 0:  # same verdict on every rank; rank 0 writes it
                self.report(trainer, "error", code, message, advice, details, rank=None)
            else:
                self._apply_policy(trainer, Finding(self.name, "error", code, message, advice,
                                                    step=trainer.global_step, rank=None))
        if not by_code and trainer.global_rank == 0:
            trained = sum(self._expected)
            self.report(trainer, "info", "freeze_verified",
                        f"after {steps} steps all {trained} trainable parameters changed (with non-zero gradients) "
                        f"and all {len(self._params) - trained} frozen ones did not", rank=None)

    def _diagnose(self, i: int, p: torch.Tensor, changed: bool, got: bool, nonzero: bool, called: bool,
                  lrs: dict[int, float] | None) -> str | None:
        if self._by_design[i]:
            if changed:
                return "base_param_changed"
            if p.requires_grad:
                return "base_trainable"
            return "base_in_optimizer" if lrs is not None and id(p) in lrs else None
        if not self._expected[i]:
            return "frozen_param_changed" if changed else None
        if not p.requires_grad:
            return "frozen_outside_config"
        if lrs is not None and id(p) not in lrs:
            return "not_in_optimizer"
        if lrs is not None and lrs[id(p)] == 0:
            return "lr_zero_param"
        if not got:  # may still have "changed" through weight decay on zero-filled ZeRO gradients
            return "detached_param" if called else "unused_param"
        if not nonzero:
            return "zero_grad_param"
        return None if changed else "not_updated"


def _hash(t: torch.Tensor) -> int:
    """Position-weighted integer sum of the raw bits (wraps in int64): any element change shows."""
    flat = t.detach().reshape(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    total, chunk = 0, 1 << 24  # chunks bound the temporary memory on huge parameters
    for start in range(0, flat.numel(), chunk):
        bits = flat[start:start + chunk].contiguous().view(ints).long()
        weights = torch.arange(start, start + bits.numel(), device=bits.device) % 65521 + 1
        total += int((bits * weights).sum())
    return total
