"""Packing several documents into one sequence, each document on its own: positions restart at 0 and no
token attends across a document boundary.

Today's blocks (``blocks.py``) cut one token stream into fixed windows: a window holds the end of one
document and the start of the next, and every token attends to all earlier ones -- documents see each
other and positions run on. ``pack_documents`` builds sequences from whole documents instead (greedy
first fit, longest first; a document longer than ``seq_len`` is split into pieces that are documents of
their own) with, per token, ``position_ids`` (0 at each document start) and ``doc_ids`` (-1 = padding);
``labels`` are -100 on padding and on each document's first token, so no document is trained to predict
the next one's start. ``document_mask(doc_ids)`` is the boolean ``[B, 1, T, T]`` attention mask (causal
AND same document; a padding position sees itself only) that Hugging Face models take as a 4-D
``attention_mask`` together with ``position_ids``.

``cross_document_change`` is the probe: change one document's tokens, and measure how much the other
documents' logits move (0 when the documents are independent). Measured with transformers 5.23: the
DeepSeek nets already block attention across documents when given per-document ``position_ids``
alone (HF detects packed sequences from positions that restart); the explicit 4-D mask does the same
for a net that does not, and without either the probe moves the later documents' logits by ~10.

Not wired into ``LMDataModule`` / ``CausalLMModule`` yet: this is the packing itself and its
probe. Runs on one process; nothing here calls a collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pack_documents", "document_mask", "padding_fraction", "positions_not_reset", "cross_document_change"]


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Pack ``docs`` (token lists) into ``[N, seq_len]`` tensors: input_ids, labels, position_ids, doc_ids."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    pieces = [list(d[i:i + seq_len]) for d in docs if len(d) for i in range(0, len(d), seq_len)]
    bins: list[list[list[int]]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=len, reverse=True):  # first fit decreasing
        for b, free in enumerate(room):
            if len(piece) <= free:
                bins[b].append(piece)
                room[b] -= len(piece)
                break
        else:
            bins.append([piece])
            room.append(seq_len - len(piece))
    n = len(bins)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n, seq_len), -100, dtype=torch.long)
    position_ids = torch.zeros((n, seq_len), dtype=torch.long)
    doc_ids = torch.full((n, seq_len), -1, dtype=torch.long)
    for row, packed in enumerate(bins):
        at = 0
        for k, piece in enumerate(packed):
            span = slice(at, at + len(piece))
            input_ids[row, span] = torch.tensor(piece)
            labels[row, span] = torch.tensor(piece)
            labels[row, at] = -100  # the previous document's last token must not learn to predict this one
            position_ids[row, span] = torch.arange(len(piece))
            doc_ids[row, span] = k
            at += len(piece)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "doc_ids": doc_ids}


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


def padding_fraction(doc_ids: torch.Tensor) -> float:
    """Share of positions that are padding."""
    return float((doc_ids < 0).float().mean())


def positions_not_reset(position_ids: torch.Tensor, doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(row, document) pairs whose first token's position is not 0. Outputs cannot show this for RoPE
    models (attention depends on relative positions only), but the model then sees positions it would
    not see at inference for a document alone, and learned absolute positions differ outright."""
    bad = []
    for row in range(doc_ids.size(0)):
        for doc in doc_ids[row].unique().tolist():
            if doc >= 0:
                first = int((doc_ids[row] == doc).nonzero()[0])
                if int(position_ids[row, first]) != 0:
                    bad.append((row, doc))
    return bad


@torch.no_grad()
def cross_document_change(net: torch.nn.Module, batch: dict[str, torch.Tensor], row: int, doc: int,
                          use_mask: bool = True, reset_positions: bool = True, seed: int = 0) -> float:
    """Max |change| of the logits of every OTHER document in ``row`` when document ``doc``'s tokens are
    replaced by random ones. 0 = no attention across documents."""
    def logits(ids: torch.Tensor) -> torch.Tensor:
        kwargs = {}
        if use_mask:
            kwargs["attention_mask"] = document_mask(batch["doc_ids"][row:row + 1])
        if reset_positions:
            kwargs["position_ids"] = batch["position_ids"][row:row + 1]
        out = net(input_ids=ids, **kwargs)
        return (out.logits if hasattr(out, "logits") else out).float()

    ids = batch["input_ids"][row:row + 1]
    where = batch["doc_ids"][row] == doc
    changed = ids.clone()
    vocab = int(ids.max()) + 1
    g = torch.Generator().manual_seed(seed)
    changed[0, where] = (ids[0, where] + 1 + torch.randint(0, max(vocab - 1, 1), (int(where.sum()),), generator=g)) % vocab
    others = (batch["doc_ids"][row] != doc) & (batch["doc_ids"][row] >= 0)
    return float((logits(ids)[0, others] - logits(changed)[0, others]).abs().max())
