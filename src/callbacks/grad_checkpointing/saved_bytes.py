"""Bytes of activations autograd keeps for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``.

Works on every device (CPU included, where no allocator statistics exist): each tensor saved for
backward is counted once per storage; parameters (and views of them) are weights, not activations,
and are left out. The hooks return the tensor unchanged, so the maths is untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SavedBytes"]


class SavedBytes:
    """``with SavedBytes() as counter: <forward>`` -> ``counter.bytes``: distinct activation storages saved.
    ``enter()``/``exit()`` do the same across two hooks (the forward runs between them)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self._ctx: Any = None

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def add(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (block inputs the checkpoint keeps by reference, not as a saved tensor)."""
        if isinstance(tensor, torch.Tensor) and not _is_weight(tensor):
            try:
                storage = tensor.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
                pass

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    def enter(self) -> None:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._ctx.__enter__()

    def exit(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def __enter__(self) -> SavedBytes:
        self.enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.exit()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _is_weight(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter)
