"""Planted bugs for the LoRA adapter's checks (tests/models/test_lora.py).

From the command line of a real run, e.g. ``+callbacks.unfreeze._target_=tests.planted.lora.UnfreezeBase``
or ``model._target_=tests.planted.lora.AllParamsModule optim.optimizer._target_=tests.planted.lora.DecayAll``.
Parameter names are the adapted net's own (no ``net.`` prefix).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback

from dsdebug.models.lm_module import CausalLMModule

# a base weight of the small DeepSeek (tests/helpers/runs.py SMALL_DEEPSEEK) under the adapter
BASE_WEIGHT = "base_model.model.model.layers.0.self_attn.o_proj.base_layer.weight"


def _param(pl_module: Any, name: str) -> torch.nn.Parameter:
    return dict(pl_module.named_parameters())[f"net.{name}"]


class UnfreezeBase(Callback):
    """A base weight left trainable after the adapter froze the base (model code or a callback
    that "unfreezes the last layer"): the optimizer gets it and it moves."""

    def __init__(self, param: str = BASE_WEIGHT) -> None:
        self.param = param

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _param(pl_module, self.param).requires_grad_(True)


class PerturbBaseOnResume(Callback):
    """A resume that does not restore the frozen base (a checkpoint without it, a base rebuilt
    differently): after the checkpoint is loaded, ``param`` differs from what was saved."""

    def __init__(self, param: str = BASE_WEIGHT) -> None:
        self.param = param

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.ckpt_path:
            with torch.no_grad():
                _param(pl_module, self.param).add_(0.01)


class AllParamsModule(CausalLMModule):
    """configure_optimizers hands every parameter to the optimizer, the frozen base included."""

    def configure_optimizers(self) -> Any:
        return self.optimizer_factory([{"params": list(self.net.parameters())}])


class DecayAll(torch.optim.Optimizer):
    """SGD whose decoupled weight decay is applied to every parameter of its groups, also to those
    that got no gradient (frozen): a custom optimizer that moves a frozen base."""

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.1, **_: Any) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss
