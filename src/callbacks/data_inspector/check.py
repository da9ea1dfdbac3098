"""`DataInspector`: look at the data the model actually gets -- first batch, order, ranks, splits.

Catches: ranks that receive identical batches (no or disabled distributed sampler), val
blocks that also occur in train (leaked evaluation), a data order that changes between two
runs with the same seed (a sampler or worker that ignores the seed), labels prepared for one
convention and used with another (double shift: the model learns token t+2), and unseeded
dataloader workers. It also prints and saves the first batch (shapes, dtypes, ranges,
padding, decoded text) -- seeing it catches most input-pipeline bugs in seconds.

How: a batch fingerprint is an order-sensitive int64 hash of ``input_ids`` (else the batch's
first tensor) computed where the batch lives (no host sync). Any dtype: non-integer data
(float features) is hashed by its bit patterns and samples by their bytes, so copies are found
by value; the token-only checks (labels, n-gram overlap, padding, decoding) are skipped for it
and the ``first_batch`` finding says so (library: ``fingerprint.py``; dataset-level checks:
``dataset_checks.py``). Overlap: exact sample hashes plus rolling hashes of every
``overlap_ngram``-token window (vectorised, O(tokens); its time on the KJV: docs/benchmarks.md).
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
| ``batch_unlike_the_others`` | warning | a training batch whose tokens are unlike the run's other batches: one token fills it (a zero-filled / padding-only shard) or its ids look random (a binary file, another tokenizer's ids); per rank, named at the step it trained, read with the next 9 batches (one host read per 10) (``batch_content.py``; ``check_batch_content``) |

Metrics: none. Resume: nothing is carried over (``state_attrs`` is empty): each process records and
checks its own data stream from its first batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import torch

from dsdebug.callbacks.data_inspector.dataset_checks import DatasetChecks, _loader, _module_shifts
from dsdebug.callbacks.data_inspector.fingerprint import (dataset_samples, fingerprint, input_ids_of, label_pattern,
                                                          sample_hashes)
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.data_inspector.batch_content import BatchContent
from dsdebug.callbacks.grad_access import untrained_vocab
from dsdebug.config.args import Rule, boolean, integer, number, optional, string
from dsdebug.errors import ConfigError
from dsdebug.findings import Finding
from dsdebug.distributed import collectives

__all__ = ["DataInspector"]

log = logging.getLogger(__name__)


class DataInspector(DatasetChecks, DebugCallback):
    name = "data_inspector"
    state_attrs = ()  # first batch, data order and duplicate checks describe this process's data stream

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(1),
        "show_sequences": integer(0),
        "max_chars": integer(1),
        "order_batches": integer(0),
        "overlap_ngram": integer(0),
        "overlap_max_tokens": integer(1),
        "check_overlap": boolean(),
        "check_batch_content": boolean(),
        "overlap_warn_fraction": number(0, 1),
        "compare_with": optional(string("latest, <run_dir>")),
    }

    def __init__(self, every_n_steps: int = 10, show_sequences: int = 2, max_chars: int = 300,
                 order_batches: int = 32, compare_with: str | None = None, check_overlap: bool = True,
                 overlap_ngram: int = 32, overlap_warn_fraction: float = 0.01, overlap_max_tokens: int = 5_000_000,
                 check_batch_content: bool = True, on_error: str = "warn") -> None:
        super().__init__(on_error)
        self.check_declared(every_n_steps=every_n_steps, show_sequences=show_sequences, max_chars=max_chars,
                            order_batches=order_batches, overlap_ngram=overlap_ngram,
                            overlap_max_tokens=overlap_max_tokens, check_overlap=check_overlap,
                            check_batch_content=check_batch_content, overlap_warn_fraction=overlap_warn_fraction,
                            compare_with=compare_with)
        if compare_with not in (None, "latest") and not Path(compare_with).is_dir():
            raise ConfigError(f"callbacks.data_inspector.compare_with={compare_with!r}: no such run dir; valid: null, "
                              "latest, <run_dir>")
        self.every_n_steps, self.show_sequences, self.max_chars = every_n_steps, show_sequences, max_chars
        self.order_batches, self.compare_with, self.check_overlap = order_batches, compare_with, check_overlap
        self.overlap_ngram, self.overlap_warn_fraction = overlap_ngram, float(overlap_warn_fraction)
        self.overlap_max_tokens = overlap_max_tokens
        self._weights: torch.Tensor | None = None
        self._pending: list[tuple[torch.Tensor, int, int]] = []  # (device fingerprint, step, batch index)
        self._order: list[Any] = []  # the first batches' fingerprints, on the device until _finish_order
        self._order_offset: int | None = None
        self._order_done = False
        self._dup_reported = False
        self._data_fp: str | None = None
        self._first_done = False
        self.check_batch_content = check_batch_content
        self._content = BatchContent() if check_batch_content else None
        self._content_reported = 0

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
            self._order.append(fp.detach().reshape(()))  # read once, when the order is written
            if len(self._order) >= self.order_batches:
                self._finish_order(trainer)
        if trainer.world_size > 1:
            self._pending.append((fp, trainer.global_step, total))
            if len(self._pending) >= self.every_n_steps:
                self._gather(trainer)  # COLLECTIVE: every rank reaches it at the same batch count

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._content is None:
            return
        ids = input_ids_of(batch)
        if ids is None or ids.is_floating_point():
            return
        if self._content.vocab is None:
            self._content.vocab = max(int(untrained_vocab(trainer, pl_module) or 0), int(ids.max()) + 1)
        labels = batch.get("labels") if isinstance(batch, dict) else None
        # this batch's step: global_step has already counted its update here
        found = self._content.measure(ids, labels, max(trainer.global_step - 1, 0),
                                      trainer.fit_loop.epoch_loop.total_batch_idx)
        self._report_content(trainer, found)

    def _report_content(self, trainer: Any, found: list[dict]) -> None:
        """Rank-local findings (this rank's data), at most five per run."""
        for f in found:
            self._content_reported += 1
            if self._content_reported > 5:
                return
            message, advice = self._content.describe(f)
            more = " (further ones are not reported)" if self._content_reported == 5 else ""
            self.report(trainer, "warning", "batch_unlike_the_others",
                        f"the training batch of step {f['step']} (batch index {f['batch_index']}): {message}{more}",
                        advice, details=f, step=f["step"])

    def _fingerprint(self, ids: torch.Tensor) -> torch.Tensor:
        """Order-sensitive int64 hash of the batch (any dtype, by value), where it lives (no sync)."""
        fp, self._weights = fingerprint(ids, self._weights)
        return fp

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._content is not None:
            self._report_content(trainer, self._content.flush())
        if trainer.world_size > 1:
            self._gather(trainer)  # COLLECTIVE: flush; every rank calls it once more
        if self.order_batches and not self._order_done and self._order:
            self._finish_order(trainer)

    def _gather(self, trainer: Any) -> None:
        if self._dup_reported:  # every rank saw the same gathered data, so every rank stops here
            self._pending.clear()
            return
        count = torch.tensor([len(self._pending)], device=trainer.strategy.root_device)
        counts = collectives.all_gather(trainer, count).reshape(-1)
        n = int(counts.min())
        if n == 0:
            self._pending.clear()
            return
        local = torch.stack([fp for fp, _, _ in self._pending[:n]]).to(trainer.strategy.root_device)
        every = collectives.all_gather(trainer, local).reshape(trainer.world_size, n).cpu()
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
        tokens = ids is not None and not ids.is_floating_point() and not ids.is_complex()
        tensors = batch if isinstance(batch, dict) else {"input_ids" if tokens else "batch": ids} if ids is not None else {}
        pad = getattr(dm, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(dm, "tokenizer", None), "pad_token_id", None)
        summary: dict[str, Any] = {"rank": rank, "step": trainer.global_step, "pad_id": pad, "tensors": {}}
        for key, t in tensors.items():
            if isinstance(t, torch.Tensor):
                summary["tensors"][key] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                           "min": t.min().item() if t.numel() else None,
                                           "max": t.max().item() if t.numel() else None}
        if tokens:  # padding and decoding are for token ids only
            if pad is not None:
                summary["padding_ratio"] = float((ids == pad).float().mean())
            if isinstance(batch, dict) and isinstance(batch.get("attention_mask"), torch.Tensor):
                summary["masked_ratio"] = float((batch["attention_mask"] == 0).float().mean())
            rows = ids.reshape(ids.shape[0], -1) if ids.dim() > 1 else ids.reshape(1, -1)
            summary["decoded"] = [self._decode(trainer, r.tolist()) for r in rows[: self.show_sequences]]
        labels = batch.get("labels") if isinstance(batch, dict) else None
        pattern = label_pattern(ids, labels) if isinstance(labels, torch.Tensor) and tokens else "no labels"
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
        kind = ("" if tokens or ids is None else f"; not token ids ({summary['tensors'].get('batch', {}).get('dtype')}"
                f" data): token checks (padding, decoding, labels, n-gram overlap) skipped, exact copies compared by "
                "value")
        if rank == 0:
            self.report(trainer, "info", "first_batch", f"first batch: {shapes}; padding ratio "
                        f"{summary.get('padding_ratio')}; labels {pattern}{kind}; saved to {out}",
                        details=summary, rank=None)
        flags = torch.tensor([pattern == "shifted" and shifts is True, pattern == "same" and shifts is False,
                              pattern == "ignored"], dtype=torch.float32)
        if trainer.world_size > 1:  # COLLECTIVE (every rank, first batch only): agree before acting on an error
            flags = collectives.reduce(trainer, flags, "max").cpu()
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
