"""MemoryMonitor's helpers, pure or read-only: this process's RSS (from /proc/self/statm), the
growth rate of a series of samples, the model states ZeRO should hold per rank, and the OOM
advice ranked for a run's layout. Re-exported from memory.py."""

from __future__ import annotations

import os
from typing import Any

from dsdebug.models.model_states import paper_bytes

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
                         persistent: int = 0) -> dict:
    """The paper's bytes per rank plus DeepSpeed's documented extras (see the module docstring)."""
    param_b, grad_b, k = per_param
    formula = paper_bytes(layout, psi, n, param_b, grad_b, k)
    stage = 0 if layout == "ddp" else int(layout[4])
    extra = param_b * persistent * (1 - 1 / n) if stage == 3 else 0.0  # persistent params: whole on every rank
    if stage >= 1 and param_b == 4:
        extra += 4 * psi / n  # fp32 run: ZeRO keeps a separate fp32 master partition besides the fp32 params
    return {**formula, "extra": extra, "expected": formula["total"] + extra}


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
