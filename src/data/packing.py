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

Wired by ``data.packing=true`` (``LMDataModule`` splits the token cache into documents at EOS and
serves these rows; ``CausalLMModule`` passes ``position_ids`` and the mask) and checked by the
``packing`` callback (``src/callbacks/packing.py``), which runs the probe through the module's own path. Runs on one process; nothing here calls a collective.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np
import torch

from dsdebug.models.document_mask import document_mask  # the nets' input, kept with the models

__all__ = ["split_documents", "pack_documents", "one_document_per_row", "document_mask", "padding_fraction",
           "positions_not_reset", "cross_document_change"]


def split_documents(tokens: Sequence[int], eos_id: int | None) -> list[list[int]]:
    """A token stream whose documents each end in ``eos_id`` (how the token cache stores them) -> the
    documents, each with its EOS (the model learns to end a document). No ``eos_id``: one document."""
    ids = np.asarray(tokens)
    if eos_id is None:
        return [ids.tolist()] if len(ids) else []
    ends = np.flatnonzero(ids == eos_id) + 1
    return [d.tolist() for d in np.split(ids, ends) if len(d)]


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Pack ``docs`` (token lists) into ``[N, seq_len]`` tensors: input_ids, labels, position_ids, doc_ids."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    pieces = [list(d[i:i + seq_len]) for d in docs if len(d) for i in range(0, len(d), seq_len)]
    bins: list[list[list[int]]] = []
    # first fit decreasing: a piece goes into the lowest-numbered bin with room for it. Bins are kept
    # by free room (a min-heap of bin numbers per room value), so a piece looks at <= seq_len heaps
    # instead of every bin (the whole KJV in about a second instead of minutes: docs/benchmarks.md).
    by_room: list[list[int]] = [[] for _ in range(seq_len + 1)]
    for piece in sorted(pieces, key=len, reverse=True):
        need = len(piece)
        fits = [(heap[0], free) for free, heap in enumerate(by_room[need:], start=need) if heap]
        if fits:
            b, free = min(fits)
            heapq.heappop(by_room[free])
            bins[b].append(piece)
        else:
            b, free = len(bins), seq_len
            bins.append([piece])
        heapq.heappush(by_room[free - need], b)
    return _rows(bins, seq_len, pad_id)


def one_document_per_row(docs: Sequence[Sequence[int]], seq_len: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Every document (pieces of at most ``seq_len``) in a row of its own, padded at the end: the rows a
    token-budget batch groups by length when documents are not packed. Same tensors as ``pack_documents``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    pieces = [list(d[i:i + seq_len]) for d in docs if len(d) for i in range(0, len(d), seq_len)]
    return _rows([[piece] for piece in pieces], seq_len, pad_id)


def _rows(bins: Sequence[Sequence[Sequence[int]]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row per bin, its documents one after the other, padded at the end: input_ids, labels (-100 on
    padding and on each document's first token), position_ids (0 at each document start), doc_ids (-1 =
    padding)."""
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
                          use_mask: bool = True, reset_positions: bool = True, seed: int = 0,
                          forward: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None,
                          vocab_size: int | None = None, per_document: bool = False) -> float | dict[int, float]:
    """Max |change| of the logits of every OTHER document in ``row`` when document ``doc``'s tokens are
    replaced by random ones. 0 = no attention across documents. ``forward`` (a one-row batch -> logits)
    replaces the net call: the packing check passes the training module's own path, so a module that
    drops the mask is caught too. Two forwards, always (under ZeRO-3 a forward is a collective).
    ``per_document``: {other document: its max |change|} instead of the max."""
    def logits(ids: torch.Tensor) -> torch.Tensor:
        if forward is not None:
            one = {k: v[row:row + 1] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            out = forward({**one, "input_ids": ids})
        else:
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
    vocab = vocab_size or int(ids.max()) + 1
    g = torch.Generator().manual_seed(seed)
    shift = 1 + torch.randint(0, max(vocab - 1, 1), (int(where.sum()),), generator=g).to(ids.device)
    changed[0, where] = (ids[0, where] + shift) % vocab
    others = (batch["doc_ids"][row] != doc) & (batch["doc_ids"][row] >= 0)
    change = (logits(ids)[0] - logits(changed)[0]).abs().amax(dim=-1)  # the same two forwards on every rank
    if per_document:
        docs = batch["doc_ids"][row]
        return {d: float(change[docs == d].max()) for d in docs[others].unique().tolist()}
    return float(change[others].max()) if bool(others.any()) else 0.0
