"""Batch and dataset fingerprints for `DataInspector`: any dtype, computed without a host sync.

- ``input_ids_of``: the batch's main tensor (``input_ids`` of a dict, the first tensor of a tuple).
- ``is_token_data``: integer samples (token ids); the n-gram overlap, label and decoding checks
  only make sense for them. Float (or any other) data gets the exact-copy checks, on its real
  values: samples are hashed by their bytes, batches by their bit patterns (never truncated).
- ``find_overlap``: exact duplicate samples (blake2b of the bytes) and, for tokens, rolling
  hashes of every ``n``-token window (vectorised, O(tokens); its time on the KJV: docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

__all__ = ["as_int64", "dataset_samples", "find_overlap", "fingerprint", "input_ids_of", "is_token_data",
           "label_pattern", "sample_hashes", "window_hashes"]

_B = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64, so window hashes need no division
_B_INV = pow(_B, -1, 2**64)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def input_ids_of(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, dict):
        return batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return batch if isinstance(batch, torch.Tensor) else None


def dataset_samples(dataset: Any, max_tokens: int, max_samples: int | None = None) -> list[np.ndarray] | None:
    """The first samples' main tensors (dtype kept), up to ``max_tokens`` elements (vectorised for packed blocks)."""
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        return None
    limit = min(len(dataset), max_samples or len(dataset))
    if all(hasattr(dataset, a) for a in ("tokens", "seq_len", "start")):  # dsdebug.data PackedBlocks
        a, t = dataset.start, dataset.seq_len
        n = min(limit, max(1, max_tokens // t))
        return list(np.asarray(dataset.tokens[a : a + n * t], dtype=np.int64).reshape(n, t))
    out, total = [], 0
    for i in range(limit):
        ids = input_ids_of(dataset[i])
        if isinstance(ids, torch.Tensor):  # keep the dtype: float samples are compared by value, not truncated
            ids = ids.detach().cpu()
            ids = ids.float() if ids.dtype == torch.bfloat16 else ids
        out.append(np.asarray(ids if ids is not None else [], dtype=None if ids is not None else np.int64).reshape(-1))
        total += len(out[-1])
        if total >= max_tokens:
            break
    return out


def window_hashes(samples: list[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hashes of every n-token window inside each sample: (hashes, sample index, offset in sample).
    Polynomial hash mod 2**64 from prefix sums (B odd, so B**-i exists); windows never cross
    a sample boundary. O(tokens), vectorised."""
    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    empty = np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    if n <= 0 or lengths.max(initial=0) < n:
        return empty
    flat = np.concatenate(samples).astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        powers = np.concatenate([[np.uint64(1)], np.cumprod(np.full(len(flat) - 1, _B, np.uint64))])
        inv = np.concatenate([[np.uint64(1)], np.cumprod(np.full(len(flat) - 1, _B_INV, np.uint64))])
        prefix = np.concatenate([[np.uint64(0)], np.cumsum(flat * powers, dtype=np.uint64)])
        starts = np.arange(len(flat) - n + 1)
        hashes = (prefix[starts + n] - prefix[starts]) * inv[starts]
    sample_of = np.repeat(np.arange(len(samples)), lengths)
    valid = sample_of[starts] == sample_of[starts + n - 1]
    starts = starts[valid]
    offsets = starts - np.concatenate([[0], np.cumsum(lengths)[:-1]])[sample_of[starts]]
    return hashes[valid], sample_of[starts], offsets


def sample_hashes(samples: list[np.ndarray]) -> np.ndarray:
    return np.array([int.from_bytes(hashlib.blake2b(s.tobytes(), digest_size=8).digest(), "little")
                     for s in samples], dtype=np.uint64)


def _member(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """np.isin via sort + searchsorted (numpy's hash-based isin is ~10x slower on 1M uint64)."""
    if not len(pool):
        return np.zeros(len(values), bool)
    pool = np.sort(pool)
    return pool[np.minimum(np.searchsorted(pool, values), len(pool) - 1)] == values


def find_overlap(train: list[np.ndarray], val: list[np.ndarray], n: int) -> dict[str, Any]:
    """Exact duplicate samples and val samples sharing an n-token window with train (tokens only:
    for other data ``ngram`` is 0 and only exact copies, by value, are counted)."""
    if not (is_token_data(train) and is_token_data(val)):
        n = 0
    t_exact, v_exact = sample_hashes(train), sample_hashes(val)
    exact = np.nonzero(_member(v_exact, t_exact))[0]
    # the train set's own repetition: the share of train samples equal to another train sample. Short samples
    # (a few tokens) repeat in any text; a val copy is evidence of a leak only beyond this rate
    _, inverse, counts = np.unique(t_exact, return_inverse=True, return_counts=True)
    self_dup = float((counts[inverse] > 1).mean()) if len(t_exact) else 0.0
    out: dict[str, Any] = {"val_samples": len(val), "train_samples": len(train), "exact": len(exact),
                           "ngram": n, "ngram_overlap": 0, "example": None, "train_self_duplicates": self_dup}
    if len(exact):
        v = int(exact[0])
        out["example"] = {"val_index": v, "train_index": int(np.nonzero(t_exact == v_exact[v])[0][0]),
                          "offset": 0, "ids": val[v][: n or 8].tolist()}
    if n > 0:
        th, ts, to = window_hashes(train, n)
        vh, vs, vo = window_hashes(val, n)
        hit = _member(vh, th)
        out["ngram_overlap"] = int(len(np.unique(vs[hit])))
        if hit.any() and out["example"] is None:
            k = int(np.nonzero(hit)[0][0])
            j = int(np.nonzero(th == vh[k])[0][0])
            out["example"] = {"val_index": int(vs[k]), "val_offset": int(vo[k]), "train_index": int(ts[j]),
                              "train_offset": int(to[j]), "ids": val[vs[k]][vo[k] : vo[k] + n].tolist()}
    return out


def is_token_data(samples: list[np.ndarray]) -> bool:
    """Integer (or bool) samples: token ids, so the token-only checks apply."""
    return all(s.dtype.kind in "iub" for s in samples)


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """Integers as they are; any other dtype by its bit pattern (floats differing in any bit differ)."""
    if not t.dtype.is_floating_point and not t.is_complex():
        return t.long()
    t = torch.view_as_real(t) if t.is_complex() else t
    return t.contiguous().view(_INT_VIEW[t.element_size()]).long()


def fingerprint(ids: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Order-sensitive int64 hash of a batch, computed where it lives (no sync); returns (hash, weights)
    so the caller keeps the random weights between batches."""
    flat = as_int64(ids).reshape(-1)
    if weights is None or weights.numel() < flat.numel() or weights.device != flat.device:
        g = torch.Generator().manual_seed(0x5EED)
        weights = (torch.randint(1, 2**62, (max(flat.numel(), 1 << 16),), generator=g) | 1).to(flat.device)
    return ((flat + 1) * weights[: flat.numel()]).sum(), weights


def label_pattern(ids: torch.Tensor, labels: torch.Tensor) -> str:
    """'same' (labels == input_ids), 'shifted' (labels[t] == input_ids[t+1]), 'ignored', or 'other'."""
    keep = labels != -100
    if not keep.any():
        return "ignored"
    if ids.shape == labels.shape and bool((labels[keep] == ids[keep]).all()):
        return "same"
    if ids.dim() == 2 and ids.shape == labels.shape and ids.shape[1] > 1:
        k = keep[:, :-1]
        if k.any() and bool((labels[:, :-1][k] == ids[:, 1:][k]).all()):
            return "shifted"
    return "other"
