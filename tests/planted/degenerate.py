"""Runs that go wrong, planted, for the matrix of runs the checks must survive (tests/helpers/matrix.py).

Each is a plain Lightning callback on the project's LightningModule (src/models/lm_module.py), named in a
config: ``+callbacks.plant._target_=tests.planted.degenerate.LossAt +callbacks.plant.kind=nan
+callbacks.plant.step=0``.

- ``LossAt(kind, step, rank=None, every=False, through="add")``: the training loss of ``step`` (from ``step``
  on with ``every``) on ``rank`` (None: every rank) is NaN, +Inf, or exactly 0 (``zero``: ``loss * 0``, so every
  gradient is 0 as well); NaN/Inf added (``add``: the gradients stay finite, as for a non-finite term that
  does not depend on the weights) or multiplied in (``times``: every gradient non-finite too). Wraps ``_losses``, which the training step and nan_triage's rerun both call.
- ``NaNInBatch(step, rank)``: the input embeddings of one rank's batch are NaN at ``step`` (a corrupt
  float feature on one rank only; token ids themselves cannot hold a NaN).
- ``AllLabelsIgnored``: every label of every training batch is -100 (nothing to learn from: the mean over
  zero counted tokens is 0/0).
- ``FreezeAll(keep=None)``: every parameter (but those matching ``keep``) has ``requires_grad=False`` before
  the optimizer is built.
- ``ShrinkWeights(match, factor)``: a weight 'decay' written by hand after every step (``p.mul_(factor)`` on the
  weight matrices whose name holds ``match``), outside the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback


class LossAt(Callback):
    def __init__(self, kind: str, step: int = 0, rank: int | None = None, every: bool = False,
                 through: str = "add") -> None:
        assert kind in ("nan", "inf", "zero"), kind  # quote nan/inf on the command line: 'nan' (else a float)
        assert through in ("add", "times"), through
        self.kind, self.step, self.rank, self.every, self.through = kind, int(step), rank, bool(every), through

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        losses = pl_module._losses

        def planted(batch: Any, training: bool = False) -> Any:
            loss, moe = losses(batch, training=training)
            step = trainer.global_step
            due = step >= self.step if self.every else step == self.step
            if training and due and self.rank in (None, trainer.global_rank):
                if self.kind == "zero":
                    loss = loss * 0.0
                else:
                    bad = float("nan" if self.kind == "nan" else "inf")
                    loss = loss * bad if self.through == "times" else loss + bad  # times: the gradients too
            return loss, moe

        pl_module._losses = planted


class NaNInBatch(Callback):
    def __init__(self, step: int = 1, rank: int = 1) -> None:
        self.step, self.rank = int(step), int(rank)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        net = getattr(pl_module, "net", pl_module)
        emb = net.get_input_embeddings() if hasattr(net, "get_input_embeddings") else None
        if emb is None:
            emb = next(m for m in net.modules() if isinstance(m, torch.nn.Embedding))

        def poison(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
            due = trainer.training and trainer.global_step == self.step and trainer.global_rank == self.rank
            return output * float("nan") if due else output

        emb.register_forward_hook(poison)


class AllLabelsIgnored(Callback):
    """In the data module's batch transfer hook, before any callback or the model sees the batch (as a
    collate or a label mask would do it): the checks that replay a step see the same batch as the step."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        dm = trainer.datamodule
        before = dm.on_before_batch_transfer

        def planted(batch: Any, dataloader_idx: int) -> Any:
            batch = before(batch, dataloader_idx)
            if trainer.training and isinstance(batch, dict):
                batch["labels"] = torch.full_like(batch["input_ids"], -100)
            return batch

        dm.on_before_batch_transfer = planted


class FreezeAll(Callback):
    def __init__(self, keep: str | None = None) -> None:
        self.keep = keep  # a regex: parameters whose name matches stay trainable (keep=bias$: BitFit)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        import re

        for name, p in pl_module.named_parameters():
            p.requires_grad_(bool(self.keep and re.search(self.keep, name)))


class EvalAt(Callback):
    """A sample printer that calls ``pl_module.eval()`` after the update that makes ``global_step == step`` and never
    ``train()``: every later training step runs in eval mode (dropout off, norms on running statistics)."""

    def __init__(self, step: int = 1) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            pl_module.eval()


class WeightOutsideOptimizer(Callback):
    """A weight made on the net's first forward, after the optimizer was built, and kept as a plain tensor attribute
    with ``requires_grad`` (not registered): a per-vocabulary logit scale ``net.logit_scale``. It is used in every
    forward and gets a gradient; no optimizer holds it. (Registered with ``register_parameter`` instead, ZeRO-3
    crashes at the next forward -- ``'Parameter' object has no attribute 'ds_status'`` -- and the checkpoint holds a
    key a resumed model lacks: ``LateRegisteredParameter`` below, and the plain-Lightning form in
    tests/callbacks/test_cb_optimizer_coverage.py.)"""

    @staticmethod
    def make_scale(module: Any, logits: torch.Tensor) -> None:
        """The weight, made on the first forward: a plain tensor attribute that requires grad."""
        module.logit_scale = torch.ones(logits.shape[-1], device=logits.device, dtype=logits.dtype,
                                        requires_grad=True)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        net = pl_module.net

        def hook(module: Any, args: Any, out: Any) -> Any:
            logits = out.logits if hasattr(out, "logits") else out
            if getattr(module, "logit_scale", None) is None:
                self.make_scale(module, logits)
            scaled = logits * module.logit_scale
            if hasattr(out, "logits"):
                out.logits = scaled
                return out
            return scaled

        net.register_forward_hook(hook)


class ShrinkWeights(Callback):
    """A hand-written weight 'decay' after every optimizer step that forgot the LR: each weight matrix whose name
    contains ``match`` is multiplied by ``factor`` in place (``p.data.mul_``), outside the optimizer. Under plain
    DDP the optimizer's weights are these; under ZeRO the engine's fp32 master copy overwrites them at the next step
    (so the plant is a DDP one)."""

    def __init__(self, match: str = "", factor: float = 0.8) -> None:
        self.match, self.factor = match, factor

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if self.match in name and p.ndim >= 2:
                    p.mul_(self.factor)


class LateRegisteredParameter(WeightOutsideOptimizer):
    """The same per-vocabulary logit scale as ``WeightOutsideOptimizer``, registered (``register_parameter``) on the
    net's first forward, after the optimizer and DeepSpeed's engine were built. ZeRO-3 never partitioned it: its
    next forward fails inside DeepSpeed (``'Parameter' object has no attribute 'ds_status'``)."""

    @staticmethod
    def make_scale(module: Any, logits: torch.Tensor) -> None:
        module.register_parameter("logit_scale", torch.nn.Parameter(
            torch.ones(logits.shape[-1], device=logits.device, dtype=logits.dtype)))
