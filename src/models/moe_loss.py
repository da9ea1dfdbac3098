"""The MoE load-balancing loss and the expert load over the routers :class:`RouterCapture`
hooked (``moe_aux.py``; split from it). Scale: ``sum_i f_i * P_i`` averaged over MoE layers, 1.0
for uniform routing, up to ``num_experts / top_k`` when every token goes to the same experts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dsdebug.models.moe_aux import RouterRecord

if TYPE_CHECKING:
    from dsdebug.models.moe_aux import RouterCapture

__all__ = ["expert_load_fractions", "load_balancing_loss"]


def load_balancing_loss(
    captured: RouterCapture | Sequence[RouterRecord],
    num_experts: int,
    top_k: int,
    level: str = "batch",
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch/DeepSeek balance loss ``sum_i f_i * P_i``, averaged over MoE layers (scalar).

    ``f_i = E / (k * T) * #(tokens routed to expert i)`` (not differentiable) and
    ``P_i = mean_t p_{t,i}`` with ``p`` the per-token normalised router probabilities
    (softmax for V2, sigmoid/sum for V3), so gradients reach the router weights through
    ``P``. ``level="batch"`` pools all T tokens; ``level="sequence"`` computes it per
    sequence and averages (DeepSeek-V3's sequence-wise variant). ``attention_mask`` [B, S]
    (1 = real token) excludes padding. 1.0 for uniform routing; up to E/k when collapsed.
    """
    records = _records(captured)
    losses = []
    for rec in records:
        _check_shapes(rec, num_experts, top_k)
        probs, chosen, weight = _per_token(rec, num_experts, level, attention_mask)
        tokens = weight.sum(dim=-1, keepdim=True).clamp_min(1.0)  # [G, 1]
        f = num_experts / top_k * (chosen * weight.unsqueeze(-1)).sum(dim=-2) / tokens  # [G, E]
        p = (probs * weight.unsqueeze(-1)).sum(dim=-2) / tokens  # [G, E]
        per_group = (f * p).sum(dim=-1)  # [G]
        has_tokens = (weight.sum(dim=-1) > 0).float()
        losses.append((per_group * has_tokens).sum() / has_tokens.sum().clamp_min(1.0))
    return torch.stack(losses).mean()


@torch.no_grad()
def expert_load_fractions(
    captured: RouterCapture | Sequence[RouterRecord],
    num_experts: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fraction of token-slots each expert received, ``[num_moe_layers, E]`` (rows sum to 1).

    Uniform routing gives ``1/E`` everywhere; rows are in layer order (see record.name).
    """
    rows = []
    for rec in _records(captured):
        _, chosen, weight = _per_token(rec, num_experts, "batch", attention_mask)
        counts = (chosen * weight.unsqueeze(-1)).sum(dim=(0, 1))
        rows.append(counts / counts.sum().clamp_min(1.0))
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------


def _records(captured: RouterCapture | Sequence[RouterRecord]) -> list[RouterRecord]:
    records = list(getattr(captured, "records", captured))  # a RouterCapture or its records
    if not records:
        raise ValueError(
            "no router outputs captured: attach RouterCapture to the model and run its forward "
            "before computing the balance loss"
        )
    return records


def _check_shapes(rec: RouterRecord, num_experts: int, top_k: int) -> None:
    if rec.logits.shape[-1] != num_experts or rec.topk_indices.shape[-1] != top_k:
        raise ValueError(
            f"{rec.name}: router gives {rec.logits.shape[-1]} experts / top-"
            f"{rec.topk_indices.shape[-1]}, but num_experts={num_experts}, top_k={top_k}"
        )


def _per_token(
    rec: RouterRecord, num_experts: int, level: str, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """probs [G, N, E], chosen one-hot-sum [G, N, E], token weight [G, N]; G groups of N tokens."""
    if level not in ("batch", "sequence"):
        raise ValueError(f"level={level!r}; valid: 'batch', 'sequence'")
    probs = rec.probs()
    tokens = probs.shape[0]
    chosen = torch.zeros_like(probs, dtype=torch.float32).scatter_(
        1, rec.topk_indices.to(probs.device), 1.0
    )
    weight = (
        torch.ones(tokens, device=probs.device)
        if attention_mask is None
        else attention_mask.reshape(-1).to(device=probs.device, dtype=torch.float32)
    )
    if weight.numel() != tokens:
        raise ValueError(f"{rec.name}: attention_mask has {weight.numel()} tokens, router saw {tokens}")
    groups = 1
    if level == "sequence":
        if len(rec.batch_shape) != 2:
            raise ValueError(f"{rec.name}: level='sequence' needs [B, S] inputs, got {rec.batch_shape}")
        groups = rec.batch_shape[0]
    shape = (groups, tokens // groups)
    return (
        probs.reshape(*shape, num_experts),
        chosen.reshape(*shape, num_experts),
        weight.reshape(shape),
    )
