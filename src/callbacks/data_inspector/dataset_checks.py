"""The dataset-level checks of `DataInspector` (a mixin, split out only to keep files small):
dataloader worker seeding and train/val overlap (rank 0, no collectives), and the data-order
record and comparison with a reference run (every rank, its own file, no collectives)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from dsdebug.callbacks.data_inspector.fingerprint import find_overlap

__all__ = ["DatasetChecks", "judge_overlap"]

log = logging.getLogger("dsdebug.callbacks.data_inspector")


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


class DatasetChecks:
    """Mixed into DataInspector: uses its ``report``, ``_dir`` and settings."""

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
        r = find_overlap(train, val, self.overlap_ngram)  # non-token data: exact copies only (ngram 0)
        if not r["exact"] and not r["ngram_overlap"]:
            log.info("data_inspector: no val sample equals or shares a %d-token span with %d train samples",
                     r["ngram"], len(train))
            return
        ex = dict(r["example"])
        ex["text"] = self._decode(trainer, ex.pop("ids"))
        n_val = max(r["val_samples"], 1)
        frac = max(r["exact"], r["ngram_overlap"]) / n_val
        severe, by_chance = judge_overlap(r, self.overlap_warn_fraction)
        chance = float(r.get("train_self_duplicates", 0.0))
        where = f"val sample {ex['val_index']} / train sample {ex['train_index']}"
        code = "train_val_overlap" if severe else "train_val_overlap_small"
        what = (f"{r['exact']} val samples are exact copies of train samples and {r['ngram_overlap']} of "
                f"{r['val_samples']} share a {r['ngram']}-token span with train" if r["ngram"] else
                f"{r['exact']} of {r['val_samples']} val samples are exact copies of train samples, compared by value")
        why = (f"; {chance:.0%} of train samples repeat within train, so copies at this rate are the text's own "
               "repetition, not a leak" if by_chance else ": val loss overstates generalisation")
        self.report(trainer, "warning" if severe else "info", code,
                    f"{what} (e.g. {where}: "
                    f"{ex['text'][:120]!r}){why}",
                    advice="deduplicate documents before splitting; split by document, not by block",
                    details={**r, "example": ex, "fraction": frac}, rank=None)

    def _decode(self, trainer: Any, ids: list) -> str:
        tok = getattr(trainer.datamodule, "tokenizer", None)
        if tok is None or not all(isinstance(i, int) for i in ids):  # no tokenizer, or values (not token ids)
            return " ".join(map(str, ids))[: self.max_chars]
        return tok.decode(ids)[: self.max_chars]

    # ---- data order: every rank, its own file ----------------------------------------
    def _finish_order(self, trainer: Any) -> None:
        self._order_done = True
        held = [v for v in self._order if not isinstance(v, str)]  # fingerprints on the device: one host read
        if held:
            import torch

            read = iter(torch.stack([v.reshape(()) for v in held]).cpu().tolist())
            self._order = [v if isinstance(v, str) else f"{int(next(read)) & (2**64 - 1):016x}" for v in self._order]
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


def judge_overlap(r: dict[str, Any], warn_fraction: float) -> tuple[bool, bool]:
    """(severe, by chance) for ``find_overlap``'s result. Exact copies at about the rate train samples repeat
    among themselves are the text's own repetition (2-token samples repeat everywhere), not a leak; beyond
    twice that rate (or any copy, when train samples are unique) they are, as is an n-gram overlap above
    ``warn_fraction`` of the val samples."""
    n_val = max(int(r["val_samples"]), 1)
    chance = float(r.get("train_self_duplicates", 0.0))
    by_chance = (chance > 0 and r["exact"] / n_val <= 2 * chance and r["ngram_overlap"] / n_val <= warn_fraction
                 and (r["exact"] > 0 or r["ngram_overlap"] > 0))
    severe = not by_chance and (r["exact"] > 0 or max(r["exact"], r["ngram_overlap"]) / n_val > warn_fraction)
    return severe, by_chance

