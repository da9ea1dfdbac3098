"""The attention mask of document rows (``data.packing``): causal AND same document, ``[B, 1, T, T]``
bool, the 4-D ``attention_mask`` Hugging Face models take as given (with ``position_ids`` restarting
per document). ``CausalLMModule`` builds it from a batch's ``doc_ids``; ``dsdebug.data.packing``
re-exports it next to the packing that makes ``doc_ids``."""

from __future__ import annotations

import torch

__all__ = ["document_mask"]


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: query t may attend key s iff s <= t and both are in the same document
    (padding attends to itself only, so no softmax row is empty)."""
    t = doc_ids.size(-1)
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    pad = doc_ids < 0
    eye = torch.eye(t, dtype=torch.bool, device=doc_ids.device)
    mask = (causal & same & ~pad[:, :, None]) | (pad[:, :, None] & eye)
    return mask[:, None]
