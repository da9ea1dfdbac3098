"""What one training batch holds, against the run's other batches: a batch unlike them is corrupt data.

A bad shard does not announce itself. A zero-filled file (or one of padding only) gives batches of one
token; the bytes of a binary file, a wrong tokenizer or an id offset give uniform random ids. A model
that has barely learnt has nearly the same loss on them as on text, so a loss-based rule cannot tell
them from noise in the first steps. Their token statistics can, from the first batches on:

- ``distinct``: distinct token ids / counted tokens (labels != -100). Text repeats its frequent tokens:
  a KJV batch of 1,024 tokens has ~25-40 % distinct ids; uniform random ids over a 4,096 vocabulary have
  ~88 %;
- ``top``: the share of the most frequent token (text: a few %; a zero-filled batch: 100 %);
- no counted token at all (every label -100: a padding-only batch) is named without history.

A batch is judged against the median of the batches before it on this rank (at least ``min_history``):
``distinct`` >= ``ratio`` x the median and + ``margin`` -> random-looking ids (judged only when the batch
counts 0.5-2x the median number of tokens: the distinct share of text falls as a batch grows, 55 % of 128
KJV tokens vs 22 % of 2,048, so a short batch among long ones is no evidence); ``top`` >= ``top_share``
while the median is below half of it -> one token fills the batch. Random-token data (``data=synthetic``)
is judged against its own batches, so it does not fire. Rank-local, no collective; the statistics are
computed where the batch lives (a fixed-size count over the vocabulary, the labels as weights: no boolean
indexing, which syncs), kept there, and read ``read_every`` batches at a time (one host read of
``[N x 3]`` numbers): each batch is judged in order with its own step, so a bad batch is named up to
N - 1 steps after it trained, at the step it trained.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

__all__ = ["BatchContent"]


class BatchContent:
    def __init__(self, min_history: int = 2, ratio: float = 1.8, margin: float = 0.2, top_share: float = 0.9,
                 history: int = 64, read_every: int = 10) -> None:
        self.min_history, self.ratio, self.margin, self.top_share = min_history, ratio, margin, top_share
        self.history, self.read_every = history, read_every
        self.distinct: list[float] = []
        self.top: list[float] = []
        self.counted: list[int] = []
        self._queued: list[tuple[torch.Tensor, int, int]] = []  # ([distinct, top, n] on the device, step, index)
        self.vocab: int | None = None

    def measure(self, ids: torch.Tensor, labels: torch.Tensor | None, step: int, index: int) -> list[dict]:
        """Queue this batch's statistics (computed where it lives, no sync); every ``read_every`` batches,
        read the queue at once and judge each batch in order."""
        flat = ids.reshape(-1).long()
        if labels is not None and labels.shape == ids.shape:  # counted tokens as weights: no boolean indexing
            weights = (labels.reshape(-1) != -100).to(torch.float32)
        else:
            weights = torch.ones_like(flat, dtype=torch.float32)
        if self.vocab is None:
            self.vocab = int(ids.max()) + 1 if ids.numel() else 1  # one host read, at the first batch
        vocab = max(self.vocab, 1)
        counts = torch.zeros(vocab, device=flat.device, dtype=torch.float32)
        counts.index_add_(0, flat.clamp(0, vocab - 1), weights)
        n = counts.sum()
        self._queued.append((torch.stack([(counts > 0).sum().float(), counts.max(), n]), step, index))
        return self.flush() if len(self._queued) >= self.read_every else []

    def flush(self) -> list[dict]:
        """Judge the queued batches in order (one host read of [N x 3] numbers)."""
        if not self._queued:
            return []
        queued, self._queued = self._queued, []
        rows = torch.stack([s for s, _, _ in queued]).cpu().tolist()
        found: list[dict] = []
        for (distinct, top, n), (_, step, index) in zip(rows, queued):
            found += self._judge_one(distinct, top, n, step, index)
        return found

    def _judge_one(self, distinct: float, top: float, n: float, step: int, index: int) -> list[dict]:
        if n == 0:
            return [{"step": step, "batch_index": index, "counted_tokens": 0, "kind": "no_tokens"}]
        if n < 16:  # too few counted tokens to say anything
            return []
        d, t = distinct / n, top / n
        found = self.judge(d, t, step, index, int(n))
        self.distinct = (self.distinct + [d])[-self.history:]
        self.top = (self.top + [t])[-self.history:]
        self.counted = (self.counted + [int(n)])[-self.history:]
        return found

    def judge(self, d: float, t: float, step: int, index: int, n: int) -> list[dict]:
        if len(self.distinct) < self.min_history:
            return []
        med_d, med_t = statistics.median(self.distinct), statistics.median(self.top)
        base = {"step": step, "batch_index": index, "counted_tokens": n, "distinct": round(d, 4),
                "top_share": round(t, 4), "median_distinct": round(med_d, 4), "median_top_share": round(med_t, 4)}
        if t >= self.top_share and med_t < self.top_share / 2:
            return [{**base, "kind": "one_token"}]
        comparable = self.counted and 0.5 <= n / max(statistics.median(self.counted), 1) <= 2.0
        if comparable and d >= self.ratio * med_d and d >= med_d + self.margin:
            return [{**base, "kind": "random_ids"}]
        return []

    def describe(self, f: dict[str, Any]) -> tuple[str, str]:
        """(message, advice) of a finding ``judge`` returned."""
        if f["kind"] == "no_tokens":
            return ("no token of the batch counts in the loss (every label is -100): a padding-only batch, or a "
                    "label mask that hides everything", "find the samples behind this batch; check the label masking "
                    "(-100) and the padding of the data pipeline")
        if f["kind"] == "one_token":
            return (f"one token fills {f['top_share']:.0%} of the batch's {f['counted_tokens']} counted tokens (the "
                    f"run's batches so far: median {f['median_top_share']:.0%}): a zero-filled or padding-only shard",
                    "find the sample/shard behind this batch (data_inspector/first_batch shows how batches are built; "
                    "debug=data saves them); check the files for zero-filled or truncated ones")
        return (f"{f['distinct']:.0%} of the batch's {f['counted_tokens']} counted tokens are distinct ids, "
                f"{f['distinct'] / max(f['median_distinct'], 1e-9):.1f}x the run's median ({f['median_distinct']:.0%}): "
                "random-looking ids, not text (a binary file read as tokens, another tokenizer's ids, an id offset)",
                "find the shard behind this batch; decode it (the tokenizer's decode) and look; check the tokenizer "
                "the data was prepared with")
