"""memory: the formula and its extras, leak detection, OOM advice, held model-state bytes.

Planted (tests/planted/resources.py): a callback keeping 64 MB alive per step from step 6 ->
``memory_growth`` within 5 steps; a forward raising CUDA's OOM at step 3 -> ``oom`` with the
advice, exit 1 and one error line; a 2-process ZeRO-3 run whose ranks hold the formula's bytes/N."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dsdebug.callbacks.memory import MemoryMonitor
from dsdebug.callbacks.memory.footprint import expected_state_bytes, growth, oom_advice, zero2_grad_elements
from dsdebug.errors import ConfigError
from dsdebug.models.model_states import bytes_per_param, held_bytes, layout_of
from tests.helpers.runs import SMOKE, TINY_NET, assert_ok, only_run_dir, run_train, train_in_process

SHORT = SMOKE + ["export.fp32=false", "export.hf=false"]


def findings(run_dir, severities=("info", "warning", "error")) -> list[dict]:
    path = run_dir / "findings.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if r["check"] == "memory" and r["severity"] in severities]


# ---- units ---------------------------------------------------------------------------------

def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"growth_window": 2}, "growth_window"), ({"growth_mb_per_step": 0}, "growth_mb_per_step"),
                        ({"check_states_at_step": 0}, "check_states_at_step"), ({"every_n_steps": 1.5}, "every_n_steps"),
                        ({"growth_min_share": 2}, "growth_min_share"), ({"on_error": "ignore"}, "on_error")):
        with pytest.raises(ConfigError, match=f"callbacks.memory.{key}=.*valid: ") as e:
            MemoryMonitor(**kwargs)
        assert "\n" not in str(e.value)


def test_growth_slope_and_share():
    mb = 2**20
    flat = [(s, 500 * mb) for s in range(10)]
    assert growth(flat) == (0.0, 0.0)
    leak = [(s, (500 + 8 * s) * mb) for s in range(10)]
    slope, share = growth(leak)
    assert slope == pytest.approx(8.0) and share == 1.0
    one_jump = [(s, (500 + (100 if s == 5 else 0)) * mb) for s in range(10)]  # a transient spike: not steady
    assert growth(one_jump)[1] < 0.2


def test_expected_bytes_add_zero3_persistent_params_and_the_fp32_master():
    psi = 1000
    z3 = expected_state_bytes("zero3", psi, 2, (2, 2, 12), persistent=100)
    assert z3["total"] == 16 * psi / 2 and z3["extra"] == 2 * 100 * 0.5  # the persistent half not partitioned
    z2_fp32 = expected_state_bytes("zero2", psi, 2, (4, 4, 8))
    assert z2_fp32["total"] == 4 * psi + 12 * psi / 2 and z2_fp32["extra"] == 4 * psi / 2
    assert expected_state_bytes("ddp", psi, 2, (4, 4, 8))["expected"] == 16 * psi


def _deepspeed_params_in_partition(numels: list[int], n: int, rank: int) -> int:
    """What DeepSpeed's own stage_1_and_2 keeps for rank: its get_partition_info on meta tensors."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    align = 2 * n
    size = -(-sum(numels) // align) * align // n
    tensors = [torch.empty(k, device="meta") for k in numels]
    inside, _, _ = DeepSpeedZeroOptimizer.get_partition_info(None, tensors, size, rank)
    return sum(t.numel() for t in inside)


@pytest.mark.parametrize("numels", [[131072, 16384, 512, 2097152, 4096], [7, 1000, 3, 999, 5], [64] * 9, [10**6]])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_zero2_gradient_partition_matches_deepspeeds_layout(numels, n):
    """ZeRO-2 holds whole every gradient that overlaps the rank's partition (a 2-rank run of
    a net of two big tensors read 1.16x the paper's Psi/N and raised model_states_unexpected)."""
    groups = [(numels, [0] * len(numels), False)]
    for rank in range(n):
        assert zero2_grad_elements(groups, n, rank) == _deepspeed_params_in_partition(numels, n, rank)
    psi = sum(numels)
    big = zero2_grad_elements([([131072, 16384, 512, 2097152, 4096], [0] * 5, False)], 2, 0)
    assert big > 0.99 * 2249216  # the 2M tensor straddles: rank 0 holds ~all of Psi, not Psi/2
    exp = expected_state_bytes("zero2", psi, n, (4, 4, 8), grad_elements=zero2_grad_elements(groups, n, 0))
    assert exp["straddle"] == pytest.approx(max(0, 4 * zero2_grad_elements(groups, n, 0) - 4 * psi / n))
    assert exp["expected"] == pytest.approx(4 * psi + 12 * psi / n + 4 * psi / n + exp["straddle"])
    compact = zero2_grad_elements([(numels, [0] * len(numels), True)], n, 0)  # fp32 accumulation buffer
    assert compact == -(-psi // (2 * n)) * 2  # exactly one partition


def test_oom_advice_is_ordered_for_the_config_and_phase():
    fwd = oom_advice("forward", "zero2", checkpointing=False, batch_size=8, seq_len=128)
    assert "batch_size" in fwd[0] and "checkpointing" in fwd[1] and "seq_len" in fwd[2]
    assert "zero3" in fwd[3] and "zero2_offload" in fwd[4]
    opt = oom_advice("optimizer", "zero3", checkpointing=True, batch_size=1, seq_len=32)
    assert opt == ["offload to CPU (strategy=zero3_offload)"]  # already ZeRO-3, checkpointing on, batch 1
    assert "zero2" in oom_advice("optimizer", "ddp", True, 1, 32)[0]


def test_layout_and_bytes_per_param_from_the_strategy():
    ds = SimpleNamespace(deepspeed_engine=None, config={"zero_optimization": {"stage": 3, "offload_param":
                                                                             {"device": "cpu"}}, "bf16": {"enabled": True}})
    assert layout_of(ds) == ("zero3_offload", 3) and bytes_per_param(ds, None) == (2, 2, 12)
    ddp = SimpleNamespace(precision_plugin=SimpleNamespace(precision="bf16-mixed"))
    assert layout_of(ddp) == ("ddp", 0) and bytes_per_param(ddp, None) == (4, 4, 8)


def test_held_bytes_of_a_plain_module_and_adam_are_16_bytes_per_param():
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 64)).sum().backward()
    opt.step()
    psi = sum(p.numel() for p in net.parameters())
    held = held_bytes(SimpleNamespace(), net, [opt])
    assert held["total"] == 16 * psi + 2 * 4 * 2  # + Adam's step counters (one scalar per param tensor)
    assert held["buckets"] == 0


# ---- planted runs ----------------------------------------------------------------------------

def test_planted_leak_is_memory_growth_within_5_steps(tmp_path, shared_cache):
    onset = 6
    overrides = SHORT + [*TINY_NET, "+callbacks=memory", "trainer.max_steps=14", "callbacks.memory.warmup_steps=3",
                         "callbacks.memory.growth_window=4", "callbacks.memory.growth_mb_per_step=20",
                         "+callbacks.planted._target_=tests.planted.resources.LeakFrom",
                         f"+callbacks.planted.step={onset}", "+callbacks.planted.mb=64"]
    train_in_process(overrides, tmp_path / "run", shared_cache)
    loud = findings(tmp_path / "run", ("warning", "error"))
    assert [f["code"] for f in loud] == ["memory_growth"], loud
    f = loud[0]
    assert onset <= f["step"] <= onset + 5 and f["rank"] == 0
    assert 20 < f["details"]["mb_per_step"] < 96, f["message"]  # 64 MB/step kept (RSS lags: freed chunks reused)
    assert "rank 0's resident memory (RSS) grows" in f["message"]
    states = [r for r in findings(tmp_path / "run") if r["code"] == "model_states"]
    assert len(states) == 1 and "zero2 on 1 rank(s)" in states[0]["message"]  # held == expected on a healthy run


@pytest.mark.slow  # a command line that dies of a planted OOM, memory's planted leak runs in make test
def test_planted_oom_is_one_error_line_and_an_oom_finding_with_advice(tmp_path, shared_cache):
    proc = run_train(SHORT + [*TINY_NET, "+callbacks=memory", "trainer.max_steps=6",
                              "model.net._target_=tests.planted.resources.OOMAtStep", "+model.net.step=3"],
                     tmp_path, shared_cache)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: out of memory (CUDA out of memory."), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    run_dir = only_run_dir(tmp_path)
    (oom,) = [f for f in findings(run_dir) if f["code"] == "oom"]
    assert oom["severity"] == "error" and oom["step"] == 3 and oom["rank"] == 0
    assert "in forward at step 3" in oom["message"] and "zero2" in oom["message"]
    assert oom["advice"].startswith("1) halve data.batch_size (now 8)") and "zero3" in oom["advice"]
    assert json.loads((run_dir / "crash.json").read_text())["status"] == "out_of_memory"


@pytest.mark.slow  # 2 processes (~45 s); the layout itself is held in make test by the unit test against DeepSpeed
def test_zero2_two_big_tensors_is_silent_and_each_rank_matches_its_partition(tmp_path, shared_cache):
    proc = run_train(SHORT + ["model.net._target_=tests.planted.healthy_nets.TwoBigLinearLM", "+callbacks=memory",
                              "trainer.max_steps=3", "strategy=zero2", "trainer=ddp_sim"],
                     tmp_path, shared_cache, timeout=600)
    assert_ok(proc)
    rows = findings(only_run_dir(tmp_path))
    assert not [r for r in rows if r["severity"] != "info"], rows
    (states,) = [r for r in rows if r["code"] == "model_states"]
    d = states["details"]
    assert d["layout"] == "zero2" and d["straddle"] > 0.1 * d["expected"]  # the big head straddles the boundary
    for held, expected in zip(d["per_rank"], d["expected_per_rank"]):
        assert held == pytest.approx(expected, rel=0.01)


@pytest.mark.slow
def test_zero3_two_processes_each_rank_holds_the_formula_over_n(tmp_path, shared_cache):
    proc = run_train(SHORT + [*TINY_NET, "+callbacks=memory", "trainer.max_steps=3", "strategy=zero3",
                              "trainer=ddp_sim"], tmp_path, shared_cache, timeout=600)
    assert_ok(proc)
    rows = findings(only_run_dir(tmp_path))
    assert not [r for r in rows if r["severity"] != "info"], rows
    (states,) = [r for r in rows if r["code"] == "model_states"]
    d = states["details"]
    assert d["layout"] == "zero3" and d["ranks"] == 2 and d["bytes_per_param"] == [4, 4, 8]
    assert d["formula"] == pytest.approx(16 * d["psi"] / 2)  # (4+4+8) Psi / N: everything partitioned
    for held in d["per_rank"]:  # each rank holds ~half the single-rank states (+ persistent params, fp32 master)
        assert held == pytest.approx(d["expected"], rel=0.02)
        assert held < 0.75 * 16 * d["psi"]
    (summary,) = [r for r in rows if r["code"] == "memory_summary"]
    assert len(summary["details"]["peak_bytes"]) == 2 and min(summary["details"]["peak_bytes"]) > 0
