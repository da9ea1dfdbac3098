"""ReplicaParity's tensor math, pure: bit-exact position-weighted checksums of tensors, the
per-rank comparison of gathered checksums (who differs from the majority), scalar packing.
Re-exported from replica_parity.py."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["checksums", "divergent"]

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PRIME = 65521  # position weights 1..65521: a swap of two elements changes the weighted sum


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_INT[flat.element_size()]) if flat.is_floating_point() else flat.to(torch.int64)
    return bits.to(torch.int32) if bits.element_size() < 4 else bits


def checksums(tensors: list[torch.Tensor], weights: dict[torch.device, torch.Tensor] | None = None,
              device: torch.device | str | None = None) -> torch.Tensor:
    """``[len(tensors) x 3]`` int64 on ``device`` (default: CPU): bit sum, position-weighted bit sum (both
    exact: integer sums wrap, so the order of summation cannot change them), value sum (for messages, as
    fp64 bits).

    Each tensor's sums are computed on its own device (CUDA parameters, a CPU scalar, a ZeRO-offloaded
    CPU copy side by side), with the position weights made there once and kept in ``weights`` (device ->
    weights; pass the same dict on every call). Nothing is read on the host here: the rows of each
    device are stacked and moved to ``device`` in one copy per source device (the caller reads the
    gathered table once)."""
    out_device = torch.device("cpu") if device is None else torch.device(device)
    weights = {} if weights is None else weights
    longest = max((t.numel() * (2 if t.is_complex() else 1) for t in tensors), default=0)
    rows: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    with torch.no_grad():
        for i, t in enumerate(tensors):
            bits = _bits(t)
            w = _weights_on(weights, bits.device, longest)[: bits.numel()]
            acc = bits.dtype  # int32 sums wrap mod 2^32: exact, order-free, ~20x faster than an int64 sum
            value = t.detach().sum() if t.is_floating_point() else t.detach().double().sum()  # message only
            row = torch.stack([bits.sum(dtype=acc).to(torch.int64), (bits * w).sum(dtype=acc).to(torch.int64),
                               value.double().reshape(1).view(torch.int64)[0]])
            rows.setdefault(bits.device, []).append((i, row))
        parts: list[torch.Tensor | None] = [None] * len(tensors)
        for dev_rows in rows.values():
            # one copy per source device; from the CPU without waiting (a CPU->GPU copy does not sync the GPU)
            block = torch.stack([r for _, r in dev_rows])
            moved = block.to(out_device, non_blocking=block.device.type == "cpu")
            for j, (i, _) in enumerate(dev_rows):
                parts[i] = moved[j]
    return torch.stack(parts) if parts else torch.zeros(0, 3, dtype=torch.int64, device=out_device)


def _weights_on(weights: dict[torch.device, torch.Tensor], device: torch.device, length: int) -> torch.Tensor:
    """Position weights ``1..65521`` (repeating) of at least ``length`` on ``device``, made there (no copy)."""
    have = weights.get(device)
    if have is None or have.numel() < length:
        have = weights[device] = torch.arange(length, dtype=torch.int32, device=device) % _PRIME + 1
    return have


def divergent(gathered: torch.Tensor) -> list[tuple[int, list[int], list[int]]]:
    """``[(entry, reference ranks, outlier ranks)]`` for each entry whose exact checksums differ
    across ranks. ``gathered``: ``[world x n x 3]``. Reference = largest group (rank 0's on a tie)."""
    out = []
    exact = gathered[:, :, :2]
    differs = (exact != exact[:1]).any(dim=2).any(dim=0)
    for i in differs.nonzero().flatten().tolist():
        groups: dict[tuple, list[int]] = {}
        for r, key in enumerate(map(tuple, exact[:, i].tolist())):
            groups.setdefault(key, []).append(r)
        ref = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
        out.append((i, ref, [r for r in range(gathered.shape[0]) if r not in ref]))
    return out


def _fp64(packed: int) -> float:
    return torch.tensor([packed], dtype=torch.int64).view(torch.float64).item()


def _scalar(value: Any) -> torch.Tensor:
    v = float(value) if value is not None else float("nan")
    return torch.tensor([v], dtype=torch.float64)
