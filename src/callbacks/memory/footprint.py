"""MemoryMonitor's helpers, pure or read-only: this process's RSS (from /proc/self/statm), the
growth rate of a series of samples, the model states ZeRO should hold per rank, and the OOM
advice ranked for a run's layout. Re-exported from memory.py."""

from __future__ import annotations

import os
from typing import Any

from dsdebug.models.model_states import paper_bytes

__all__ = ["expected_state_bytes", "growth", "oom_advice", "rss_bytes", "zero2_grad_elements", "zero2_grad_groups"]

GB, MB = 2**30, 2**20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_STATM: tuple[int, int] | None = None  # (pid, open fd of /proc/self/statm): re-read with pread, ~5x cheaper


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; psutil elsewhere)."""
    global _STATM
    try:
        if _STATM is None or _STATM[0] != os.getpid():
            _STATM = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_STATM[1], 128, 0).split()[1]) * _PAGE
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def growth(samples: list[tuple[int, int]]) -> tuple[float, float]:
    """(least-squares slope in MB/step, share of step-over-step increases) of (step, bytes) samples."""
    if len(samples) < 3:
        return 0.0, 0.0
    xs, ys = [s for s, _ in samples], [b / MB for _, b in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    ups = sum(b > a for a, b in zip(ys, ys[1:]))
    return slope, ups / (len(ys) - 1)


def expected_state_bytes(layout: str, psi: int, n: int, per_param: tuple[int, int, int],
                         persistent: int = 0, grad_elements: int | None = None) -> dict:
    """The paper's bytes per rank plus DeepSpeed's documented extras (see the module docstring).

    ``grad_elements``: the gradient elements this rank really holds under ZeRO-2
    (``zero2_grad_elements``): a parameter that straddles a partition boundary is kept whole, so
    a net of a few big tensors holds more than Psi/N; the difference is the ``straddle`` term."""
    param_b, grad_b, k = per_param
    formula = paper_bytes(layout, psi, n, param_b, grad_b, k)
    stage = 0 if layout == "ddp" else int(layout[4])
    extra = param_b * persistent * (1 - 1 / n) if stage == 3 else 0.0  # persistent params: whole on every rank
    if stage >= 1 and param_b == 4:
        extra += 4 * psi / n  # fp32 run: ZeRO keeps a separate fp32 master partition besides the fp32 params
    straddle = max(0.0, grad_b * grad_elements - formula["grads"]) if grad_elements is not None else 0.0
    return {**formula, "extra": extra + straddle, "straddle": straddle,
            "expected": formula["total"] + extra + straddle}


def zero2_grad_elements(groups: list[tuple[list[int], list[int], bool]], n: int, rank: int,
                        alignment_factor: int = 2) -> int:
    """Gradient elements rank ``rank`` holds under ZeRO-2, as DeepSpeed's ``stage_1_and_2`` lays them out.

    Per param group (``(numels, paddings, compact)`` in the flat order, ``round_robin_bit16_groups``):
    the flat buffer (each tensor + its alignment padding) is padded to a multiple of
    ``alignment_factor * n`` and cut in n equal partitions. Without offload and with gradients in the
    training dtype, ``copy_grads_in_partition`` keeps the gradient of EVERY parameter that overlaps
    the rank's partition WHOLE (``grads_in_partition`` is the sum of their numel, see
    ``get_partition_info``): a tensor across a boundary is held by both ranks. ``compact`` groups
    (fp32 gradient accumulation of half weights) hold exactly the partition instead."""
    total = 0
    for numels, paddings, compact in groups:
        flat = sum(numels) + sum(paddings)
        align = alignment_factor * n
        size = -(-flat // align) * align // n
        if compact:
            total += size
            continue
        start, end, at = size * rank, size * (rank + 1), 0
        for numel, pad in zip(numels, paddings):
            if start <= at < end or at < start < at + numel:
                total += numel
            at += numel + pad
    return total


def zero2_grad_groups(optimizer: Any) -> list[tuple[list[int], list[int], bool]] | None:
    """The param groups of a live ZeRO-2 optimizer for ``zero2_grad_elements`` (None: not ZeRO-2 with
    gradients on the device, so the paper's Psi/N holds). Reads only layout metadata, no tensor data."""
    groups = getattr(optimizer, "round_robin_bit16_groups", None)
    if not groups or not getattr(optimizer, "partition_gradients", False) or getattr(optimizer, "cpu_offload", False):
        return None
    paddings = getattr(optimizer, "round_robin_bit16_padding", None) or [[0] * len(g) for g in groups]
    compact = getattr(optimizer, "_use_compact_grad_partition_buffer", lambda i: False)
    return [([int(p.numel()) for p in g], [int(x) for x in pad], bool(compact(i)))
            for i, (g, pad) in enumerate(zip(groups, paddings))]


def oom_advice(phase: str, layout: str, checkpointing: bool, batch_size: Any, seq_len: Any) -> list[str]:
    """Seed-003 remedies, most useful first for this config and the phase that ran out."""
    stage = 0 if layout == "ddp" else int(layout[4])
    activations = []
    if isinstance(batch_size, int) and batch_size > 1:
        activations.append(f"halve data.batch_size (now {batch_size}) and double trainer.accumulate_grad_batches "
                           "to keep the global batch")
    if not checkpointing:
        activations.append("turn on gradient checkpointing (an activation_checkpointing section in a ds_config, "
                           "docs/ds_config.md): activations are recomputed in backward")
    if isinstance(seq_len, int) and seq_len > 64:
        activations.append(f"shorten data.seq_len (now {seq_len})")
    states = []
    if stage < 3:
        states.append(f"a higher ZeRO stage ({'strategy=zero3' if stage == 2 else 'strategy=zero2 or zero3'}): "
                      "shards optimizer states, gradients, then parameters across ranks")
    if "offload" not in layout:
        states.append(f"offload to CPU (strategy={'zero3' if stage == 3 else 'zero2'}_offload)")
    if phase == "optimizer":
        return states + activations
    return activations + states
