"""Planted layer bugs (and a witness) for the layer_health tests.

From the command line of a real run:
``model.net._target_=tests.planted.layers.BlockLM +model.net.scaled_block=1`` (block 1's output x 1e-6),
``+model.net.slow_block=2 optim.optimizer._target_=tests.planted.layers.adamw_planted_lr`` (block 2 in its own
param group with lr 1e-9), ``+callbacks.boom._target_=tests.planted.layers.ScaleBlockGrad
+callbacks.boom.block=model.layers.3 +callbacks.boom.from_step=6`` (block 3's gradient x 100 from step 6).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn

from dsdebug.callbacks.grad_access import display_name, layer_of


class BlockLM(nn.Module):
    """Embedding -> ``num_layers`` residual MLP blocks ``model.layers.N`` -> norm -> head, named like an
    HF causal LM. ``scaled_block``: that block's output is multiplied by ``scale`` (its gradients
    shrink by the same factor). ``slow_block``: its parameters carry ``_planted_lr`` for
    ``adamw_planted_lr``."""

    def __init__(self, vocab_size: int = 4096, hidden_size: int = 32, num_layers: int = 4,
                 scaled_block: int | None = None, scale: float = 1e-6, slow_block: int | None = None,
                 slow_lr: float = 1e-9, **_: Any) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.model.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, 2 * hidden_size), nn.GELU(),
                          nn.Linear(2 * hidden_size, hidden_size)) for _ in range(num_layers))
        self.model.norm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.scales = [scale if i == scaled_block else 1.0 for i in range(num_layers)]
        if slow_block is not None:
            for p in self.model.layers[slow_block].parameters():
                p._planted_lr = slow_lr  # the planted config bug: read by adamw_planted_lr

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        for block, scale in zip(self.model.layers, self.scales):
            h = h + scale * block(h)
        return self.lm_head(self.model.norm(h))


def adamw_planted_lr(params: list[dict], **kwargs: Any) -> torch.optim.AdamW:
    """AdamW where parameters tagged ``_planted_lr`` get their own param group with that lr."""
    groups = []
    for group in params:
        tagged = [p for p in group["params"] if hasattr(p, "_planted_lr")]
        rest = [p for p in group["params"] if not hasattr(p, "_planted_lr")]
        if rest:
            groups.append({**group, "params": rest})
        if tagged:
            groups.append({**group, "params": tagged, "lr": tagged[0]._planted_lr})
    return torch.optim.AdamW(groups, **kwargs)


class ScaleBlockGrad(Callback):
    """From ``from_step`` on, every gradient of ``block``'s parameters is multiplied by ``factor`` (before
    any reduction): a block that explodes while the others do not."""

    def __init__(self, block: str, from_step: int, factor: float = 100.0) -> None:
        self.block, self.from_step, self.factor = block, from_step, factor

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        for n, p in pl_module.named_parameters():
            if display_name(n).startswith(self.block + "."):
                p.register_hook(self._scale)

    def _scale(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor if self.trainer.global_step >= self.from_step else grad


class LayerWitness(Callback):
    """Witness: per-layer sums of squares of FULL gradients, weights and updates at ``steps``, from
    full tensors (ZeRO: ``safe_get_full_grad`` and gathered weights -- collectives, every rank),
    written by rank 0 to ``<run_dir>/layer_witness.json`` as {step: {layer: [g_sq, w_sq, dw_sq, numel]}}."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = {int(s) for s in steps}
        self.record: dict[str, dict] = {}
        self._before: dict[str, torch.Tensor] | None = None
        self._grads: dict[str, float] = {}

    def _full_weights(self, trainer: Any, pl_module: Any) -> dict[str, torch.Tensor]:
        from contextlib import nullcontext

        named = {display_name(n): p for n, p in pl_module.named_parameters() if p.requires_grad}
        ctx = nullcontext()
        if getattr(trainer.strategy, "zero_stage_3", False):
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(list(named.values()))
        with ctx, torch.no_grad():
            return {n: p.detach().double().clone() for n, p in named.items()}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step in self.steps:
            self._before = self._full_weights(trainer, pl_module)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step not in self.steps:
            return
        from lightning.pytorch.strategies import DeepSpeedStrategy

        self._grads = {}
        for n, p in pl_module.named_parameters():
            if not p.requires_grad:
                continue
            if isinstance(trainer.strategy, DeepSpeedStrategy):
                from deepspeed.utils import safe_get_full_grad

                g = safe_get_full_grad(p)  # collective under ZeRO, every rank
            else:
                g = p.grad
            self._grads[display_name(n)] = float(g.double().pow(2).sum()) if g is not None else 0.0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step - 1  # the update of this batch is done
        if step not in self.steps or self._before is None:
            return
        after = self._full_weights(trainer, pl_module)
        layers: dict[str, list[float]] = {}
        for n, w in self._before.items():
            row = layers.setdefault(layer_of(n), [0.0, 0.0, 0.0, 0.0])
            row[0] += self._grads.get(n, 0.0)
            row[1] += float(w.pow(2).sum())
            row[2] += float((after[n] - w).pow(2).sum())
            row[3] += w.numel()
        self._before = None
        if trainer.global_rank == 0:
            self.record[str(step)] = layers
            Path(trainer.default_root_dir, "layer_witness.json").write_text(json.dumps(self.record))
