"""`NaNTriage`: when a step goes non-finite, re-run it once from the same state: transient or reproducible?

The config example and the table of metrics and findings: the class docstring (`NaNTriage`).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, ClassVar

import torch

from dsdebug.config.args import Rule, boolean, integer
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import _at_accumulation_boundary, display_name, grad_source, local_grad
from dsdebug.callbacks.loss_scale import OverflowJudge, read_scaler
from dsdebug.findings import Finding
from dsdebug.distributed import collectives

__all__ = ["NaNTriage"]

log = logging.getLogger(__name__)


def _rng_state() -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _finite(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return not out.is_floating_point() or bool(torch.isfinite(out).all())
    if isinstance(out, (tuple, list)):
        return all(_finite(o) for o in out)
    if hasattr(out, "values") and callable(out.values):  # dicts, HF ModelOutput
        return all(_finite(o) for o in out.values())
    return True


class NaNTriage(DebugCallback):
    """`NaNTriage`: when a step goes non-finite, re-run it once from the same state: transient or reproducible?

    Megatron-LM's rerun idea: a NaN that does not come back when the same step is computed again from
    the same weights, batch and RNG state is not a function of data and model -- suspect the hardware
    (silent data corruption), a race or a non-deterministic kernel; one that comes back is the data or
    the model, and the rerun names the first module whose output went non-finite.

    How (every rank, every optimizer step, before the update):
    - ``on_train_batch_start`` keeps a reference to the batch and the RNG states (CPU, CUDA): cheap.
    - ``on_before_backward`` notes whether this rank's loss is non-finite (a tensor, no sync).
    - ``on_before_optimizer_step`` (at the accumulation boundary) checks this rank's gradients in one
      fused pass (``check_grads``; under ZeRO its local partition, as grad_monitor reads it) and fuses
      the per-rank loss flags and the gradient flag into ONE all-reduce of ``world_size + 1`` numbers.
    - On a non-finite step, with ``rerun: true`` and fewer than ``max_reruns`` reruns so far, EVERY rank
      reruns together (the decision comes from the all-reduced flags; ZeRO-3's forward gathers
      parameters, a collective): RNG restored to the batch start, forward through the LightningModule's
      loss with forward hooks that record the first module whose output is non-finite, and -- when the
      loss was finite but the gradients were not -- ``torch.autograd.grad`` w.r.t. the parameters, which
      leaves ``.grad`` and DeepSpeed's buffers alone (not under ZeRO-3: its backward hooks would
      reduce-scatter; there the rerun is forward only and a gradient-only NaN stays unlabelled). A second
      all-reduce (only on this rare step) combines the ranks' verdicts. The RNG state is put back after.
      The weights have not been updated yet, so the rerun sees exactly the step's state.
    - Rank 0 writes the finding; every rank applies ``on_error`` (warn | skip: drop this update | stop).

    fp16 under a dynamic loss scaler (``dsdebug.callbacks.loss_scale``): a step whose loss is finite but whose
    gradients overflowed is the scaler's job (it skips that update and lowers the scale): not rerun, not a
    finding, counted in the summary -- through the scaler's initial search for a scale and up to 3 overflows
    in a row after it. The reruns go to non-finite losses and to the overflows the scaler does not absorb
    (the 4th in a row, or one at the scale's floor); their backward rerun differentiates the loss times the
    step's loss scale, so an overflow meets the same fp16 range it met in the step (an unscaled rerun never
    overflows and would read as transient). The gradient check sums in fp32 (an fp16 norm of finite
    loss-scaled gradients overflows past 65504).

    Off unless added (``+callbacks=nan_triage``); with ``rerun: false`` it only reports ``nan_step``.

    Example::

        python train.py +callbacks=nan_triage callbacks.nan_triage.on_error=skip strategy=zero3 trainer=ddp_sim

    | finding code | severity | when |
    |---|---|---|
    | ``nan_transient`` | error | a non-finite step whose rerun was finite on every rank (label ``transient``) |
    | ``nan_reproducible`` | error | non-finite again on rerun (label ``reproducible``); names rank, batch, first module |
    | ``nan_step`` | error | a non-finite step not rerun (``rerun: false``, ``max_reruns`` used up, or ZeRO-3 gradient-only) |
    | ``nan_summary`` | info | at the end: non-finite steps and their labels, fp16 overflows the loss scaler absorbed |

    None of these for an fp16 overflow the dynamic loss scaler absorbs (see above).

    It logs no metrics. Resume (``state_attrs``, decided from all-reduced flags, alike on every rank):
    the reruns done (``max_reruns`` counts over the whole run) and the labels of the non-finite steps.
    """
    name = "nan_triage"
    state_attrs = ("reruns", "labels")

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "rerun": boolean(),
        "max_reruns": integer(1),
        "check_grads": boolean(),
        "max_findings": integer(1),
    }

    def __init__(self, rerun: bool = True, max_reruns: int = 3, check_grads: bool = True,
                 max_findings: int = 5, on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(rerun=rerun, max_reruns=max_reruns, check_grads=check_grads, max_findings=max_findings)
        self.rerun, self.max_reruns, self.check_grads = rerun, max_reruns, check_grads
        self.max_findings = max_findings
        self.reruns = 0
        self.labels: dict[int, str] = {}  # step -> transient | reproducible | not_rerun
        self._loss_bad: torch.Tensor | None = None
        self._batch: Any = None
        self._batch_idx: int | None = None
        self._rng: tuple | None = None
        self._params: list[torch.Tensor] = []
        self._scaler = None
        self._overflow = OverflowJudge(None)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        self._source = grad_source(trainer.strategy)
        self._modules = [(display_name(n), m) for n, m in pl_module.named_modules() if n]
        self._scaler = read_scaler(trainer)  # fp16: which non-finite gradients the loss scaler absorbs
        self._overflow = OverflowJudge(self._scaler, resumed=trainer.global_step > 0)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx
        if self.rerun and self.reruns < self.max_reruns:
            self._batch, self._rng = batch, _rng_state()  # a reference and ~5 KB: cheap

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else (self._loss_bad | bad)

    # ---- the check: EVERY rank, same branches ----------------------------------------------
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not _at_accumulation_boundary(trainer):
            return
        world, rank = trainer.world_size, trainer.global_rank
        vec = torch.zeros(world + 1, dtype=torch.float64)
        vec[rank] = float(self._loss_bad) if self._loss_bad is not None else 0.0
        self._loss_bad = None
        if self.check_grads:
            grads = [g for g in (local_grad(p, self._source) for p in self._params) if g is not None and g.numel()]
            if grads:  # one fused pass; a NaN/Inf anywhere makes its norm non-finite (fp32: an fp16 norm of
                # finite loss-scaled gradients overflows past 65504)
                norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
                vec[world] = float(not torch.isfinite(torch.stack(norms)).all())
        if world > 1:  # COLLECTIVE, every rank, every step: one all-reduce of world+1 numbers
            vec = collectives.reduce(trainer, vec, "sum").cpu()
        loss_ranks = [r for r, v in enumerate(vec[:world].tolist()) if v > 0]
        grad_bad = bool(vec[world] > 0)
        verdict = self._overflow.judge(not loss_ranks, not grad_bad)  # same flags, same verdict on every rank
        if verdict != "not_absorbed":
            return  # finite, or an fp16 overflow the loss scaler skips and lowers the scale for (counted)
        step, batch_idx = trainer.global_step, self._batch_idx
        what = (f"non-finite loss on rank(s) {loss_ranks}" if loss_ranks else
                "finite loss on every rank but non-finite gradients"
                + (f" ({self._overflow.why})" if self._overflow.why else ""))
        where = f"step {step}, batch {batch_idx}"
        if not self.rerun or self.reruns >= self.max_reruns or self._batch is None:
            why = "rerun: false" if not self.rerun else f"max_reruns={self.max_reruns} used up"
            return self._finish(trainer, pl_module, step, "not_rerun", "nan_step",
                                f"{what} at {where}; not rerun ({why})",
                                "grad_monitor names the parameters; on_error=skip drops such steps",
                                {"loss_ranks": loss_ranks, "grad_nonfinite": grad_bad, "batch_idx": batch_idx},
                                loss_ranks)
        backward = not loss_ranks  # the loss was fine: the NaN arose in backward, rerun it too
        if backward and self._source == "zero3":
            return self._finish(trainer, pl_module, step, "not_rerun", "nan_step",
                                f"{what} at {where}; not rerun (ZeRO-3: a backward rerun would go through "
                                f"DeepSpeed's reduce-scatter hooks)", "grad_monitor names the parameters",
                                {"loss_ranks": loss_ranks, "grad_nonfinite": grad_bad, "batch_idx": batch_idx},
                                loss_ranks)
        self.reruns += 1
        scale = self._scaler.backward_scale() if backward and self._scaler is not None else 1.0
        bad_ranks, module_of = self._rerun(trainer, pl_module, backward, scale)
        details = {"loss_ranks": loss_ranks, "grad_nonfinite": grad_bad, "batch_idx": batch_idx,
                   "rerun": "forward+backward" if backward else "forward", "rerun_nonfinite_ranks": bad_ranks,
                   "rerun_index": self.reruns}
        if self._scaler is not None and backward:
            details["rerun_loss_scale"] = float(scale)  # a host read on a rerun step only
        if not bad_ranks:
            details["label"] = "transient"
            return self._finish(
                trainer, pl_module, step, "transient", "nan_transient",
                f"{what} at {where}; TRANSIENT: the rerun from the same weights, batch and RNG state was finite "
                f"on every rank, so it is not a function of data and model",
                "suspect the hardware (silent data corruption), a race or a non-deterministic kernel: rerun the "
                "step on another GPU/node (Megatron's rerun), check ECC/Xid logs, drain the node if it repeats; "
                "on_error=skip drops this update", details, loss_ranks)
        # the origin: the rank whose rerun met a non-finite output first in forward order (all ranks
        # ran the same modules), else the first rank; its module, else the loss (forward) or backward
        culprit = min(bad_ranks, key=lambda r: (module_of[r][1] if r in module_of else float("inf"), r))
        module, index = module_of.get(culprit, (None, None))
        arose_in = module or ("backward" if backward else "loss")
        details.update(label="reproducible", module=module, forward_index=index, arose_in=arose_in, rank=culprit)
        where_mod = (f"first non-finite module output: {module} (rank {culprit})" if module else
                     "every module output finite: it arose in backward" if backward else
                     "every module output finite: it arose in the loss computation (after the model's output)")
        self._finish(trainer, pl_module, step, "reproducible", "nan_reproducible",
                     f"{what} at {where}; REPRODUCIBLE on rerun on rank(s) {bad_ranks}: {where_mod}",
                     f"the data or the model: inspect batch {batch_idx} (data_inspector) and "
                     f"{module or 'the loss'}'s inputs, initialisation and numerics (log/sqrt/div at 0, overflow "
                     f"in low precision); lower the LR; on_error=skip drops this update",
                     details, bad_ranks)

    def _rerun(self, trainer: Any, pl_module: Any, backward: bool,
               scale: float | torch.Tensor = 1.0) -> tuple[list[int], dict[int, tuple[str, int]]]:
        """EVERY rank: recompute the step's loss (and gradients, of the loss x ``scale``: the step's fp16 loss
        scale) from the saved batch/RNG; agree on the result.
        Returns the ranks whose rerun was non-finite and, per rank, the first module whose output went
        non-finite as (name, position among the module calls in the order the forward finished them:
        a child finishes before its parent, so the innermost module where it arose comes first)."""
        first: list[int] = []  # [module index, its position among the module calls in forward order]
        calls = [0]
        index = {id(m): i for i, (_, m) in enumerate(self._modules)}

        def hook(module: Any, inputs: Any, output: Any) -> None:
            calls[0] += 1
            if not first and not _finite(output):
                first.extend((index[id(module)], calls[0]))

        handles = [m.register_forward_hook(hook) for _, m in self._modules]
        saved_rng = _rng_state()
        _set_rng_state(self._rng)
        plugin = getattr(trainer, "precision_plugin", None)
        ctx = plugin.forward_context() if plugin is not None else nullcontext()
        try:
            # a block of library collectives under ZeRO-3 (the forward's gathers), agreed once (distributed/check_sync.py)
            with collectives.collective_region(), ctx, torch.set_grad_enabled(backward):
                loss = self._loss(pl_module)
                bad = not bool(torch.isfinite(loss.detach()).all())
                if backward and not bad:
                    grads = torch.autograd.grad(loss * scale, self._params, allow_unused=True)
                    bad = not all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        finally:
            for h in handles:
                h.remove()
            _set_rng_state(saved_rng)
        world, rank = trainer.world_size, trainer.global_rank
        vec = torch.zeros(3 * world, dtype=torch.float64)  # per rank: bad, module index + 1, forward position
        vec[rank], vec[world + rank] = float(bad), float(first[0] + 1 if first else 0)
        vec[2 * world + rank] = float(first[1] if first else 0)
        if world > 1:  # COLLECTIVE, every rank (all are in this branch): only on a rerun step
            vec = collectives.reduce(trainer, vec, "sum").cpu()
        values = vec.tolist()
        bad_ranks = [r for r in range(world) if values[r] > 0]
        modules = {r: (self._modules[int(values[world + r]) - 1][0], int(values[2 * world + r]))
                   for r in range(world) if values[world + r] > 0}
        return bad_ranks, modules

    def _loss(self, pl_module: Any) -> torch.Tensor:
        if hasattr(pl_module, "_losses"):  # dsdebug.models.lm_module: the step's loss without logging
            return pl_module._losses(self._batch, training=False)[0]
        out = pl_module.training_step(self._batch, self._batch_idx)
        return out["loss"] if isinstance(out, dict) else out

    def _finish(self, trainer: Any, pl_module: Any, step: int, label: str, code: str, message: str,
                advice: str, details: dict, ranks: list[int]) -> None:
        """EVERY rank with the same decision: rank 0 writes, every rank applies the policy."""
        self.labels[step] = label
        rank = ranks[0] if len(ranks) == 1 else None
        if len(self.labels) == self.max_findings:
            message += " (further non-finite steps are only counted)"
        if len(self.labels) <= self.max_findings and trainer.global_rank == 0:
            self.report(trainer, "error", code, message, advice, details, rank=rank)
        else:
            self._apply_policy(trainer, Finding(self.name, "error", code, message, advice, step=step, rank=rank))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        absorbed = self._overflow.absorbed
        overflows = f"; {absorbed} fp16 overflow step(s) the loss scaler absorbed (not rerun)" if absorbed else ""
        fp16 = {"overflows_absorbed": absorbed} if self._scaler is not None else {}
        if trainer.global_rank == 0 and not self.labels:
            self.report(trainer, "info", "nan_summary", "no non-finite step" + overflows,
                        details={"reruns": 0, **fp16}, rank=None)
        elif trainer.global_rank == 0:
            counts = {lab: sum(1 for v in self.labels.values() if v == lab) for lab in set(self.labels.values())}
            self.report(trainer, "info", "nan_summary",
                        f"{len(self.labels)} non-finite step(s): " + ", ".join(f"{k} x{v}" for k, v in
                                                                             sorted(counts.items()))
                        + f"; {self.reruns} rerun(s)" + overflows,
                        details={"labels": {str(k): v for k, v in self.labels.items()}, "reruns": self.reruns,
                                 **fp16}, rank=None)

