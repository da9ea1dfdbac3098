"""`GradScaleCheck`: the gradient of each micro-batch is scaled the way the config says, verified once.

The config example and the table of metrics and findings: the class docstring (`GradScaleCheck`).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from dsdebug.config.args import Rule, number
from dsdebug.callbacks.base import DebugCallback

__all__ = ["GradScaleCheck"]

log = logging.getLogger(__name__)


class GradScaleCheck(DebugCallback):
    """`GradScaleCheck`: the gradient of each micro-batch is scaled the way the config says, verified once.

    Catches a wrong gradient scale under gradient accumulation before it wastes a run. With
    ``accumulate_grad_batches=k`` Lightning divides each micro-batch's loss by k, and that must be
    the only division: the optimizer then sees the gradient of the mean loss over the k*b samples,
    exactly as one batch of k*b would give it. Lightning's stock DeepSpeed strategy let the
    engine divide by ``gradient_accumulation_steps`` a second time (Lightning #6170): gradients,
    grad norms and every gradient threshold were k times too small and clipping at 1.0 acted
    like k. Nothing else shows it: the loss still falls, only more slowly.

    How (every rank, once, no collective): at the first backward of the fit a hook on the loss
    tensor Lightning back-propagates records the gradient that reaches it. That is the factor the
    backward path applies on top of Lightning's 1/k: it must equal the mixed-precision loss scale
    (1 in fp32/bf16; under DeepSpeed the scale its optimizer applies, read through the engine's own
    ``scale_if_loss``; under torch AMP Lightning has applied the scaler before the hook) and
    nothing more. It also compares the engine's ``gradient_accumulation_steps`` with
    ``trainer.accumulate_grad_batches`` (a mismatch moves the optimizer step off Lightning's
    accumulation boundary). Each rank reaches the same verdict from the same config; rank 0 writes
    the finding, every rank applies the policy. Afterwards its hooks return at once. A healthy
    verdict is one log line (``grad_scale: verified ...``) and ``factor`` on the callback, not a
    finding: findings are for what needs a person.

    It is framework integrity, not a debug technique: on in every run (``debug=none`` included,
    like the liveness and preemption callbacks), off with ``~callbacks.grad_scale``.

    Not covered here: the averaging of gradients across data-parallel ranks (DDP and DeepSpeed
    average; tests/trainer/test_accumulation.py checks k x b against k*b end to end at 1 and 2 ranks).

    Example::

        python train.py strategy=zero2 trainer.accumulate_grad_batches=4   # on by default
        python train.py ~callbacks.grad_scale                              # off: no hooks at all

    | finding code | severity | when |
    |---|---|---|
    | ``grad_scale_wrong`` | error | the backward path scales the loss by a factor other than the loss scale |
    | ``accumulation_mismatch`` | error | DeepSpeed's gradient_accumulation_steps != trainer.accumulate_grad_batches |

    It logs no metrics. Resume: nothing is carried over (``state_attrs`` is empty): a resumed process
    builds a new engine, so its backward path is verified again.
    """
    name = "grad_scale"
    policies = ("warn", "stop")
    policy_note = "skip: a wrong scale is wrong at every step"
    state_attrs = ()  # the verdict is about this process's engine and backward path

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "rtol": number(0, 1, open_low=True, open_high=True),
    }

    def __init__(self, rtol: float = 1e-3, on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(rtol=rtol)
        self.rtol = float(rtol)
        self.done = False
        self.factor: float | None = None  # measured: 1.0 = as configured
        self._seen: torch.Tensor | None = None
        self._expected: float | None = None
        self._mismatch = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        engine = _engine(trainer)
        if engine is None or self.done:
            return
        gas, accum = int(engine.gradient_accumulation_steps()), int(trainer.accumulate_grad_batches)
        if gas != accum:
            self._mismatch = True
            self._verdict(trainer, "error", "accumulation_mismatch",
                          f"DeepSpeed's engine steps the optimizer every {gas} micro-batch(es) "
                          f"(gradient_accumulation_steps) but trainer.accumulate_grad_batches={accum}: the update "
                          f"falls off Lightning's accumulation boundary and the gradient is scaled by 1/{accum} "
                          f"over {gas} micro-batches",
                          "set gradient_accumulation_steps to \"auto\" (or equal to trainer.accumulate_grad_batches)"
                          " in the DeepSpeed config; do not change the engine's config after Lightning built it",
                          {"gradient_accumulation_steps": gas, "accumulate_grad_batches": accum})

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.done or self._expected is not None or not loss.requires_grad:
            return
        self._expected = _loss_scale(trainer)
        loss.register_hook(self.guarded(self._record, "the loss's gradient hook"))

    def _record(self, grad: torch.Tensor) -> None:
        self._seen = grad.detach().float().cpu()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self.done or self._expected is None:
            return
        self.done = True
        if self._seen is None:
            return  # the loss got no gradient (not back-propagated through it): nothing to judge
        factor = self.factor = float(self._seen) / self._expected
        accum = int(trainer.accumulate_grad_batches)
        details = {"factor": factor, "loss_scale": self._expected, "accumulate_grad_batches": accum,
                   "strategy": type(trainer.strategy).__name__}
        if abs(factor - 1.0) <= self.rtol:
            if not self._mismatch and trainer.global_rank == 0:
                log.info("grad_scale: verified: each micro-batch's loss reaches the gradients scaled by 1/%d "
                         "(accumulate_grad_batches=%d) x the loss scale %g, as configured", accum, accum,
                         self._expected)
            return
        engine = _engine(trainer)
        gas = int(engine.gradient_accumulation_steps()) if engine is not None else None
        if gas is not None and gas > 1 and abs(factor * gas - 1.0) <= self.rtol:
            why = (f"DeepSpeed's engine divided the loss by gradient_accumulation_steps={gas} on top of "
                   f"Lightning's division by accumulate_grad_batches={accum} (Lightning #6170)")
        else:
            why = "the backward path (strategy, precision plugin or a hook) rescaled the loss"
        self._verdict(
            trainer, "error", "grad_scale_wrong",
            f"gradients are {factor:.4g}x what the config implies: {why}; the optimizer sees the gradient of "
            f"{factor:.4g} x the mean loss over the accumulated batch, grad norms and thresholds are off by that "
            f"factor and clipping at max_norm c acts like c/{factor:.4g}",
            "use dsdebug.trainer.strategy.DebugDeepSpeedStrategy (engine.backward(scale_wrt_gas=False)), or call "
            "engine.backward(loss, scale_wrt_gas=False) in your own strategy; with no accumulation the factor "
            "would not matter", details)

    def _verdict(self, trainer: Any, severity: str, code: str, message: str, advice: str, details: dict) -> None:
        """Same verdict on every rank: rank 0 writes it, every rank applies the error policy."""
        if trainer.global_rank == 0:
            self.report(trainer, severity, code, message, advice, details, rank=None)
        elif severity == "error":
            from dsdebug.findings import Finding

            self._apply_policy(trainer, Finding(self.name, severity, code, message, advice,
                                                step=trainer.global_step, rank=None))


def _engine(trainer: Any) -> Any:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return trainer.strategy.deepspeed_engine if isinstance(trainer.strategy, DeepSpeedStrategy) else None


def _loss_scale(trainer: Any) -> float:
    """The mixed-precision factor the backward path may apply beyond Lightning's hook point."""
    engine = _engine(trainer)
    if engine is None:
        return 1.0  # torch AMP: Lightning scaled the tensor before on_before_backward
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    # the same two branches as DeepSpeedEngine.backward, applied to a unit "loss"
    probe = torch.ones((), requires_grad=True) * 1.0
    if isinstance(engine.optimizer, ZeROOptimizer):
        return float(engine.optimizer.scale_if_loss(probe).detach())
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    return float(scaler.scale(probe)) if scaler is not None else 1.0
