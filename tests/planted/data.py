"""Planted bugs for the reproducibility, data_inspector and profiler callbacks (and a witness of torch's
deterministic flags, ``FlagWitness``).

Importable from a child process (``model.net._target_=tests.planted.data.NoisyLM``,
``data._target_=tests.planted.data.BuggyDataModule``). Each class plants one or more bugs
a real run can have; the callbacks' tests check that each is found and named.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import Sampler
from torch.utils.data.dataloader import default_collate

from dsdebug.data.datamodule import LMDataModule, PackedBlocks
from dsdebug.data.resumable import EpochShuffleSampler, ResumableDataLoader


class UnseededNoise(nn.Module):
    """Adds noise from a fresh generator seeded from os.urandom each call: restoring torch's
    RNG state cannot reproduce it (a nondeterministic op seeding cannot fix)."""

    def __init__(self, scale: float = 0.1) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator(device=x.device).manual_seed(int.from_bytes(os.urandom(7), "little"))
        return x + self.scale * torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)


class NoisyLM(nn.Module):
    """A small causal LM (embedding -> noise -> MLP -> head) with the planted noise module."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **_: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.noise = UnseededNoise()
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab_size)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.noise(self.embed(input_ids))
        return self.head(h + self.mlp(h))


class HealthyTinyLM(NoisyLM):
    """The same small net without the noise (fast healthy runs)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.noise = nn.Identity()


class UrandomSampler(Sampler):
    """Shuffles with a seed drawn from os.urandom: the order ignores the run seed."""

    def __init__(self, data_source) -> None:
        self.n = len(data_source)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))
        yield from torch.randperm(self.n, generator=g).tolist()


class ShiftedLabelBlocks(PackedBlocks):
    """Labels already shifted by one (labels[t] = input_ids[t+1]); the module shifts again."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        labels = torch.full_like(item["input_ids"], -100)
        labels[:-1] = item["input_ids"][1:]
        return {"input_ids": item["input_ids"], "labels": labels}


def slow_collate(samples, delay: float = 0.25):
    time.sleep(delay)  # a tokeniser/augmentation that is far slower than the model step
    return default_collate(samples)


class BuggyDataModule(LMDataModule):
    """The default packed data with four planted bugs, each switchable:

    - ``leak_val``: val blocks are train text shifted by half a block (no exact copies, so
      only the n-gram overlap scan finds them);
    - ``urandom_order``: the train sampler ignores the seed;
    - ``shift_labels``: labels arrive pre-shifted (double shift with CausalLMModule);
    - ``slow_collate``: the train collate sleeps ``collate_delay`` seconds per batch.
    """

    def __init__(self, *args, leak_val: bool = True, urandom_order: bool = True, shift_labels: bool = True,
                 slow_collate: bool = True, collate_delay: float = 0.25, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leak_val, self.urandom_order, self.shift_labels = leak_val, urandom_order, shift_labels
        self.slow_collate, self.collate_delay = slow_collate, collate_delay

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        super().setup(stage)
        tr, va = self.train_dataset, self.val_dataset
        if self.shift_labels:
            self.train_dataset = ShiftedLabelBlocks(tr.tokens, tr.seq_len, tr.start, tr.num_blocks)
        if self.leak_val:
            self.val_dataset = PackedBlocks(tr.tokens, tr.seq_len, tr.seq_len // 2 + 8 * tr.seq_len, va.num_blocks)

    def train_dataloader(self):
        self._require_setup()
        if self.urandom_order:
            sampler = UrandomSampler(self.train_dataset)
        else:
            sampler = EpochShuffleSampler(self.train_dataset, seed=self.seed)
        extra = {"collate_fn": _SlowCollate(self.collate_delay)} if self.slow_collate else {}
        return self._loader(self.train_dataset, sampler=sampler, drop_last=True, loader_cls=ResumableDataLoader,
                            position=self._position, **extra)


class _SlowCollate:
    __name__ = "slow_collate"

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, samples):
        return slow_collate(samples, self.delay)


class FlagWitness(Callback):
    """Witness: torch's deterministic flags as the first training batch sees them (after every callback's
    ``setup`` and the Trainer's own flag setting), written to ``<run_dir>/torch_flags.json`` by rank 0."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != 0 or trainer.global_rank != 0:
            return
        flags = {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                 "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                 "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
                 "cudnn_deterministic": torch.backends.cudnn.deterministic,
                 "cudnn_benchmark": torch.backends.cudnn.benchmark,
                 "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
        Path(trainer.default_root_dir, "torch_flags.json").write_text(json.dumps(flags))
