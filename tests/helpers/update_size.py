"""A callback for tests: the size of each optimizer update (L2 norm of the weights' change over the step)
and the module's token LR scale, written to a JSON file after every step (1 process; replicated weights)."""

from __future__ import annotations

import json

from lightning.pytorch import Callback


class UpdateSize(Callback):
    def __init__(self, out: str) -> None:
        self.out, self.rows, self.before = out, [], {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        delta = sum(float((p.detach() - self.before[n]).pow(2).sum()) for n, p in pl_module.named_parameters())
        self.rows.append({"step": trainer.global_step - 1, "update": delta ** 0.5,
                          "lr_scale": getattr(pl_module, "last_lr_scale", None)})
        with open(self.out, "w") as f:
            json.dump(self.rows, f)
