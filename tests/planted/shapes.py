"""Nets with the parameter and buffer shapes users write, each on the small healthy LM
(embedding -> MLP -> head, tests/planted/data.py): for tests/trainer/test_param_shapes.py.

Importable from a child process (``model.net._target_=tests.planted.shapes.GatedLM``). Each class
adds one thing to the healthy net, and each is used in forward so a wrong engine shows in the loss.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.planted.data import HealthyTinyLM


class GatedLM(HealthyTinyLM):
    """A 0-dim parameter: a ReZero/LayerScale-style gate on the MLP branch (``nn.Parameter(torch.ones(()))``)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.gate = nn.Parameter(torch.full((), 0.5))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.head(h + self.gate * self.mlp(h))


class NestedGateLM(HealthyTinyLM):
    """0-dim parameters inside submodules (a scale per block, the way LayerScale/ReZero nets hold them)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.blocks = nn.ModuleList([_GatedBlock(hidden) for _ in range(2)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h + self.mlp(h))


class _GatedBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.alpha = nn.Parameter(torch.full((), 0.25))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.alpha * torch.tanh(self.fc(h))


class SharedLinearLM(HealthyTinyLM):
    """One nn.Linear called twice in forward (module reuse: registered once)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + self.mlp[2](torch.relu(self.mlp[0](h)))
        h = h + self.mlp[2](torch.relu(self.mlp[0](h)))
        return self.head(h)


class SharedParamLM(HealthyTinyLM):
    """The same nn.Parameter registered in two modules (``b.weight = a.weight``), not the embedding/head pair."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.down = nn.Linear(hidden, hidden)
        self.up = nn.Linear(hidden, hidden)
        self.up.weight = self.down.weight  # tied: one tensor, two owners

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + torch.tanh(self.up(torch.tanh(self.down(h))))
        return self.head(h + self.mlp(h))


class TiedHeadLM(HealthyTinyLM):
    """The embedding/head pair tied (the usual weight tying): the baseline the other ties are compared with."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.head.weight = self.embed.weight


class IntBufferLM(HealthyTinyLM):
    """Non-float buffers: an int64 step counter (incremented in training forward) and a bool mask."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        mask = torch.ones(hidden, dtype=torch.bool)
        mask[::4] = False
        self.register_buffer("keep", mask)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
        h = self.embed(input_ids) * self.keep
        return self.head(h + self.mlp(h))


class EmptyParamLM(HealthyTinyLM):
    """A parameter with no elements (``nn.Parameter(torch.empty(0))``: a placeholder, a bias of width 0)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.extra = nn.Parameter(torch.empty(0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.extra.sum()
        return self.head(h + self.mlp(h))


class TransposedParamLM(HealthyTinyLM):
    """A non-contiguous parameter (a transposed view made a Parameter)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.proj = nn.Parameter(torch.randn(hidden, hidden // 2).t() * hidden ** -0.5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + torch.tanh(h @ self.proj.t() @ self.proj)
        return self.head(h + self.mlp(h))


class Float64ParamLM(HealthyTinyLM):
    """A float64 parameter among float32 ones (a precise scale, a physics constant learned in double)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.scale = nn.Parameter(torch.ones(hidden, dtype=torch.float64))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * self.scale.to(torch.float32)
        return self.head(h + self.mlp(h))


class ComplexParamLM(HealthyTinyLM):
    """A complex parameter (a learned rotation in the complex plane, as in some positional schemes)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.rot = nn.Parameter(torch.ones(hidden // 2, dtype=torch.complex64))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        z = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2).contiguous()) * self.rot
        h = torch.view_as_real(z).reshape(h.shape)
        return self.head(h + self.mlp(h))


class UnusedParamLM(HealthyTinyLM):
    """A parameter forward never uses (a leftover head): it gets no gradient."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.unused = nn.Linear(hidden, hidden)


class OddShapesLM(HealthyTinyLM):
    """Every shape the engines take once the framework has seen to them, in one net (one run per
    strategy): a 0-dim gate at the top, a 0-dim scale in each of two blocks, a non-contiguous
    parameter, a weight registered in two modules, an int64 step counter and a bool mask buffer."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, **kw: object) -> None:
        super().__init__(vocab_size, hidden, **kw)
        self.gate = nn.Parameter(torch.full((), 0.5))
        self.blocks = nn.ModuleList([_GatedBlock(hidden) for _ in range(2)])
        self.proj = nn.Parameter(torch.randn(hidden, hidden // 2).t() * hidden ** -0.5)
        self.down = nn.Linear(hidden, hidden)
        self.up = nn.Linear(hidden, hidden)
        self.up.weight = self.down.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        mask = torch.ones(hidden, dtype=torch.bool)
        mask[::4] = False
        self.register_buffer("keep", mask)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
        h = self.embed(input_ids) * self.keep
        for block in self.blocks:
            h = block(h)
        h = h + torch.tanh(h @ self.proj.t() @ self.proj)
        h = h + torch.tanh(self.up(torch.tanh(self.down(h))))
        return self.head(h + self.gate * self.mlp(h))
