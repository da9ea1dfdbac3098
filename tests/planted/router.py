"""Planted router bugs for the moe_router tests.

``RouterBias``: from ``step`` on, expert ``expert`` of decoder layer ``layer`` gets ``bias`` added
to its routing score on every rank -- +10 makes every token choose it (router collapse), -1e4
starves it (dead expert). DeepSeek-V3 routers get it where V3 keeps such a bias, in the
``e_score_correction_bias`` buffer (a sign bug in its update is a real way to collapse); other
routers (Mixtral/Qwen-MoE/OLMoE: softmax then top-k) get it on their logits through a forward
hook that re-does their top-k. Used from the command line, e.g.
``+callbacks.planted._target_=tests.planted.router.RouterBias +callbacks.planted.layer=1
+callbacks.planted.expert=0 +callbacks.planted.step=3``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback

from dsdebug.models.moe_aux import find_routers


class RouterBias(Callback):
    def __init__(self, layer: int, expert: int, step: int, bias: float = 10.0) -> None:
        self.layer, self.expert, self.step, self.bias = layer, expert, step, float(bias)
        self._applied = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        routers = {n: m for n, m in find_routers(pl_module.net).items() if f"layers.{self.layer}." in n + "."}
        assert routers, f"no router in decoder layer {self.layer}"
        self.router = next(iter(routers.values()))
        if not hasattr(self.router, "e_score_correction_bias"):
            self.router.register_forward_hook(self._bias_logits, prepend=True)  # before the capture sees it

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if hasattr(self.router, "e_score_correction_bias") and trainer.global_step >= self.step and not self._applied:
            self._applied = True
            with torch.no_grad():
                self.router.e_score_correction_bias[self.expert] += self.bias

    def _bias_logits(self, module: Any, args: Any, output: Any) -> Any:
        if not module.training or self.trainer.global_step < self.step:
            return output
        logits = output[0].clone()
        logits[:, self.expert] += self.bias
        top = logits.float().softmax(-1).topk(module.top_k, dim=-1)
        scores = top.values
        if getattr(module, "norm_topk_prob", True):
            scores = scores / scores.sum(-1, keepdim=True)
        return logits, scores.to(output[1].dtype), top.indices
