"""CPU memory allocator settings of a training process (``malloc_tuning``, conf/train.yaml).

Why (docs/benchmarks.md 2b): a training step frees and re-allocates the same large
host tensors every step (activations, logits, gradient buckets, optimizer temporaries). With
glibc's defaults the threshold between heap and ``mmap`` allocations moves as the process runs
and the heap top is handed back to the OS once 2x that threshold is free, so from some point
on a rank page-faults the same memory in again every step. Which rank ends up there depends on
the allocation history: on the default 2-rank CPU run one rank page-faulted 2-3x as often as the other
and as the hand-written loop, with the settings below every rank as little as the best (the fault
counts and system time: docs/benchmarks.md 2c).

``tune_malloc(True)`` (the default) fixes the mmap threshold at glibc's ceiling (32 MiB on
64-bit: smaller blocks come from the heap and are reused) and never trims the heap top, with
``mallopt`` at startup on every rank. The cost: freed heap memory is kept for reuse, so a
rank's resident size stays at its peak instead of shrinking between steps. Numerics are
untouched (the same tensors, the same kernels).

Left alone: non-glibc libcs (musl, macOS), a malloc preloaded in its place (``LD_PRELOAD``
jemalloc/tcmalloc/mimalloc), and glibc's own ``MALLOC_*_`` environment variables when set: the
user's choice wins.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Any

__all__ = ["ENV_KEYS", "MMAP_THRESHOLD", "PRELOADED", "TRIM_THRESHOLD", "describe", "tune_malloc"]

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap top is never handed back
ENV_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")

_applied: dict[str, Any] | None = None


def tune_malloc(enabled: bool) -> dict[str, Any]:
    """Apply the settings (once per process) when ``enabled``; returns what this process runs with."""
    global _applied
    if _applied is not None:
        return _applied
    state = _why_not(enabled)
    if state is None:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        state = {"allocator": "glibc", "tuned": ok, "mmap_threshold": MMAP_THRESHOLD, "trim_threshold": "never"} \
            if ok else {"allocator": "glibc", "tuned": False, "why": "mallopt refused the settings"}
    _applied = state
    log.info("host allocator: %s", describe(state))
    return state


def describe(state: dict[str, Any]) -> str:
    """One line for the rank logs."""
    if state.get("tuned"):
        return (f"{state['allocator']} malloc keeps freed memory (mmap threshold {state['mmap_threshold'] >> 20} MiB, "
                "heap never trimmed; malloc_tuning=false for glibc's defaults)")
    return f"{state['allocator']}, not tuned ({state['why']})"


def _why_not(enabled: bool) -> dict[str, Any] | None:
    """None when the settings apply here, else what the process keeps and why."""
    if not enabled:
        return {"allocator": _libc_name(), "tuned": False, "why": "malloc_tuning=false"}
    preload = os.environ.get("LD_PRELOAD", "")
    other = next((name for name in PRELOADED if name in preload), None)
    if other:
        return {"allocator": other, "tuned": False, "why": f"LD_PRELOAD={preload}"}
    env = [k for k in ENV_KEYS if k in os.environ]
    if env:
        return {"allocator": "glibc", "tuned": False, "why": f"{env[0]} is set in the environment"}
    if _libc_name() != "glibc":
        return {"allocator": _libc_name(), "tuned": False, "why": "not glibc"}
    return None


def _libc_name() -> str:
    if not sys.platform.startswith("linux"):
        return sys.platform
    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except (OSError, AttributeError):
        return "non-glibc libc"
    return "glibc"
