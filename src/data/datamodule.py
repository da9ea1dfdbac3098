"""`LMDataModule`: a text source -> cached token ids -> fixed-length packed blocks.

Token ids come from a byte-level BPE trained on the corpus (`vocab_size` tokens), or, when
`tokenizer` names one (a pretrained model's tokenizer directory or hub id), from that tokenizer;
`vocab_size` then follows it (`pretrained_tokenizer.py`).

Blocks (default): every document's ids followed by EOS, concatenated, cut into `seq_len` blocks
(no padding; a block may span documents). `packing=true`: whole documents instead, several per
row, positions restarting per document, no attention across them (`document_rows.py`); batches
then also carry `position_ids` and `doc_ids`. `token_budget=N`: train batches of about N tokens. The split is contiguous by token position: the
last ~`val_fraction` of the blocks is validation, so no token is in both splits.
Batches are ``{"input_ids": LongTensor[B, seq_len], "labels": same values}``; the model
shifts the labels.

Rank awareness: `prepare_data` runs on local rank 0 only (Lightning) and builds the cache;
`setup` runs on every rank, loads the cache, and builds it itself if it is missing (e.g.
`prepare_data` was not called, or nodes do not share `cache_dir`). Builds are atomic, so
racing ranks are safe (see `tokenizer.py`). Neither method calls a collective.

Example (conf/data/kjv.yaml)::

    _target_: dsdebug.data.datamodule.LMDataModule
    source: {_target_: dsdebug.data.corpus.KJVCorpus}
    vocab_size: 4096
    seq_len: 128
    tokenizer: ${oc.select:model.tokenizer,null}   # model=hf_pretrained: the model's own
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, SequentialSampler

from dsdebug.data.blocks import PackedBlocks, seed_worker
from dsdebug.data.corpus import Corpus, SyntheticCorpus, resolve_path
from dsdebug.data.document_rows import DocumentRows, trim_collate
from dsdebug.data.resumable import (
    EpochShuffleSampler,
    ResumableDataLoader,
    ResumePosition,
    batches_consumed_in_epoch,
)
from dsdebug.data.token_budget import (
    LR_RULES,
    LightningTokenBudgetSampler,
    TokenBudgetBatchSampler,
    lr_for_tokens,
)
from dsdebug.data.tokenizer import MIN_VOCAB_SIZE, ensure_cache
from dsdebug.errors import ConfigError

__all__ = ["LMDataModule", "SOURCES"]

SOURCES = "dsdebug.data.corpus.{KJVCorpus, TextFilesCorpus, HFDatasetCorpus, SyntheticCorpus}"

log = logging.getLogger(__name__)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_int(key: str, value, minimum: int, what: str) -> int:
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"data.{key} must be {what}, got {value!r}")
    return int(value)


def _as_source(source) -> Corpus:
    if isinstance(source, Corpus):
        return source
    if isinstance(source, Mapping) or hasattr(source, "_target_"):
        from hydra.utils import instantiate

        built = instantiate(source)
        if isinstance(built, Corpus):
            return built
        source = built
    raise ConfigError(f"data.source must be a corpus with _target_ one of {SOURCES}, got {source!r}")


class LMDataModule(L.LightningDataModule):
    """Language-model data: source -> tokenizer (cached ids) -> packed blocks.

    Args:
        source: a corpus from `dsdebug.data.corpus` (Hydra builds it from `data.source`).
        vocab_size: BPE vocabulary size (tokenizer size must equal it), or the id range of
            a synthetic source. Available before `setup`, so the model can be built first.
            With `tokenizer` set it is replaced by the tokenizer's id range (max id + 1).
        seq_len: tokens per block. batch_size: blocks per batch (per rank).
        num_workers, pin_memory: DataLoader settings; workers are persistent when > 0.
        val_fraction: share of blocks, taken from the end of the corpus, used for val.
        seed: seeds the train shuffle order (and nothing else).
        cache_dir: where tokenizers and token ids are cached, keyed by content.
        max_tokens: use only the first `max_tokens` tokens (quick runs); None = all.
        global_batch_size: blocks per optimizer step over all ranks, or None. The trainer
            derives `batch_size` from it before this is built (src/config/global_batch.py);
            `setup` checks that the two agree with the trainer's world size and accumulation.
        tokenizer: a pretrained tokenizer (directory or hub id) to encode the corpus with
            instead of training a BPE; ignored for a synthetic source. Loaded at construction.
        packing: whole documents (split at EOS), several per row, positions restarting per
            document and a per-document attention mask (``DocumentRows``, ``packing.py``); false =
            fixed blocks (a block may span documents). Not for a synthetic source (no documents).
        token_budget: tokens per rank per step, or None: train batches of a variable number of
            rows whose padded size stays within it (``token_budget.py``), on document rows (packed
            with ``packing``, else one document per row); every rank runs the same number of steps.
        token_budget_lr: none | linear | sqrt -- the LR rule per step for a token budget
            (``lr_for_tokens``: lr x (tokens / reference)^1 or ^0.5, reference = token_budget x
            world size x accumulation); applied by ``CausalLMModule``.

    After `setup` (at construction with `tokenizer`): `tokenizer` (a transformers tokenizer;
    None for synthetic), `pretrained` (`PretrainedTokenizer` or None),
    `tokenizer_dir`, `train_dataset`, `val_dataset` (`PackedBlocks`), `num_train_tokens`,
    `num_val_tokens`, `num_tokens`, `eos_token_id`, `pad_token_id`.
    """

    def __init__(
        self,
        source,
        vocab_size: int = 4096,
        seq_len: int = 128,
        batch_size: int = 8,
        num_workers: int = 0,
        pin_memory: bool = False,
        val_fraction: float = 0.05,
        seed: int = 42,
        cache_dir: str | os.PathLike = ".cache/data",
        max_tokens: int | None = None,
        global_batch_size: int | None = None,
        tokenizer: str | os.PathLike | None = None,
        packing: bool = False,
        token_budget: int | None = None,
        token_budget_lr: str = "none",
    ):
        super().__init__()
        self.source = _as_source(source)
        self.is_synthetic = isinstance(self.source, SyntheticCorpus)
        self.pretrained = None
        if tokenizer is not None and not self.is_synthetic:
            from dsdebug.data.pretrained_tokenizer import PretrainedTokenizer

            self.pretrained = PretrainedTokenizer(str(tokenizer))
            if vocab_size != self.pretrained.vocab_size:
                rank_zero_info(f"data.vocab_size={vocab_size} -> {self.pretrained.vocab_size}: "
                               f"it follows {self.pretrained!r}")
            vocab_size = self.pretrained.vocab_size
        min_vocab = 2 if self.is_synthetic or self.pretrained else MIN_VOCAB_SIZE
        self.vocab_size = _check_int(
            "vocab_size", vocab_size, min_vocab,
            f"an int >= {min_vocab}" + ("" if min_vocab == 2 else " (256 bytes + 2 special tokens)"),
        )
        self.seq_len = _check_int("seq_len", seq_len, 1, "a positive int")
        self.batch_size = _check_int("batch_size", batch_size, 1, "a positive int")
        self.num_workers = _check_int("num_workers", num_workers, 0, "an int >= 0")
        if not isinstance(pin_memory, bool):
            raise ConfigError(f"data.pin_memory must be true or false, got {pin_memory!r}")
        self.pin_memory = pin_memory
        if (
            not isinstance(val_fraction, (int, float)) or isinstance(val_fraction, bool)
            or not 0 < val_fraction <= 0.5
        ):
            raise ConfigError(f"data.val_fraction must be in (0, 0.5], got {val_fraction!r}")
        self.val_fraction = float(val_fraction)
        if not _is_int(seed):
            raise ConfigError(f"data.seed must be an int, got {seed!r}")
        self.seed = int(seed)
        if not isinstance(cache_dir, (str, os.PathLike)) or not str(cache_dir):
            raise ConfigError(f"data.cache_dir must be a directory path, got {cache_dir!r}")
        self.cache_dir = str(resolve_path(cache_dir))
        if max_tokens is not None:
            max_tokens = _check_int("max_tokens", max_tokens, 1, "a positive int or null")
        self.max_tokens = max_tokens
        if global_batch_size is not None:
            global_batch_size = _check_int("global_batch_size", global_batch_size, 1, "a positive int or null")
        self.global_batch_size = global_batch_size
        if not isinstance(packing, bool):
            raise ConfigError(f"data.packing={packing!r} is invalid; valid: true, false")
        if token_budget is not None:
            token_budget = _check_int("token_budget", token_budget, self.seq_len,
                                      f"null or an int >= data.seq_len={self.seq_len} (tokens per rank per step)")
        if token_budget_lr not in LR_RULES:
            raise ConfigError(f"data.token_budget_lr={token_budget_lr!r} is invalid; valid: {', '.join(LR_RULES)}")
        if token_budget_lr != "none" and token_budget is None:
            raise ConfigError(f"data.token_budget_lr={token_budget_lr} needs data.token_budget=<tokens>; "
                              "valid: data.token_budget_lr=none, or set data.token_budget")
        if (packing or token_budget is not None) and self.is_synthetic:
            key = "data.packing=true" if packing else "data.token_budget"
            raise ConfigError(f"{key}: a synthetic source has no documents to pack or batch by length; "
                              "valid: data=kjv, data=text_files or data=hf_dataset (or leave it off)")
        self.packing, self.token_budget, self.token_budget_lr = packing, token_budget, token_budget_lr
        #: document rows (packing or token budget) instead of fixed blocks
        self.by_document = packing or token_budget is not None

        self.tokenizer = None if self.pretrained is None else self.pretrained.tokenizer
        self.tokenizer_dir: str | None = None
        self.eos_token_id: int | None = None if self.pretrained is None else self.pretrained.eos_token_id
        self.pad_token_id: int | None = None if self.pretrained is None else self.pretrained.pad_token_id
        self.train_dataset: PackedBlocks | DocumentRows | None = None
        self._position = ResumePosition()
        self.val_dataset: PackedBlocks | None = None
        self.num_tokens: int | None = None
        self.num_train_tokens: int | None = None
        self.num_val_tokens: int | None = None

    # -- Lightning hooks ------------------------------------------------------------

    def prepare_data(self) -> None:
        """Local rank 0 only: train the tokenizer (or take the pretrained one) and encode the corpus
        into the cache."""
        if not self.is_synthetic:
            ensure_cache(self.source, self.vocab_size, self.cache_dir, self.pretrained)

    def setup(self, stage: str | None = None) -> None:
        """Every rank: load (or build) the cache and cut the packed train/val blocks."""
        if self.train_dataset is not None:
            return
        if self.is_synthetic:
            tokens = self.source.token_ids(self.vocab_size)
        elif self.pretrained is not None:
            cache = ensure_cache(self.source, self.vocab_size, self.cache_dir, self.pretrained)
            self.tokenizer_dir = str(cache.tokenizer_dir)
            tokens = cache.load_tokens()
        else:
            cache = ensure_cache(self.source, self.vocab_size, self.cache_dir)
            tokenizer = cache.load_tokenizer()
            if len(tokenizer) != self.vocab_size:
                raise ConfigError(
                    f"data.vocab_size={self.vocab_size} but the cached tokenizer "
                    f"{cache.tokenizer_dir} has {len(tokenizer)} tokens; delete that cache entry"
                )
            self.tokenizer, self.tokenizer_dir = tokenizer, str(cache.tokenizer_dir)
            self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
            tokens = cache.load_tokens()
        if self.max_tokens is not None:
            tokens = tokens[: self.max_tokens]

        n_blocks = len(tokens) // self.seq_len
        n_val = max(1, round(n_blocks * self.val_fraction))
        n_train = n_blocks - n_val
        world = self.trainer.world_size if self.trainer is not None else 1
        self._check_global_batch(world)
        if self.by_document:  # the same token split as the blocks: no token in both splits
            self._setup_documents(tokens, n_train * self.seq_len, n_blocks * self.seq_len, world)
            return
        if n_train < self.batch_size * world:
            ranks = f" x {world} ranks" if world > 1 else ""
            raise ConfigError(
                f"corpus too small: {max(n_train, 0)} train blocks of data.seq_len={self.seq_len} "
                f"< data.batch_size={self.batch_size}{ranks}; "
                "lower data.batch_size/data.seq_len or add text"
            )
        self.train_dataset = PackedBlocks(tokens, self.seq_len, 0, n_train)
        self.val_dataset = PackedBlocks(tokens, self.seq_len, n_train * self.seq_len, n_val)
        self.num_tokens = len(tokens)
        self.num_train_tokens = n_train * self.seq_len
        self.num_val_tokens = n_val * self.seq_len
        rank_zero_info(
            f"data: {self.source!r}: {len(tokens):,} tokens -> {n_train:,} train / {n_val:,} val "
            f"blocks of {self.seq_len} (vocab {self.vocab_size}, cache {self.tokenizer_dir})"
        )

    def _setup_documents(self, tokens: np.ndarray, split: int, end: int, world: int) -> None:
        """Document rows for both splits (packing / token budget): whole documents, never spanning."""
        if self.eos_token_id is None:
            key = "data.packing=true" if self.packing else "data.token_budget"
            raise ConfigError(f"{key}: the tokenizer has no EOS token, so the token cache has no document "
                              "boundaries; valid: a tokenizer with an EOS token, or data.packing=false and "
                              "data.token_budget=null")
        pad = self.pad_token_id if self.pad_token_id is not None else (self.eos_token_id or 0)
        rows = dict(eos_id=self.eos_token_id, seq_len=self.seq_len, pad_id=pad, packed=self.packing)
        self.train_dataset = DocumentRows(tokens[:split], **rows)
        self.val_dataset = DocumentRows(tokens[split:end], **rows)
        n_train, n_val = len(self.train_dataset), len(self.val_dataset)
        if self.token_budget is not None:
            steps = len(TokenBudgetBatchSampler(self.train_dataset.lengths, self.token_budget, num_replicas=world))
            too_small = steps < 1
        else:
            too_small = n_train < self.batch_size * world
        if too_small or n_val < 1:
            ranks = f" x {world} ranks" if world > 1 else ""
            raise ConfigError(f"corpus too small: {n_train} train rows of data.seq_len={self.seq_len} for "
                              f"data.batch_size={self.batch_size}{ranks} (data.token_budget={self.token_budget}); "
                              "lower data.batch_size/data.seq_len or add text")
        self.num_tokens = len(tokens)
        self.num_train_tokens = sum(self.train_dataset.lengths)
        self.num_val_tokens = sum(self.val_dataset.lengths)
        pad_share = 1 - self.num_train_tokens / max(n_train * self.seq_len, 1)
        how = "packed several per row" if self.packing else "one per row"
        rank_zero_info(
            f"data: {self.source!r}: {self.train_dataset.num_documents:,} train documents {how} -> {n_train:,} "
            f"train / {n_val:,} val rows of {self.seq_len} ({pad_share:.1%} padding; positions restart per "
            f"document, no attention across documents; vocab {self.vocab_size}, cache {self.tokenizer_dir})")
        if self.token_budget is not None:
            rule = {"none": "none (the LR is not scaled)", "linear": "linear (lr x tokens / reference)",
                    "sqrt": "sqrt (lr x sqrt(tokens / reference))"}[self.token_budget_lr]
            rank_zero_info(
                f"data: token budget {self.token_budget} tokens per rank per step (batches of a variable number of "
                f"rows); data.token_budget_lr={rule}, reference {self.reference_tokens_per_step} tokens per step")

    @property
    def reference_tokens_per_step(self) -> int | None:
        """The tokens per optimizer step the LR was set for: token_budget x world size x accumulation."""
        if self.token_budget is None:
            return None
        accum = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        return self.token_budget * self._world_size() * accum

    def lr_scale_for(self, tokens: int) -> float:
        """data.token_budget_lr: the factor on the scheduled LR for an optimizer step of ``tokens``
        (non-padding, all ranks); 1.0 without a token budget or with the rule ``none``."""
        reference = self.reference_tokens_per_step
        return 1.0 if reference is None else lr_for_tokens(1.0, tokens, reference, self.token_budget_lr)

    def train_dataloader(self) -> DataLoader:
        # Order is a function of (seed, epoch) and resumes mid-epoch exactly (resumable.py).
        self._require_setup()
        if self.token_budget is not None:
            # Lightning replaces `sampler` by its DistributedSampler under DDP/DeepSpeed (rank, world)
            batches = LightningTokenBudgetSampler(SequentialSampler(self.train_dataset), self.train_dataset.lengths,
                                                  self.token_budget, seed=self.seed)
            return ResumableDataLoader(self.train_dataset, batch_sampler=batches, collate_fn=trim_collate,
                                       num_workers=self.num_workers, pin_memory=self.pin_memory,
                                       persistent_workers=self.num_workers > 0,
                                       worker_init_fn=seed_worker if self.num_workers > 0 else None,
                                       position=self._position)
        sampler = EpochShuffleSampler(self.train_dataset, seed=self.seed)
        return self._loader(self.train_dataset, sampler=sampler, drop_last=True,
                            loader_cls=ResumableDataLoader, position=self._position)

    def val_dataloader(self) -> DataLoader:
        self._require_setup()
        return self._loader(self.val_dataset, shuffle=False, drop_last=False)

    # -- helpers ----------------------------------------------------------------------

    def _check_global_batch(self, world: int) -> None:
        if self.global_batch_size is None:
            return
        accum = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        actual = self.batch_size * world * accum
        if actual != self.global_batch_size:
            raise ConfigError(
                f"data.global_batch_size={self.global_batch_size} but data.batch_size={self.batch_size} x "
                f"world size {world} x accumulation {accum} = {actual}; valid: leave data.batch_size to be "
                "derived from it (train.py does), or data.global_batch_size=null"
            )

    def _require_setup(self) -> None:
        if self.train_dataset is None:
            self.setup("fit")

    def state_dict(self) -> dict[str, int]:
        """Saved in every checkpoint: where in the epoch the data stream was (per rank, and the
        batch geometry, so a resume under another world size or batch size finds its place)."""
        dropped = self._position.dropped  # excluded batches (exclude_batches): raw position = processed + dropped
        return {"batches_consumed_in_epoch": batches_consumed_in_epoch(self.trainer) + dropped,
                "dropped_in_epoch": dropped, "world_size": self._world_size(), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        skip = int(state.get("batches_consumed_in_epoch", 0))
        old = (int(state.get("world_size", 0)), int(state.get("batch_size", 0)))
        new = (self._world_size(), self.batch_size)
        if self.token_budget is not None:
            if all(old) and old[0] != new[0]:
                # token-budget batches hold a variable number of rows: no batch count maps across world sizes
                log.warning("resume: data.token_budget batches were dealt to %d ranks, now %d: the position in "
                            "the epoch cannot be carried over; this epoch starts again from its first batch",
                            old[0], new[0])
                skip = 0
        elif all(old) and old != new:
            # the sampler deals one global permutation out rank by rank: skip the same samples
            samples = skip * old[0] * old[1]
            skip = samples // (new[0] * new[1])
            if samples % (new[0] * new[1]):
                log.warning("resume: %d samples consumed is not a whole number of %d-rank x %d batches; "
                            "skipping %d batches per rank", samples, new[0], new[1], skip)
        self._position.skip = skip
        self._position.dropped_at_skip = int(state.get("dropped_in_epoch", 0)) if not all(old) or old == new else 0

    def exclude_batches(self, epoch: int, first: int, last: int) -> None:
        """Never train on batch positions ``first..last`` (per rank, inclusive) of ``epoch``'s order:
        the loss_spike check calls it on a resume, for batches a rollback skipped."""
        self._position.excluded.setdefault(int(epoch), []).append((int(first), int(last)))

    def _world_size(self) -> int:
        trainer = getattr(self, "trainer", None)
        return int(trainer.world_size) if trainer is not None else 1

    def _loader(self, dataset: PackedBlocks, loader_cls: type = DataLoader, **kwargs) -> DataLoader:
        return loader_cls(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            worker_init_fn=seed_worker if self.num_workers > 0 else None,
            **kwargs,
        )

    @property
    def cache_path(self) -> Path | None:
        return Path(self.tokenizer_dir).parent if self.tokenizer_dir else None
