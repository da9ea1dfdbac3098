"""`DataInspector`: look at the data the model actually gets -- first batch, order, ranks, splits.

Catches: ranks that receive identical batches (no or disabled distributed sampler), val
blocks that also occur in train (leaked evaluation), a data order that changes between two
runs with the same seed (a sampler or worker that ignores the seed), labels prepared for one
convention and used with another (double shift: the model learns token t+2), and unseeded
dataloader workers. It also prints and saves the first batch (shapes, dtypes, ranges,
padding, decoded text) -- seeing it catches most input-pipeline bugs in seconds.

How: a batch fingerprint is an order-sensitive int64 hash of ``input_ids`` computed where the
batch lives (no host sync). Overlap: exact sample hashes plus rolling hashes of every
``overlap_ngram``-token window (vectorised, O(tokens); ~0.15 s for the full 1M-token KJV).
Label convention: from the first batch (labels == input_ids, or labels[t] == input_ids[t+1])
against the module's: ``shifts_labels`` on the LightningModule if set, else known for
``CausalLMModule`` (it shifts). Data order: ``compare_with=latest`` picks the newest other run
dir next to this one (same log_dir/task) whose ``data_order_rank<r>.json`` has the same seed;
it is compared only if world size, batch size and data fingerprint also match, aligned by
global batch index (a resumed run compares its batches with the same ones of the reference).

Rank awareness:
- every rank: fingerprints its batches, saves its first batch and its data order; the label
  check agrees across ranks with one all-reduce (COLLECTIVE, first batch only); every
  ``every_n_steps`` batches and at train end every rank all-gathers its buffered fingerprints
  (COLLECTIVE; every rank has the same batch count). On one process nothing is gathered, and
  after the first ``order_batches`` batches nothing is hashed.
- rank 0 only: the train/val overlap scan and the worker-seeding report (no collectives).
Findings about all ranks are reported once, by rank 0 (rank=null); on the other ranks an
error only applies the ``on_error`` policy, so every rank acts alike.

Example::

    python train.py +callbacks=data_inspector trainer=ddp_sim \\
        callbacks.data_inspector.compare_with=latest callbacks.data_inspector.every_n_steps=5

Artifacts (``<run_dir>/data_inspector/``): ``first_batch_rank<r>.json`` (+ ``.pt``, the tensors),
``data_order_rank<r>.json`` (first ``order_batches`` batch fingerprints, seed, data fingerprint).

| finding code | severity | meaning |
|---|---|---|
| ``first_batch`` | info | first batch summary (shapes, dtypes, min/max, padding, decoded text in details) |
| ``identical_batches_across_ranks`` | error | two or more ranks got the same batch at a step |
| ``train_val_overlap`` | warning | val samples equal to, or sharing ``overlap_ngram`` tokens with, train samples |
| ``train_val_overlap_small`` | info | a few shared n-grams (below ``overlap_warn_fraction``) |
| ``data_order_changed`` | warning | same seed and data as the reference run, but batch k differs |
| ``data_order_matches`` / ``no_reference`` / ``reference_differs`` | info | order comparison outcome |
| ``label_double_shift`` | error | labels are pre-shifted and the module shifts them again |
| ``label_not_shifted`` | error | labels equal the inputs and the module does not shift |
| ``labels_all_ignored`` | error | every label is the ignore index (-100): no loss signal |
| ``workers`` / ``workers_unseeded`` | info / warning | how dataloader workers are seeded |

Metrics: none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsdebug.callbacks.base import DebugCallback
from dsdebug.errors import ConfigError
from dsdebug.findings import Finding

log = logging.getLogger(__name__)
_B = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64, so window hashes need no division
_B_INV = pow(_B, -1, 2**64)


def input_ids_of(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, dict):
        return batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return batch if isinstance(batch, torch.Tensor) else None


def dataset_samples(dataset: Any, max_tokens: int, max_samples: int | None = None) -> list[np.ndarray] | None:
    """input_ids of the first samples, up to ``max_tokens`` tokens (vectorised for packed blocks)."""
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
        out.append(np.asarray(ids if ids is not None else [], dtype=np.int64).reshape(-1))
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
    """Exact duplicate samples and val samples sharing an n-token window with train."""
    t_exact, v_exact = sample_hashes(train), sample_hashes(val)
    exact = np.nonzero(_member(v_exact, t_exact))[0]
    out: dict[str, Any] = {"val_samples": len(val), "train_samples": len(train), "exact": len(exact),
                           "ngram": n, "ngram_overlap": 0, "example": None}
    if len(exact):
        v = int(exact[0])
        out["example"] = {"val_index": v, "train_index": int(np.nonzero(t_exact == v_exact[v])[0][0]),
                          "offset": 0, "ids": val[v][:n].tolist()}
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


def _loader(obj: Any) -> Any:
    """The first DataLoader of what Lightning holds (a loader, list, dict or CombinedLoader)."""
    while isinstance(obj, (list, tuple, dict)) and obj:
        obj = next(iter(obj.values())) if isinstance(obj, dict) else obj[0]
    return obj


def _module_shifts(pl_module: Any) -> tuple[bool | None, str]:
    """Does the module's loss shift labels itself? (attribute ``shifts_labels`` wins)."""
    declared = getattr(pl_module, "shifts_labels", None)
    if isinstance(declared, bool):
        return declared, f"{type(pl_module).__name__}.shifts_labels={declared}"
    return None, f"unknown for {type(pl_module).__name__} (set shifts_labels=True/False on it)"


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


class DataInspector(DebugCallback):
    name = "data_inspector"

    def __init__(self, every_n_steps: int = 10, show_sequences: int = 2, max_chars: int = 300,
                 order_batches: int = 32, compare_with: str | None = None, check_overlap: bool = True,
                 overlap_ngram: int = 32, overlap_warn_fraction: float = 0.01, overlap_max_tokens: int = 5_000_000,
                 on_error: str = "warn") -> None:
        super().__init__(on_error)
        for key, value, low in (("every_n_steps", every_n_steps, 1), ("show_sequences", show_sequences, 0),
                                ("max_chars", max_chars, 1), ("order_batches", order_batches, 0),
                                ("overlap_ngram", overlap_ngram, 0), ("overlap_max_tokens", overlap_max_tokens, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"callbacks.data_inspector.{key}={value!r} is invalid; valid: an int >= {low}")
        if not isinstance(check_overlap, bool):
            raise ConfigError(f"callbacks.data_inspector.check_overlap={check_overlap!r} is invalid; "
                              "valid: true, false")
        if not isinstance(overlap_warn_fraction, (int, float)) or not 0 <= overlap_warn_fraction <= 1:
            raise ConfigError(f"callbacks.data_inspector.overlap_warn_fraction={overlap_warn_fraction!r} is invalid; "
                              "valid: a number in [0, 1]")
        if compare_with is not None and not isinstance(compare_with, str):
            raise ConfigError(f"callbacks.data_inspector.compare_with={compare_with!r} is invalid; "
                              "valid: null, latest, <run_dir>")
        if compare_with not in (None, "latest") and not Path(compare_with).is_dir():
            raise ConfigError(f"callbacks.data_inspector.compare_with={compare_with!r}: no such run dir; valid: null, "
                              "latest, <run_dir>")
        self.every_n_steps, self.show_sequences, self.max_chars = every_n_steps, show_sequences, max_chars
        self.order_batches, self.compare_with, self.check_overlap = order_batches, compare_with, check_overlap
        self.overlap_ngram, self.overlap_warn_fraction = overlap_ngram, float(overlap_warn_fraction)
        self.overlap_max_tokens = overlap_max_tokens
        self._weights: torch.Tensor | None = None
        self._pending: list[tuple[torch.Tensor, int, int]] = []  # (device fingerprint, step, batch index)
        self._order: list[str] = []
        self._order_offset: int | None = None
        self._order_done = False
        self._dup_reported = False
        self._data_fp: str | None = None
        self._first_done = False

    def _dir(self, trainer: Any) -> Path:
        out = Path(trainer.default_root_dir) / "data_inspector"
        out.mkdir(parents=True, exist_ok=True)
        return out

    def _report_once(self, trainer: Any, severity: str, code: str, message: str, advice: str = "",
                     details: dict | None = None, step: Any = "self") -> None:
        """A finding every rank agrees on: rank 0 writes it; other ranks only apply the policy."""
        if trainer.global_rank == 0:
            self.report(trainer, severity, code, message, advice, details, rank=None, step=step)
        elif severity == "error":
            self._apply_policy(trainer, Finding(self.name, severity, code, message, step=trainer.global_step))

    # ---- train start: data fingerprint (every rank), overlap + workers (rank 0) -----
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        dm = trainer.datamodule
        train_ds = getattr(dm, "train_dataset", None) or getattr(_loader(trainer.train_dataloader), "dataset", None)
        if self.order_batches:  # every rank: names the data in data_order files (first 256 samples + length)
            head = dataset_samples(train_ds, 1 << 20, max_samples=256)
            if head is not None:
                digest = hashlib.sha1(sample_hashes(head).tobytes() + str(len(train_ds)).encode())
                self._data_fp = digest.hexdigest()[:16]
        if trainer.global_rank != 0:
            return
        self._check_workers(trainer)
        if self.check_overlap:
            val_ds = getattr(dm, "val_dataset", None) or getattr(_loader(trainer.val_dataloaders), "dataset", None)
            train = dataset_samples(train_ds, self.overlap_max_tokens)
            val = dataset_samples(val_ds, self.overlap_max_tokens)
            if train is None or val is None:
                log.info("data_inspector: train/val overlap not checked (datasets without __len__/__getitem__)")
            else:
                self._check_overlap(trainer, train, val)

    def _check_workers(self, trainer: Any) -> None:
        loader = _loader(trainer.train_dataloader)
        workers = getattr(loader, "num_workers", 0)
        fn = getattr(loader, "worker_init_fn", None)
        fn_name = getattr(getattr(fn, "func", fn), "__name__", repr(fn))
        seeded = os.environ.get("PL_GLOBAL_SEED") is not None
        details = {"num_workers": workers, "worker_init_fn": fn_name,
                   **{k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}}
        if workers and not seeded:
            self.report(trainer, "warning", "workers_unseeded",
                        f"train dataloader has {workers} workers but the main process was not seeded: worker RNG "
                        "(random augmentation, masking, sampling in __getitem__) differs between runs",
                        advice="call lightning.seed_everything(seed, workers=True) before building the loaders",
                        details=details, rank=None)
            return
        if not workers:
            text = "train data loads in the main process (num_workers=0), seeded by seed_everything"
        else:
            per_rank = fn_name == "pl_worker_init_function"
            text = (f"{workers} workers; PyTorch seeds torch/random/numpy in each worker from the loader's base seed "
                    f"(drawn from the seeded main RNG), worker_init_fn={fn_name}"
                    + ("" if per_rank else ", which does not mix in the rank: worker random streams repeat on "
                       "every rank"))
        self.report(trainer, "info", "workers", text, details=details, rank=None)

    def _check_overlap(self, trainer: Any, train: list, val: list) -> None:
        r = find_overlap(train, val, self.overlap_ngram)
        if not r["exact"] and not r["ngram_overlap"]:
            log.info("data_inspector: no val sample shares a %d-token span with %d train samples", self.overlap_ngram,
                     len(train))
            return
        ex = dict(r["example"])
        ex["text"] = self._decode(trainer, ex.pop("ids"))
        n_val = max(r["val_samples"], 1)
        frac = max(r["exact"], r["ngram_overlap"]) / n_val
        severe = r["exact"] > 0 or frac > self.overlap_warn_fraction
        where = f"val sample {ex['val_index']} / train sample {ex['train_index']}"
        code = "train_val_overlap" if severe else "train_val_overlap_small"
        self.report(trainer, "warning" if severe else "info", code,
                    f"{r['exact']} val samples are exact copies of train samples and {r['ngram_overlap']} of "
                    f"{r['val_samples']} share a {self.overlap_ngram}-token span with train (e.g. {where}: "
                    f"{ex['text'][:120]!r}): val loss overstates generalisation",
                    advice="deduplicate documents before splitting; split by document, not by block",
                    details={**r, "example": ex, "fraction": frac}, rank=None)

    def _decode(self, trainer: Any, ids: list[int]) -> str:
        tok = getattr(trainer.datamodule, "tokenizer", None)
        if tok is None:
            return " ".join(map(str, ids))[: self.max_chars]
        return tok.decode(ids)[: self.max_chars]

    # ---- every batch, every rank ------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        ids = input_ids_of(batch)
        if not self._first_done:
            self._first_done = True
            self._first_batch(trainer, pl_module, batch, ids)  # COLLECTIVE inside (label agreement)
        if ids is None or (trainer.world_size == 1 and (self._order_done or not self.order_batches)):
            return  # nothing left to compare on one process: no per-step cost
        fp = self._fingerprint(ids)
        total = trainer.fit_loop.epoch_loop.total_batch_idx
        if self.order_batches and not self._order_done:
            if self._order_offset is None:
                self._order_offset = total
            self._order.append(f"{int(fp) & (2**64 - 1):016x}")  # host sync: first order_batches batches only
            if len(self._order) >= self.order_batches:
                self._finish_order(trainer)
        if trainer.world_size > 1:
            self._pending.append((fp, trainer.global_step, total))
            if len(self._pending) >= self.every_n_steps:
                self._gather(trainer)  # COLLECTIVE: every rank reaches it at the same batch count

    def _fingerprint(self, ids: torch.Tensor) -> torch.Tensor:
        """Order-sensitive int64 hash of the batch, computed where the batch lives (no sync)."""
        ids = ids.reshape(ids.shape[0] if ids.dim() > 1 else 1, -1).long()
        if self._weights is None or self._weights.numel() < ids.numel() or self._weights.device != ids.device:
            g = torch.Generator().manual_seed(0x5EED)
            w = torch.randint(1, 2**62, (max(ids.numel(), 1 << 16),), generator=g) | 1
            self._weights = w.to(ids.device)
        return ((ids.reshape(-1) + 1) * self._weights[: ids.numel()]).sum()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.world_size > 1:
            self._gather(trainer)  # COLLECTIVE: flush; every rank calls it once more
        if self.order_batches and not self._order_done and self._order:
            self._finish_order(trainer)

    def _gather(self, trainer: Any) -> None:
        if self._dup_reported:  # every rank saw the same gathered data, so every rank stops here
            self._pending.clear()
            return
        count = torch.tensor([len(self._pending)], device=trainer.strategy.root_device)
        counts = trainer.strategy.all_gather(count).reshape(-1)
        n = int(counts.min())
        if n == 0:
            self._pending.clear()
            return
        local = torch.stack([fp for fp, _, _ in self._pending[:n]]).to(trainer.strategy.root_device)
        every = trainer.strategy.all_gather(local).reshape(trainer.world_size, n).cpu()
        steps = [(s, b) for _, s, b in self._pending[:n]]
        self._pending = self._pending[n:]
        for j in range(n):
            column = every[:, j].tolist()
            groups = [[r for r, v in enumerate(column) if v == x] for x in dict.fromkeys(column)]
            dup = [g for g in groups if len(g) > 1]
            if dup:
                self._dup_reported = True
                same = sum(len(set(every[:, k].tolist())) < trainer.world_size for k in range(n))
                names = "; ".join(" and ".join(f"rank {r}" for r in g) for g in dup)
                self._report_once(trainer, "error", "identical_batches_across_ranks",
                                  f"{names} received identical batches at step {steps[j][0]} (batch {steps[j][1]}); "
                                  f"{same} of the {n} batches checked in this window were duplicated: the ranks train "
                                  "on the same data and the effective batch is smaller than configured",
                                  advice="enable the distributed sampler (trainer.use_distributed_sampler=true) or "
                                         "shard the dataset by rank (DistributedSampler / split an IterableDataset "
                                         "by rank)",
                                  details={"step": steps[j][0], "batch": steps[j][1], "rank_groups": dup,
                                           "duplicated_in_window": same, "window": n}, step=steps[j][0])
                return

    # ---- first batch: every rank saves its own; the label check agrees across ranks ---
    def _first_batch(self, trainer: Any, pl_module: Any, batch: Any, ids: torch.Tensor | None) -> None:
        rank, dm = trainer.global_rank, trainer.datamodule
        tensors = batch if isinstance(batch, dict) else {"input_ids": ids} if ids is not None else {}
        pad = getattr(dm, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(dm, "tokenizer", None), "pad_token_id", None)
        summary: dict[str, Any] = {"rank": rank, "step": trainer.global_step, "pad_id": pad, "tensors": {}}
        for key, t in tensors.items():
            if isinstance(t, torch.Tensor):
                summary["tensors"][key] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                           "min": t.min().item() if t.numel() else None,
                                           "max": t.max().item() if t.numel() else None}
        if ids is not None:
            if pad is not None:
                summary["padding_ratio"] = float((ids == pad).float().mean())
            if isinstance(batch, dict) and isinstance(batch.get("attention_mask"), torch.Tensor):
                summary["masked_ratio"] = float((batch["attention_mask"] == 0).float().mean())
            rows = ids.reshape(ids.shape[0], -1) if ids.dim() > 1 else ids.reshape(1, -1)
            summary["decoded"] = [self._decode(trainer, r.tolist()) for r in rows[: self.show_sequences]]
        labels = batch.get("labels") if isinstance(batch, dict) else None
        pattern = label_pattern(ids, labels) if isinstance(labels, torch.Tensor) and ids is not None else "no labels"
        shifts, how = _module_shifts(pl_module)
        summary["labels"] = {"pattern": pattern, "module_shifts": shifts, "how": how}
        out = self._dir(trainer)
        (out / f"first_batch_rank{rank}.json").write_text(json.dumps(summary, indent=2, default=str))
        torch.save({k: v.detach().cpu() for k, v in tensors.items() if isinstance(v, torch.Tensor)},
                   out / f"first_batch_rank{rank}.pt")
        shapes = ", ".join(f"{k} {v['dtype']}{v['shape']} [{v['min']}..{v['max']}]"
                           for k, v in summary["tensors"].items())
        log.info("data_inspector: first batch on rank %d: %s; padding %s; labels %s", rank, shapes,
                 summary.get("padding_ratio"), pattern)
        for i, text in enumerate(summary.get("decoded", [])):
            log.info("data_inspector: rank %d sequence %d: %r", rank, i, text)
        if rank == 0:
            self.report(trainer, "info", "first_batch", f"first batch: {shapes}; padding ratio "
                        f"{summary.get('padding_ratio')}; labels {pattern}; saved to {out}",
                        details=summary, rank=None)
        flags = torch.tensor([pattern == "shifted" and shifts is True, pattern == "same" and shifts is False,
                              pattern == "ignored"], dtype=torch.float32)
        if trainer.world_size > 1:  # COLLECTIVE (every rank, first batch only): agree before acting on an error
            flags = trainer.strategy.reduce(flags.to(trainer.strategy.root_device), reduce_op="max").cpu()
        double, unshifted, ignored = (bool(f) for f in flags)
        if double:
            self._report_once(trainer, "error", "label_double_shift",
                              "batch labels are already shifted (labels[:, t] == input_ids[:, t+1]) and the module "
                              f"shifts them again ({how}): the model is trained to predict token t+2",
                              advice="give labels == input_ids (the module shifts), or make the loss not shift",
                              details=summary["labels"])
        if unshifted:
            self._report_once(trainer, "error", "label_not_shifted",
                              f"labels equal input_ids and the module does not shift them ({how}): the model learns "
                              "to copy its input (loss collapses to ~0)", advice="shift labels by one for causal LM",
                              details=summary["labels"])
        if ignored:
            self._report_once(trainer, "error", "labels_all_ignored",
                              "every label in the first batch is -100 (ignored): the loss has no signal",
                              advice="check the label masking (prompt masking, padding) in the collate function")

    # ---- data order: every rank, its own file ----------------------------------------
    def _finish_order(self, trainer: Any) -> None:
        self._order_done = True
        rank = trainer.global_rank
        record = {"rank": rank, "world_size": trainer.world_size, "seed": os.environ.get("PL_GLOBAL_SEED"),
                  "data_fingerprint": self._data_fp, "batch_size": self._batch_size(trainer),
                  "first_batch_index": self._order_offset, "batches": self._order}
        path = self._dir(trainer) / f"data_order_rank{rank}.json"
        path.write_text(json.dumps(record, indent=1))
        if self.compare_with is not None:
            self._compare_order(trainer, record, path)

    @staticmethod
    def _batch_size(trainer: Any) -> int | None:
        return getattr(_loader(trainer.train_dataloader), "batch_size", None)

    def _reference(self, path: Path, seed: str | None) -> Path | None:
        if self.compare_with != "latest":
            ref = Path(self.compare_with) / "data_inspector" / path.name
            return ref if ref.is_file() else None
        run_dir = path.parent.parent
        found = []
        for p in run_dir.parent.glob(f"*/data_inspector/{path.name}"):
            if p.parent.parent == run_dir:
                continue
            try:
                if json.loads(p.read_text()).get("seed") == seed:
                    found.append(p)
            except (OSError, ValueError):
                continue
        return max(found, key=lambda p: p.stat().st_mtime) if found else None

    def _compare_order(self, trainer: Any, record: dict, path: Path) -> None:
        ref_path = self._reference(path, record["seed"])
        rank = record["rank"]
        if ref_path is None:
            self.report(trainer, "info", "no_reference", f"rank {rank}: no earlier run with seed {record['seed']} to "
                        f"compare the data order with (compare_with={self.compare_with})")
            return
        ref = json.loads(ref_path.read_text())
        keys = ("seed", "world_size", "data_fingerprint", "batch_size")
        diff = {k: (ref.get(k), record[k]) for k in keys if ref.get(k) != record[k]}
        run = ref_path.parent.parent
        if diff:
            self.report(trainer, "info", "reference_differs", f"rank {rank}: reference run {run} differs in "
                        f"{', '.join(diff)}; data order not compared", details={"differences": diff})
            return
        a, b = ref["first_batch_index"], record["first_batch_index"]
        start, end = max(a, b), min(a + len(ref["batches"]), b + len(record["batches"]))
        for i in range(start, end):
            if ref["batches"][i - a] != record["batches"][i - b]:
                matched = f"batches {start}..{i - 1} matched" if i > start else "no batch matched"
                self.report(trainer, "warning", "data_order_changed",
                            f"rank {rank}: batch {i} differs from reference run {run} with the same seed "
                            f"{record['seed']}, data and world size ({matched}): the data order is not a function "
                            "of the seed", advice="seed the sampler (a torch.Generator seeded from "
                            "the run seed, set_epoch), avoid samplers/workers that draw from time or os.urandom",
                            details={"batch": i, "reference": str(run), "ours": record["batches"][i - b],
                                     "theirs": ref["batches"][i - a]})
                return
        self.report(trainer, "info", "data_order_matches", f"rank {rank}: batches {start}..{end - 1} match reference "
                    f"run {run} (same seed {record['seed']})")
