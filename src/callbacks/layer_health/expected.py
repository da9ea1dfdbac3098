"""What the optimizer should move each layer by in one step, and why a layer moved far less.

An adaptive optimizer (Adam, AdamW, Lion, RMSprop, ...: a param group with ``betas`` or ``eps``) moves each element
by about ``lr`` per step whatever the gradient's scale (``|m / (sqrt(v) + eps)|`` is ~1 at the first step and
stays within ~0.05-1 after); SGD moves it by ``lr x`` its gradient (more under momentum). A layer whose update
RMS is orders below that lost its step between the gradient and the weight; the causes, each judged from host
facts the run already has (the group's lr and eps, the clip threshold, the layer's gradient RMS before clipping,
the weights' dtype):

- ``eps``: the layer's gradient RMS reaching the optimizer is below its ``eps`` (an eps of 1 typed for 1e-8, a
  loss divided by a huge count): Adam's step becomes ``lr x g / eps``;
- ``clip``: the clip threshold is orders below the gradient norm: SGD's step shrinks by ``clip / norm``, Adam's
  once the clipped gradient falls below eps;
- ``rounding``: the optimizer writes 16-bit weights with no fp32 master copy (``precision=bf16-true``, a model
  cast with ``.to(torch.bfloat16)``) and the step is below half the spacing of those weights: it rounds away;
- ``unknown``: none of these (a custom optimizer or a hook undoing the step).

Everything here is host arithmetic on floats (no device read): the groups are mapped once per fit, the lr per
layer is read from the groups at each measured step.
"""

from __future__ import annotations

from typing import Any

import torch

from dsdebug.callbacks.grad_access import base_optimizer, host_float, optimizer_param_groups, run_clip

__all__ = ["ExpectedStep", "explain", "lost_cause"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_MANTISSA = {torch.bfloat16: 8, torch.float16: 11}  # significant bits: spacing ~ |w| x 2^-bits


def lost_cause(kind: str, should: float, grad_rms: float, eps: float, clip_coef: float, bits: int | None,
               weight_rms: float) -> str:
    """Why a layer's update fell far below ``should``, the step per element its optimizer should give (``kind``:
    adaptive | sgd). ``grad_rms``: the layer's gradient RMS before clipping; ``clip_coef``: clip / global norm (1: no
    clipping); ``bits``: the mantissa bits of the weights the optimizer writes when they are 16-bit with no fp32
    master copy (else None)."""
    if bits is not None and weight_rms > 0 and should < weight_rms * 2.0 ** -bits:
        return "rounding"
    if clip_coef < 0.1 and (kind == "sgd" or grad_rms * clip_coef < eps):
        return "clip"
    if kind == "adaptive" and eps > 0 and grad_rms < eps:
        return "eps"
    return "unknown"


class ExpectedStep:
    """Per layer: the optimizer's kind (adaptive | sgd | None: not judged), the largest ``eps`` of its groups, the
    mantissa bits of its weights when they are 16-bit (``bits``; ``direct``: the optimizer writes them itself, with no
    fp32 master copy), and at each measured step the lr-weighted size ``sum(numel x lr^2)`` an adaptive step should
    have (SGD: x the gradient's mean square)."""

    def __init__(self) -> None:
        self.kind: list[str | None] = []
        self.eps: list[float] = []
        self.bits: list[int | None] = []
        self.direct = False
        self.clip: float | None = None
        self.optimizer_name = "?"
        self._share: list[tuple[dict, list[float]]] = []  # per group: (group, numel per layer)

    def map(self, trainer: Any, params: list[torch.Tensor], layer_idx: tuple[int, ...], n_layers: int) -> None:
        """Each parameter's optimizer group, summed per layer (after the optimizer and DeepSpeed's engine exist)."""
        self.kind, self.eps, self.bits, self._share = [None] * n_layers, [0.0] * n_layers, [None] * n_layers, []
        if not getattr(trainer, "optimizers", None):
            return
        by_id = optimizer_param_groups(trainer) or {}
        optimizer = base_optimizer(trainer.optimizers[0])
        self.optimizer_name = type(optimizer).__name__
        self.clip = run_clip(trainer) if hasattr(trainer, "strategy") else None
        self.direct = isinstance(trainer.optimizers[0], torch.optim.Optimizer)  # no DeepSpeed wrapper: no fp32 master
        shares: dict[int, tuple[dict, list[float]]] = {}
        kinds: list[set] = [set() for _ in range(n_layers)]
        for p, layer in zip(params, layer_idx):
            g = by_id.get(id(p))
            if g is None:
                kinds[layer].add(None)
                continue
            shares.setdefault(id(g), (g, [0.0] * n_layers))[1][layer] += float(getattr(p, "ds_numel", p.numel()))
            kinds[layer].add(_kind(optimizer, g))
            self.eps[layer] = max(self.eps[layer], host_float(g.get("eps", 0.0)) or 0.0)
            if p.dtype in _LOW_PRECISION:  # the weights measured (DeepSpeed: the lp copy of an fp32 master)
                self.bits[layer] = _MANTISSA[p.dtype]
        self.kind = [k.pop() if len(k) == 1 else None for k in kinds]  # mixed or unknown: not judged
        self._share = list(shares.values())

    def lr_sq(self) -> list[float] | None:
        """Per layer ``sum(numel x lr^2)`` from the groups' current lr (host floats); None when unmapped."""
        if not self._share:
            return None
        out = [0.0] * len(self.kind)
        for group, numel in self._share:
            lr = host_float(group.get("lr", 0.0))
            if lr is None:  # a device tensor lr: not read (a sync)
                return None
            for i, n in enumerate(numel):
                out[i] += n * lr * lr
        return out


def _kind(optimizer: Any, group: dict) -> str | None:
    """adaptive | sgd | None (not judged). Adaptive: the optimizers whose step is ~lr per element from the first step
    on (``_ADAPTIVE``); not RAdam (its first steps are momentum SGD), Adagrad / Adadelta (their step shrinks with
    the accumulated squares), LAMB (a trust ratio x the weight's norm), Prodigy / D-Adaptation (lr x a learned d),
    Muon (orthogonalised: ~lr / sqrt(width)), Adafactor (relative to the weight's RMS), nor an unknown optimizer."""
    name = type(optimizer).__name__
    if name in _SGD and "betas" not in group:
        return "sgd"
    if name in _ADAPTIVE and not group.get("use_muon"):
        return "adaptive"
    return None


# torch, DeepSpeed (FusedAdam, DeepSpeedCPUAdam, Lion), bitsandbytes (8-bit and paged variants)
_ADAPTIVE = frozenset({"Adam", "AdamW", "NAdam", "Adamax", "RMSprop", "FusedAdam", "DeepSpeedCPUAdam", "Lion",
                       "FusedLion", "DeepSpeedCPULion", "Adam8bit", "AdamW8bit", "PagedAdam", "PagedAdamW",
                       "PagedAdam8bit", "PagedAdamW8bit", "Lion8bit", "PagedLion", "PagedLion8bit"})
_SGD = frozenset({"SGD", "SGD8bit"})

_WHY = {  # cause -> (the message's reason, with {facts}; advice)
    "eps": (": its gradient RMS {grad_rms:.3g} is below the optimizer's eps={eps:g}, so each step is lr x g / eps "
            "instead of ~lr",
            "set eps to about 1e-8 (optim.optimizer.eps; torch's default), or find what scales the gradient down (a "
            "loss divided by a token count twice, a tiny loss weight, gradients divided by the world size by hand)"),
    "clip": (": the clip threshold {clip:g} is {coef:.2g} x the gradient norm {gnorm:.3g}, so every step is scaled "
             "down by it",
             "raise the clip (optim.grad_clip / the DeepSpeed config's gradient_clipping / Trainer gradient_clip_val) "
             "to about the healthy gradient norm grad_monitor logs, or remove it"),
    "rounding": (": its weights are 16-bit with no fp32 master copy, and a step of ~{lr:.2g} on weights of RMS "
                 "{weight_rms:.3g} is below half their spacing: it rounds away",
                 "keep fp32 master weights: precision bf16-mixed instead of bf16-true (or DeepSpeed's bf16, which "
                 "holds an fp32 copy), or do not cast the model with .to(torch.bfloat16) before the optimizer"),
    "unknown": (": the gradient is above eps and no clip explains it",
                "look for code that undoes the step (a hook or callback restoring or re-initialising the weights), "
                "an optimizer wrapper that scales its update, or a layer whose real lr differs from its param "
                "group's"),
}


def explain(cause: str, facts: dict, clip: float | None, coef: float, gnorm: float) -> tuple[str, str]:
    """The finding's reason (appended to its message) and advice for ``cause``, from the layer's ``facts``."""
    reason, advice = _WHY[cause]
    return reason.format(clip=clip or 0.0, coef=coef, gnorm=gnorm, **facts), advice
