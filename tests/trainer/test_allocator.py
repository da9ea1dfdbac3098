"""malloc_tuning (src/trainer/allocator.py): glibc stops handing freed memory back to the OS.

The planted pattern is what a training step does to the heap, small: a block freed (glibc raises
its mmap threshold to that size and its trim threshold to twice it), then every "step" several
blocks just under the threshold are allocated, written and freed, so the free top of the heap
exceeds the trim threshold and glibc returns it, and the next step page-faults it in again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsdebug.trainer import allocator

pytestmark = pytest.mark.skipif(allocator._libc_name() != "glibc", reason="glibc's mallopt only")

STEPS = """
import ctypes, json, resource, sys
tune = sys.argv[1] == "tuned"
if tune:
    from dsdebug.trainer.allocator import tune_malloc
    state = tune_malloc(True)
else:
    state = None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
MB = 1 << 20
first = libc.malloc(MB); libc.memset(first, 1, MB); libc.free(first)
def step():
    blocks = [libc.malloc(900 * 1024) for _ in range(4)]
    for b in blocks:
        libc.memset(b, 1, 900 * 1024)
    for b in blocks:
        libc.free(b)
step(); step()  # warm
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "state": state}))
"""


def _steps(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuning_stops_the_heap_being_returned_and_faulted_in_again_every_step():
    default, tuned = _steps("default"), _steps("tuned")
    # 20 steps x 3.6 MB handed back and touched again: ~880 faults a step with glibc's defaults
    assert default["faults"] > 20 * 500, default
    assert tuned["faults"] < 200, tuned
    assert tuned["state"] == {"allocator": "glibc", "tuned": True, "mmap_threshold": 32 << 20, "trim_threshold": "never"}


@pytest.mark.parametrize("env, enabled, why", [
    ({}, False, "malloc_tuning=false"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, True, "MALLOC_TRIM_THRESHOLD_ is set in the environment"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, True,
     "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
])
def test_the_users_own_allocator_choice_wins(monkeypatch, env, enabled, why):
    for key in (*allocator.ENV_KEYS, "LD_PRELOAD"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    state = allocator._why_not(enabled)
    assert state is not None and state["tuned"] is False and state["why"] == why
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    for key in allocator.ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    assert allocator._why_not(True) is None  # glibc, nothing set: the settings apply
