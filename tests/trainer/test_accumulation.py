"""Gradient accumulation k x b gives the gradients and the update of one batch of k*b, under DDP and
every ZeRO stage (with and without CPU offload, and from a user's ds_config.json), at 1 and 2
ranks; and the grad_scale check names a wrong scale. The fits run in tests/helpers/accum_equivalence.py:
one process group per world size fits every strategy in turn (the process start is paid once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.accum_equivalence import K, STRATEGIES
from tests.helpers.runs import REPO

_results: dict[tuple, dict] = {}


def equivalence(tmp_path_factory, cache, devices: int, *extra: str) -> dict:
    key = (devices, *extra)
    if key not in _results:
        out = tmp_path_factory.mktemp(f"accum{devices}") / "results.json"
        env = {**os.environ, "DSDEBUG_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
        for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
            env.pop(var, None)
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "accum_equivalence.py"), "--devices",
                               str(devices), "--out", str(out), *extra], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        _results[key] = json.loads(out.read_text())
    return _results[key]


def _max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accumulation_equals_one_big_batch(strategy, devices, tmp_path_factory, shared_cache):
    results = equivalence(tmp_path_factory, shared_cache, devices)
    accum, big = results[f"{strategy}/accum"], results[f"{strategy}/big"]
    assert accum["world_size"] == big["world_size"] == devices
    assert accum["global_step"] == big["global_step"] == 1
    # the global gradient norm before the update: the same 8 samples per rank, same mean loss
    assert accum["grad_norm"] == pytest.approx(big["grad_norm"], rel=1e-5), (accum["grad_norm"], big["grad_norm"])
    # SGD: the update is lr x gradient, so a gradient off by k moves the weights visibly (~1e-2 here);
    # offload runs DeepSpeedCPUAdam, whose first update hardly depends on the scale (lr=0.5 makes
    # float noise in near-zero gradients ~1e-2): there the norm above is the evidence
    tol = 0.05 if strategy.endswith("offload") else 1e-5
    assert _max_weight_diff(accum["weights"], big["weights"]) < tol
    for run in (accum, big):  # the grad_scale check measured the scale the config implies, silently
        assert run["findings"] == [] and run["grad_scale_factor"] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.slow
def test_grad_scale_check_names_double_scaling(tmp_path_factory, shared_cache):
    """Planted: Lightning's stock DeepSpeed backward (the engine divides by k again)."""
    fixed = equivalence(tmp_path_factory, shared_cache, 1)["zero2/accum"]
    planted = equivalence(tmp_path_factory, shared_cache, 1, "--strategies", "zero2", "--variants", "accum",
                          "--plant", "double")["zero2/accum"]
    assert planted["grad_norm"] == pytest.approx(fixed["grad_norm"] / K, rel=1e-5)  # the bug, reproduced
    (finding,) = planted["findings"]
    assert (finding["code"], finding["severity"], finding["rank"]) == ("grad_scale_wrong", "error", None)
    assert finding["details"]["factor"] == pytest.approx(1 / K, rel=1e-6)
    assert f"gradient_accumulation_steps={K}" in finding["message"]
    assert f"accumulate_grad_batches={K}" in finding["message"]
    assert "scale_wrt_gas=False" in finding["advice"]


def test_grad_scale_check_names_engine_accumulation_mismatch(tmp_path_factory, shared_cache):
    """Planted: the engine accumulates over 2 micro-batches while Lightning accumulates 4."""
    planted = equivalence(tmp_path_factory, shared_cache, 1, "--strategies", "zero2", "--variants", "accum",
                          "--plant", "gas")["zero2/accum"]
    (finding,) = planted["findings"]
    assert (finding["code"], finding["severity"]) == ("accumulation_mismatch", "error")
    assert finding["details"] == {"gradient_accumulation_steps": K // 2, "accumulate_grad_batches": K}
