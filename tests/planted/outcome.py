"""Planted outcome bugs for outcome_monitor.

``model.net._target_=tests.planted.outcome.EvalBugLM``: the eval-mode forward multiplies the logits by
``factor`` (an eval-only branch gone wrong): validation is far worse than an untrained model while
training improves. ``model.net._target_=tests.planted.outcome.PeekingLM``: each position also sees the
NEXT token (a causal mask that leaks): the training loss sits near zero.
"""

from __future__ import annotations

import torch

from tests.planted.data import HealthyTinyLM


class EvalBugLM(HealthyTinyLM):
    def __init__(self, vocab_size: int = 4096, hidden: int = 64, factor: float = 30.0, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.factor = factor

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = super().forward(input_ids)
        return logits if self.training else logits * self.factor


class PeekingLM(HealthyTinyLM):
    """Position t reads token t+1 (a causal mask that leaks): its logits get ``peek`` on the token it must
    predict, so the training loss sits near zero from the start."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, peek: float = 12.0, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.vocab_size, self.peek = vocab_size, peek

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        nxt = torch.roll(input_ids, shifts=-1, dims=1)
        return super().forward(input_ids) + self.peek * torch.nn.functional.one_hot(nxt, self.vocab_size)
