"""debug=light costs on a GPU what it costs on a CPU only if its checks do not read tensor values on the
host every step (each read is a device sync there, free on a CPU). Counted on CPU (benchmarks/host_reads.py):
a 20-step run minus a 10-step run of the same config, so one-off reads at start and end cancel."""

from __future__ import annotations

import pytest

from benchmarks.host_reads import BASE, counting, per_step

_measured: dict[str, tuple[float, dict]] = {}


def _reads(preset: str, cache, *extra: str) -> tuple[float, dict]:
    key = " ".join([preset, *extra])
    if key not in _measured:
        _measured[key] = per_step([*BASE, f"debug={preset}", *extra], 10, 20, cache)
    return _measured[key]


def test_light_adds_at_most_one_host_read_per_step_over_none(shared_cache):
    none, _ = _reads("none", shared_cache)
    light, files = _reads("light", shared_cache)
    checks = {f: v for f, v in files.items() if f.startswith("src/callbacks/")}
    assert light - none <= 1.0, f"debug=light reads {light - none:.2f} more tensor values per step than none: {checks}"
    assert none > 0  # the counter sees the run's own reads (the optimizer's, Lightning's logging)


def test_the_counter_counts_each_kind_of_read_once():
    import torch

    t = torch.ones(3)
    with counting() as counts:
        t.sum().item(), float(t[0]), int(t[1]), bool(t[2]), t.tolist(), t.cpu(), t.numpy()
        t.sum()  # no read
    assert dict(counts) == {"test_host_reads.py": 7}, counts  # named by the file that read (outside src/)


@pytest.mark.slow  # two more runs; the budget test above holds the property in make test
def test_a_check_that_reads_every_step_breaks_the_budget(shared_cache):
    """The old behaviour, restored by config: loss_spike and grad_monitor reading every step (read_every_n_steps=1)
    add ~3.5 reads per step over light's batched reads: the budget test would fail on them."""
    light, _ = _reads("light", shared_cache)
    every, files = _reads("light", shared_cache, "callbacks.loss_spike.read_every_n_steps=1",
                          "callbacks.grad_monitor.read_every_n_steps=1")
    assert every - light > 1.0, (every, light, files)
