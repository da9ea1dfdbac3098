"""Nets and planted bugs for gradient checkpointing (model.gradient_checkpointing, the grad_checkpointing check).

``BlockLM``: a user's own small LM whose blocks sit in an ``nn.ModuleList`` (the generic checkpointing
path, not Hugging Face's). ``freeze_embedding=True`` plants the known silent failure: under reentrant
checkpointing no input of the first block requires grad, so no block gets a gradient.

``RouterBiasInForward``: a DeepSeek-V3 router whose aux-loss-free bias is updated inside its forward
(the update belongs after the step): the recompute in backward routes with the moved bias, so the
experts chosen in backward differ from the forward's. Command line:
``+callbacks.planted._target_=tests.planted.ckpt.RouterBiasInForward +callbacks.planted.layer=1``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn

from dsdebug.models.moe_aux import find_routers


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class BlockLM(nn.Module):
    """embedding -> ``layers`` (nn.ModuleList of residual MLP blocks) -> head."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, num_layers: int = 3, freeze_embedding: bool = False,
                 **_: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(num_layers))
        self.head = nn.Linear(hidden, vocab_size)
        if freeze_embedding:  # e.g. LoRA/adapters, or a frozen pretrained vocabulary
            self.embed.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class RouterBiasInForward(Callback):
    """After every forward of decoder layer ``layer``'s router, its expert with the most tokens gets its
    ``e_score_correction_bias`` lowered by ``gamma`` (and the least loaded raised): balancing done in forward."""

    def __init__(self, layer: int = 1, gamma: float = 1.0) -> None:
        self.layer, self.gamma = layer, float(gamma)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        routers = {n: m for n, m in find_routers(pl_module.net).items() if f"layers.{self.layer}." in n + "."}
        assert routers, f"no router in decoder layer {self.layer}"
        next(iter(routers.values())).register_forward_hook(self._update_bias)

    def _update_bias(self, module: Any, args: Any, output: Any) -> None:
        if not module.training:
            return
        with torch.no_grad():
            load = torch.bincount(output[2].reshape(-1), minlength=module.num_experts).float()
            module.e_score_correction_bias[int(load.argmax())] -= self.gamma
            module.e_score_correction_bias[int(load.argmin())] += self.gamma
