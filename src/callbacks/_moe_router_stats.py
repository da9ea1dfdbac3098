"""MoERouter's statistics, pure tensor math: per-expert token counts and router entropy from the
recorded routing, and a window's load balance / dead experts / collapse numbers."""

from __future__ import annotations

import math
import torch

from dsdebug.models.moe_aux import normalised_probs


@torch.no_grad()
def record_stats(records: list, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward's token-slot counts ``[L, E]``, summed per-token router entropy ``[L]`` and tokens ``[L]``.
    Batched over layers (one bincount, one entropy): ~1 ms for 3 layers x 1024 tokens on CPU."""
    if len({(r.logits.shape, r.topk_indices.shape, r.score_func) for r in records}) > 1:  # layers differ
        parts = [record_stats([r], num_experts) for r in records]
        return tuple(torch.cat(t) for t in zip(*parts))  # type: ignore[return-value]
    n = len(records)
    idx = torch.stack([r.topk_indices.reshape(-1) for r in records]).cpu()
    idx = idx + torch.arange(n).unsqueeze(1) * num_experts
    counts = torch.bincount(idx.reshape(-1), minlength=n * num_experts).reshape(n, num_experts).double()
    probs = normalised_probs(torch.stack([r.logits.detach() for r in records]), records[0].score_func)
    entropy = torch.special.entr(probs).sum(-1).sum(-1).double().cpu()
    return counts, entropy, torch.full((n,), float(probs.shape[1]), dtype=torch.float64)


def window_stats(counts: torch.Tensor, ent_sum: torch.Tensor, tokens: torch.Tensor, top_k: int) -> dict:
    """Per-layer statistics of one (all-reduced) window; tensors of length L unless noted."""
    experts = counts.shape[-1]
    share = counts / counts.sum(-1, keepdim=True).clamp_min(1.0)  # [L, E], rows sum to 1
    h = -(share * share.clamp_min(1e-30).log()).sum(-1)
    span = math.log(experts) - math.log(top_k)
    return {"share": share, "token_frac": share * top_k, "max_share": share.max(-1).values,
            "imbalance": share.max(-1).values * experts,
            "load_entropy": (h - math.log(top_k)) / span if span > 0 else torch.ones_like(h),
            "entropy": ent_sum / tokens.clamp_min(1.0) / math.log(max(experts, 2)), "tokens": tokens}
