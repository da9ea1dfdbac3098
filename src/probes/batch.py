"""What the probes need from a batch and a causal LM: the next-token loss the run computes
(position t predicts labels[t+1], ``-100`` ignored: ``CausalLMModule._losses``), tokens that
differ from given ones, and where a tensor of a trace holds batch rows and positions.

Local: no collective."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dsdebug.probes.tracing import logits_of

__all__ = ["as_batch", "lm_loss", "net_logits", "other_tokens", "rows_positions", "vocab_of"]


def net_logits(net: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return logits_of(net(input_ids=input_ids))


def lm_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy as the run computes it (labels shifted by one, -100 ignored)."""
    labels = batch.get("labels", batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def other_tokens(ids: torch.Tensor, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Tokens that each differ from ``ids`` (same shape), drawn from [0, vocab)."""
    shift = torch.randint(1, max(2, vocab), ids.shape, generator=generator)
    return (ids + shift.to(ids.device)) % vocab


def rows_positions(t: torch.Tensor, batch: int, seq: int) -> torch.Tensor | None:
    """``t`` as [batch, seq, ...] when its leading dims are (batch, seq) or (batch*seq) flattened
    tokens (MoE experts), else None (a shape the probes cannot place: not compared)."""
    if t.dim() >= 2 and t.shape[0] == batch and t.shape[1] == seq:
        return t
    if t.dim() >= 1 and t.shape[0] == batch * seq and (batch > 1 or seq > 1):
        return t.reshape(batch, seq, *t.shape[1:])
    return None


def vocab_of(net: torch.nn.Module, logits: torch.Tensor | None = None) -> int:
    emb = getattr(net, "get_input_embeddings", lambda: None)()
    if emb is not None and hasattr(emb, "num_embeddings"):
        return int(emb.num_embeddings)
    if logits is not None:
        return int(logits.shape[-1])
    raise ValueError("cannot tell the vocabulary size: give vocab=")


def as_batch(batch: Any) -> dict[str, torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch, "labels": batch}
    return dict(batch)
