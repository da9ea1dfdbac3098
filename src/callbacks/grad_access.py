"""Parameter names and local gradients, shared by the gradient checks (grad_monitor, loss_spike,
layer_health, nan_triage, mixed_precision, replica_parity, freeze_verify): display names, layer
grouping, where a strategy keeps a rank's gradient (DDP .grad, DeepSpeed ZeRO partitions), and
the accumulation boundary; and the vocabulary of a causal LM (an untrained model's loss is ~ln(vocab):
the prior of loss_spike and outcome_monitor). Re-exported from grad_monitor, where they used to live."""

from __future__ import annotations

import re
from typing import Any

import torch

_NUMBERED = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3.mlp.x" -> "model.layers.3"


def display_name(name: str) -> str:
    """Parameter names as the user's net spells them (without the LightningModule's ``net.``)."""
    return name[4:] if name.startswith("net.") else name


def layer_of(name: str) -> str:
    """The block a parameter belongs to: ``model.layers.3`` if numbered, else its module."""
    m = _NUMBERED.match(name)
    return m.group(1) if m else (name.rsplit(".", 1)[0] if "." in name else name)


def grad_source(strategy: Any) -> str:
    """Where gradients live in on_before_optimizer_step: replicated | zero12 | zero3."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        stage = ((strategy.config or {}).get("zero_optimization") or {}).get("stage", 0)
        return "zero3" if stage == 3 else "zero12" if stage in (1, 2) else "replicated"
    return "replicated"


def local_grad(p: torch.Tensor, source: str) -> torch.Tensor | None:
    """This rank's part of p's (already reduced) gradient. Local: no collective."""
    if source == "zero3":
        from deepspeed.utils import safe_get_local_grad

        return safe_get_local_grad(p) if p.requires_grad else None
    if source == "zero12":
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            return None  # this rank owns no fragment of p
        frag = mapping.get_lp_grad_fragment(p._index_in_param_group)
        addr = mapping.lp_fragment_address
        if frag.numel() == p.numel() and addr.numel != p.numel():  # BF16_Optimizer: full buffer
            frag = frag.reshape(-1).narrow(0, addr.start, addr.numel)
        return frag
    return p.grad


def local_param(p: torch.Tensor) -> torch.Tensor:
    return p.ds_tensor if hasattr(p, "ds_tensor") else p.data  # ZeRO-3: this rank's partition


def _at_accumulation_boundary(trainer: Any) -> bool:
    """DeepSpeed calls on_before_optimizer_step per micro-batch; the gradients are complete at the boundary."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not isinstance(trainer.strategy, DeepSpeedStrategy):
        return True  # Lightning calls the hook only at the boundary
    return trainer.strategy.deepspeed_engine.is_gradient_accumulation_boundary()


def step_loss(pl_module: Any, outputs: Any) -> Any:
    """This step's training loss as a tensor where it lives (no host read): the LM module's logged
    ``train/loss`` (``last_train_loss``), else what ``training_step`` returned (a plain Lightning module); None
    when neither is there. Not ``trainer.callback_metrics``: reading it makes Lightning copy every
    progress-bar metric to the host (a device sync on a GPU) at each access."""
    loss = getattr(pl_module, "last_train_loss", None)
    if loss is None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss.detach() if hasattr(loss, "detach") else None


def untrained_vocab(trainer: Any, pl_module: Any) -> int | None:
    """The vocabulary of a causal LM whose loss is the mean token cross-entropy (an untrained model's is
    ~ln(vocab)): the net's output embedding size, else the datamodule's ``vocab_size``; None for other
    modules (their loss has no prior here)."""
    if not hasattr(pl_module, "net") or not hasattr(pl_module, "_losses"):
        return None
    net = pl_module.net
    out = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None
    size = getattr(out, "out_features", None) or getattr(out, "num_embeddings", None)
    return int(size or getattr(getattr(trainer, "datamodule", None), "vocab_size", 0) or 0) or None
