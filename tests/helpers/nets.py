"""A user's own network, plugged in with model.net._target_=tests.helpers.nets.TinyLM."""

from __future__ import annotations

import torch


class TinyLM(torch.nn.Module):
    """Embedding -> GRU -> vocab logits; returns a plain tensor (no .logits)."""

    def __init__(self, vocab_size: int, hidden_size: int = 64, **_ignored) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, hidden_size)
        self.rnn = torch.nn.GRU(hidden_size, hidden_size, batch_first=True)
        self.head = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(input_ids))
        return self.head(hidden)
