"""Planted bugs in the FIRST steps of a run: each must be named within 5 steps of onset
although the detectors' windows are not warm yet.

Spikes (``+callbacks.plant._target_=tests.planted.early.LRBlowUp +callbacks.plant.step=8``):
``LRBlowUp`` multiplies every param group's LR by ``factor`` for the update of ``step`` (the scheduler
sets it back the step after: one huge update); ``LossScale`` multiplies the training loss by ``factor``
at ``step`` (a loss scale applied and never undone). ``tests.planted.spike.SpikeLoss`` adds scaled
logits and a batch of random tokens (data corruption).

Residual branches (``model.net._target_=tests.planted.layers.BlockLM +model.net.scaled_block=1
+model.net.scale=1e-4``; all blocks: ``ScaledResidualLM``): a branch scaled by 1e-4 from
initialisation, so its gradients are 1e-4 of its neighbours' from step 0.

Routers collapsed at initialisation (``+callbacks.plant._target_=tests.planted.early.RouterInit
+callbacks.plant.mode=tie``): ``bias`` -- expert ``expert``'s routing score gets +``bias`` (via
``tests.planted.router.RouterBias`` at step 0); ``tie`` -- every gate row is the same (a row copied
over the others at init: all scores tie and top-k takes the same experts for every token); ``zeros``
-- the gate weight initialised to zeros (all scores tie as well); ``huge_row`` -- expert ``expert``'s
gate row replaced by ``scale`` x the mean direction of the router's inputs (measured on the tiny
DeepSeek-V3: the expert then wins only ~half the tokens, the sign of its score varies per token, so
this is NOT a collapse of the load and no check names it at init).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback

from dsdebug.models.moe_aux import find_routers
from tests.planted.layers import BlockLM


class LRBlowUp(Callback):
    def __init__(self, step: int, factor: float = 1000.0) -> None:
        self.step, self.factor = int(step), float(factor)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            for opt in trainer.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * self.factor


class LossScale(Callback):
    def __init__(self, step: int, factor: float = 1000.0) -> None:
        self.step, self.factor = int(step), float(factor)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        inner = pl_module.training_step

        def scaled(batch: Any, batch_idx: int) -> Any:
            loss = inner(batch, batch_idx)
            return loss * self.factor if trainer.global_step == self.step else loss

        pl_module.training_step = scaled


class ScaledResidualLM(BlockLM):
    """``BlockLM`` with EVERY residual branch scaled by ``scale`` (a residual scale initialised to 1e-4
    everywhere, e.g. a depth-scaling bug)."""

    def __init__(self, vocab_size: int = 4096, hidden_size: int = 32, num_layers: int = 4, scale: float = 1e-4,
                 **kwargs: Any) -> None:
        super().__init__(vocab_size, hidden_size, num_layers, **kwargs)
        self.scales = [scale] * num_layers


class RouterInit(Callback):
    """A router collapsed from initialisation, in decoder layer ``layer`` (see the module docstring)."""

    def __init__(self, mode: str, layer: int = 1, expert: int = 3, bias: float = 10.0, scale: float = 1e3) -> None:
        assert mode in ("bias", "huge_row", "tie", "zeros"), mode
        self.mode, self.layer, self.expert, self.bias, self.scale = mode, layer, expert, bias, scale

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # before the optimizer exists and before DeepSpeed flattens the weights: an init bug
        routers = {n: m for n, m in find_routers(pl_module.net).items() if f"layers.{self.layer}." in n + "."}
        assert routers, f"no router in decoder layer {self.layer}"
        router = next(iter(routers.values()))
        weight = router.weight
        with torch.no_grad():
            if self.mode == "tie":
                weight.copy_(weight[self.expert].expand_as(weight).clone())
            elif self.mode == "zeros":
                weight.zero_()
            elif self.mode == "huge_row":
                weight[self.expert] = self.scale * _input_direction(pl_module.net, router, weight.shape[1])
            else:
                bias = getattr(router, "e_score_correction_bias", None)
                if bias is not None:
                    bias[self.expert] += self.bias
                else:
                    from tests.planted.router import RouterBias

                    self._hook = RouterBias(self.layer, self.expert, 0, self.bias)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if getattr(self, "_hook", None) is not None:
            self._hook.on_train_start(trainer, pl_module)


def _input_direction(net: Any, router: Any, width: int) -> torch.Tensor:
    """Unit vector of the mean input the router sees (one forward of random tokens)."""
    seen: list[torch.Tensor] = []
    handle = router.register_forward_hook(lambda m, args, out: seen.append(args[0].detach().reshape(-1, width)))
    try:
        with torch.no_grad():
            vocab = net.get_input_embeddings().num_embeddings
            net(input_ids=torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0)))
    finally:
        handle.remove()
    mean = seen[0].float().mean(0)
    return mean / mean.norm().clamp_min(1e-12)


class CorruptBatch(Callback):
    """At ``step`` the batch is replaced by a corrupted one: ``zeros`` (a zero-filled shard: every token
    id 0) or ``random`` (bytes of a binary file: uniform random ids)."""

    def __init__(self, step: int, mode: str = "zeros") -> None:
        assert mode in ("zeros", "random"), mode
        self.step, self.mode = int(step), mode

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step:
            return
        ids = batch["input_ids"]
        if self.mode == "zeros":
            ids.zero_()
        else:
            ids.random_(0, int(ids.max()) + 1)
        if "labels" in batch:
            batch["labels"].copy_(ids)
