"""Healthy custom nets for the "silent on healthy runs" tests: nothing is planted.

``model.net._target_=tests.planted.healthy_nets.TwoBigLinearLM``: an embedding and two large Linear
layers (most of the parameters sit in two tensors), the shape that once raised a false
``memory/model_states_unexpected`` under 2-rank ZeRO-2 (one big tensor cannot be split evenly).
"""

from __future__ import annotations

import torch
from torch import nn


class TwoBigLinearLM(nn.Module):
    """Embedding (vocab x hidden) -> Linear(hidden, wide) -> GELU -> Linear(wide, vocab): two big weights."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, wide: int = 512, **_: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.up = nn.Linear(hidden, wide)
        self.head = nn.Linear(wide, vocab_size)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.up(self.embed(input_ids))))
