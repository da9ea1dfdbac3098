"""Dropping one optimizer update, for each engine: the strategy layer's side of ``on_error=skip``.

A check with ``on_error=skip`` asks for it (``skip_optimizer_step`` on the LightningModule,
callbacks/base.py); the module passes the request on, at the last point before the update
(``on_before_optimizer_step``), to the strategy's ``skip_update`` (trainer/strategy.py), which calls
:func:`arm_skip`. Weights, optimizer moments and the loss scale stay as they were; the step counter
and LR schedule advance. Torch optimizers: the gradients are dropped. DeepSpeed ZeRO-1/2/3 and
BF16_Optimizer: the step goes down DeepSpeed's own overflow path (what an fp16 overflow does),
forced for one step with instance attributes and undone after it. Stage 0 fp32: that one step() is a
no-op. Any other DeepSpeed optimizer (stage 0 fp16/bf16): finding ``skip_unsupported``, the update
is applied, the run stops (exit 3).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

__all__ = ["arm_skip"]

log = logging.getLogger(__name__)


def arm_skip(trainer: Any, optimizer: Any) -> Callable[[], None] | None:
    """Make the coming update a no-op: weights, optimizer state (moments, step counts) and the
    loss scale stay as they were, gradients are dropped. The step counter and Lightning's LR
    schedule still advance. Returns the undo for after the step; None = not at DeepSpeed's
    accumulation boundary yet (the request waits for it). Runs on every rank. DeepSpeed: only for the
    optimizers whose skip is verified (tests/callbacks/test_cb_grad_monitor.py, test_cb_loss_spike.py)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not isinstance(trainer.strategy, DeepSpeedStrategy):
        log.warning("step %d: dropping this optimizer update (a check asked to skip it)", trainer.global_step)
        _drop_grads(optimizer)  # torch optimizers leave parameters without .grad untouched
        return _noop
    engine = trainer.strategy.deepspeed_engine
    if not engine.is_gradient_accumulation_boundary():
        return None
    log.warning("step %d: dropping this optimizer update (a check asked to skip it)", trainer.global_step)
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    # DeepSpeed's ZeRO/BF16 optimizers drop a step whose gradients overflowed (fp16 overflow
    # path: clear gradients, no update). Force that path for one step with instance attributes.
    opt = engine.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        def forced_overflow(update_scale: bool = True) -> bool:
            opt.overflow = True
            return opt._loss_scale_update_and_overflow_cleanup() if update_scale else True

        patches: dict[str, Any] = {"_overflow_check_and_loss_scale_update": forced_overflow}
    elif isinstance(opt, DeepSpeedZeroOptimizer):  # ZeRO-1/2
        patches = {"check_grad_overflow": True,
                   "check_overflow": lambda partition_gradients=True: setattr(opt, "overflow", True)}
    elif isinstance(opt, BF16_Optimizer):  # ZeRO-1 + bf16: its own overflow branch, verbatim
        def skipped_step(closure: Any = None) -> None:
            opt.overflow, opt._global_grad_norm = True, float("inf")
            opt.clear_hp_grads()
            opt.clear_lp_grads()

        patches = {"step": skipped_step}
    elif isinstance(opt, torch.optim.Optimizer):  # ZeRO stage 0, fp32: the engine steps a torch optimizer
        patches = {"step": lambda *args, **kwargs: None}  # (dropping grads crashes DeepSpeed's clipping)
    else:  # e.g. FP16_Optimizer (stage 0 fp16): no verified way to drop an update
        _skip_unsupported(trainer, opt)
        return _noop
    scaler = getattr(opt, "loss_scaler", None)
    saved_scaler = dict(vars(scaler)) if scaler is not None else {}
    saved = {k: opt.__dict__[k] for k in patches if k in opt.__dict__}
    opt.__dict__.update(patches)

    def undo() -> None:
        for k in patches:
            opt.__dict__.pop(k, None)
        opt.__dict__.update(saved)
        if scaler is not None:
            vars(scaler).update(saved_scaler)  # an overflow would have lowered a dynamic loss scale

    return undo


def _drop_grads(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def _noop() -> None:
    return None


def _skip_unsupported(trainer: Any, opt: Any) -> None:
    """Honest fallback: say so, let this update happen, stop the run (exit code 3)."""
    from dsdebug.findings import Finding, get_channel

    finding = Finding(
        check="optimizer_step", severity="error", code="skip_unsupported", step=trainer.global_step, rank=None,
        message=f"a check asked to skip step {trainer.global_step}, but {type(opt).__name__} has no verified way "
                "to drop an update: this update IS applied and the run stops instead",
        advice="use on_error=stop with this optimizer, or a DeepSpeed config with ZeRO stage 1-3")
    channel = get_channel()
    if trainer.global_rank == 0:
        channel.report(finding)
    if channel.stop_request is None:
        channel.stop_request = finding
    trainer.should_stop = True
