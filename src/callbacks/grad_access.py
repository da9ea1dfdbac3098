"""Parameter names and local gradients, shared by the gradient checks (grad_monitor, loss_spike,
layer_health, nan_triage, mixed_precision, replica_parity, freeze_verify): display names, layer
grouping, where a strategy keeps a rank's gradient (DDP .grad, DeepSpeed ZeRO partitions), and
the accumulation boundary; and the vocabulary of a causal LM (an untrained model's loss is ~ln(vocab):
the prior of loss_spike and outcome_monitor). Re-exported from grad_monitor, where they used to live."""

from __future__ import annotations

import functools
import numbers
import re
from typing import Any

import torch

__all__ = ["base_optimizer", "decay_coupled", "display_name", "grad_source", "host_float", "layer_of", "local_grad",
           "local_param", "on_device", "optimizer_param_groups", "optimizer_param_lrs", "run_clip", "step_loss", "sumsq_per_tensor",
           "unpadded", "untrained_vocab"]

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
    progress-bar metric to the host (a device sync on a GPU) at each access. Under automatic optimization
    Lightning hands the callbacks the returned loss divided by ``accumulate_grad_batches`` (what backward
    took): multiplied back, so a loss under accumulation reads as the same loss without."""
    loss = getattr(pl_module, "last_train_loss", None)
    if loss is not None:
        return loss.detach() if hasattr(loss, "detach") else None
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not hasattr(loss, "detach"):
        return None
    trainer = getattr(pl_module, "_trainer", None)
    k = getattr(trainer, "accumulate_grad_batches", 1) or 1
    if k > 1 and getattr(pl_module, "automatic_optimization", True):
        return loss.detach() * k
    return loss.detach()


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


def sumsq_per_tensor(tensors: list[torch.Tensor | None], scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Per tensor, the sum of squares of tensor / ``scale`` (fp16: the loss scale gradients carry; 0 for a
    missing or empty one), float64, where the tensors live: one fused pass (fp32 accumulation), no host read
    and no host-to-device copy in the common case (a missing tensor's index is cached per device)."""
    present = [i for i, t in enumerate(tensors) if t is not None and t.numel() > 0]
    if not present:
        return torch.zeros(len(tensors), dtype=torch.float64)
    device = tensors[present[0]].device
    norms = torch._foreach_norm([tensors[i] for i in present], 2, dtype=torch.float32)
    scale = scale.to(device) if isinstance(scale, torch.Tensor) else scale
    sq = (torch.stack(norms).double() / scale) ** 2
    if len(present) == len(tensors):
        return sq
    out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    out[on_device(tuple(present), device)] = sq
    return out


@functools.lru_cache(maxsize=256)
def on_device(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``, made once (a host-to-device copy waits for the device's stream:
    a per-step sync otherwise). Never write to it."""
    return torch.tensor(values, dtype=torch.long, device=device)


def optimizer_param_groups(trainer: Any) -> dict[int, dict] | None:
    """id(param) -> the optimizer param group holding it (its ``lr``, ``weight_decay``, ...: a plain torch optimizer,
    DeepSpeed ZeRO-1/2/3 and BF16_Optimizer, whose ``param_groups`` are the base optimizer's); None when the mapping
    is unknown. Local: no collective."""
    if not trainer.optimizers:
        return None
    opt = trainer.optimizers[0]
    groups = getattr(opt, "param_groups", None) or []
    for attr in ("bit16_groups", "bf16_groups"):  # ZeRO-1/2, BF16_Optimizer: aligned with param_groups
        if isinstance(getattr(opt, attr, None), list):
            return {id(p): g for g, ps in zip(groups, getattr(opt, attr)) for p in ps}
    if hasattr(opt, "trainable_param_groups"):  # ZeRO-3
        return {id(p): groups[g["_ds_source_param_group_id"]]
                for g in opt.trainable_param_groups for p in g["params"]}
    if isinstance(getattr(opt, "fp16_groups", None), list):  # FP16_Optimizer (fp16 without ZeRO): aligned too
        return {id(p): g for g, ps in zip(groups, opt.fp16_groups) for p in ps}
    if isinstance(opt, torch.optim.Optimizer) and all(isinstance(p, torch.nn.Parameter) or torch.is_tensor(p)
                                                      for g in groups for p in g["params"]):
        return {id(p): g for g in groups for p in g["params"]}
    return None


def host_float(value: Any) -> float | None:
    """An optimizer group's lr / weight_decay / eps as a float without a device read (a CUDA tensor lr: None)."""
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1:
        return float(value)
    return None


def optimizer_param_lrs(trainer: Any) -> dict[int, float] | None:
    """id(param) -> lr of the optimizer group holding it (``optimizer_param_groups``); None when unknown."""
    groups = optimizer_param_groups(trainer)
    return None if groups is None else {k: g["lr"] for k, g in groups.items()}


def base_optimizer(optimizer: Any) -> Any:
    """The optimizer that does the update under DeepSpeed's wrappers (ZeRO, BF16_Optimizer, FP16_Optimizer hold it
    as ``.optimizer``); a torch optimizer is its own."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) and getattr(optimizer, "optimizer", None) is not None \
            and seen < 4:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


# adaptive optimizers whose weight_decay is an L2 term added to the gradient before the update normalises it
_COUPLED_L2 = ("Adam", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop")


def decay_coupled(optimizer: Any, group: dict) -> bool:
    """Whether ``group``'s weight_decay is L2 coupled to an adaptive update (``torch.optim.Adam(weight_decay=...)``,
    DeepSpeed's FusedAdam / DeepSpeedCPUAdam with ``adam_w_mode=False``): the decay term is normalised with the
    gradient, so each weight moves toward 0 by up to ``lr`` per step whatever its size. False for AdamW-style
    (decoupled: ``w *= 1 - lr * wd``) and for SGD (coupled, not normalised: the same shrink)."""
    if not group.get("weight_decay") or group.get("decoupled_weight_decay"):
        return False
    base = base_optimizer(optimizer)
    for attr in ("adam_w_mode", "adamw_mode"):  # DeepSpeed's FusedAdam, DeepSpeedCPUAdam
        if hasattr(base, attr):
            return not getattr(base, attr)
    return type(base).__name__ in _COUPLED_L2


def unpadded(t: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor | None:
    """ZeRO-3 partitions are padded (ds_tensor's tail is uninitialised memory): this rank's real part of ``t``
    (p's local gradient or weight partition); other tensors as they are."""
    if t is None or not hasattr(p, "ds_tensor"):
        return t
    import deepspeed.comm as dist

    part = p.ds_tensor.ds_numel
    start = part * (dist.get_rank(group=p.ds_process_group) if dist.is_initialized() else 0)
    return t.reshape(-1).narrow(0, 0, max(0, min(part, p.ds_numel - start, t.numel())))


def run_clip(trainer: Any) -> float | None:
    """The gradient-norm clip threshold the run applies: a DeepSpeed config's ``gradient_clipping`` (optim.grad_clip
    becomes it), else the Trainer's ``gradient_clip_val`` (norm clipping only); None without clipping."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy):
        value = (trainer.strategy.config or {}).get("gradient_clipping")
    else:
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").lower()
        value = getattr(trainer, "gradient_clip_val", None) if "norm" in algorithm else None
    try:
        return float(value) if value else None
    except (TypeError, ValueError):  # "auto" left unresolved: not a number to judge against
        return None
