"""replica_parity: exact checksums find any changed bit, the comparison names the odd rank, and
planted rank-local weight writes are named in 2-process runs (DDP with the reproducibility
pointer, ZeRO-2 where the next all-gather heals the copy, ZeRO-3 on a persistent parameter),
and the healthy steps before each onset are silent (every step checked).
The planted module is tests/planted/parity.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsdebug.callbacks.replica_parity import ReplicaParity
from dsdebug.callbacks.replica_parity.checksums import checksums, divergent
from dsdebug.callbacks.reproducibility.replay import _only
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, assert_ok, only_run_dir, run_train
from tests.helpers.findings import one, read_findings

# ---- (a) detection logic, in-process ---------------------------------------------------


def test_checksums_see_one_flipped_bit_and_swapped_elements_but_not_summation_order():
    torch.manual_seed(0)
    t = torch.randn(1000)
    base = checksums([t])
    flipped = t.clone()
    flipped.view(torch.int32)[500] ^= 1  # the lowest mantissa bit of one element
    swapped = t.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert not torch.equal(checksums([flipped])[0, :2], base[0, :2])
    assert base[0, 0] == checksums([swapped])[0, 0] and base[0, 1] != checksums([swapped])[0, 1]
    # same values, other memory layout (a transposed copy made contiguous the same way): identical
    assert torch.equal(checksums([t.reshape(10, 100).t().contiguous().t().contiguous().reshape(-1)]), base)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = t.to(dtype)
        y = x.clone()
        y[0] = -y[0]
        assert not torch.equal(checksums([x])[0, :2], checksums([y])[0, :2]), dtype
    ints = checksums([torch.tensor([1, 2, 3]), torch.tensor([True, False])])
    assert ints[0, 0] == 6 and ints[1, 0] == 1


def test_checksums_run_on_each_tensors_device_with_no_host_read():
    """Multi-GPU: parameters on CUDA, optimizer scalars on the CPU. The sums are computed on each tensor's
    own device (the weights made there, cached per device) and the table lands on the collective's device.
    Shown with the ``meta`` device: an op mixing it with a CPU tensor raises as CUDA would ("Tensor on
    device cpu is not on the expected device meta"), and any read of a value on the host raises ("Cannot
    copy out of meta tensor"), so this passes only with no per-value host read."""
    meta = [torch.empty(1000, device="meta"), torch.empty(3, 4, device="meta", dtype=torch.bfloat16),
            torch.empty(5, device="meta", dtype=torch.complex64), torch.empty(7, device="meta", dtype=torch.int64)]
    weights: dict = {}
    out = checksums([*meta, torch.tensor([0.5], dtype=torch.float64)], weights, device="meta")
    assert out.shape == (5, 3) and out.dtype == torch.int64 and out.device.type == "meta"
    assert {d.type for d in weights} == {"meta", "cpu"}  # made on each device, never copied across
    assert all(w.device == d and w.numel() >= 1000 for d, w in weights.items())
    kept = dict(weights)
    checksums(meta, weights, device="meta")
    assert all(weights[d] is kept[d] for d in kept)  # cached: one arange per device per run


def test_divergent_names_the_odd_rank_against_the_majority_and_rank0_on_a_tie():
    a, b = torch.tensor([[1, 2, 0], [3, 4, 0]]), torch.tensor([[1, 2, 0], [3, 5, 0]])
    assert divergent(torch.stack([a, a, a])) == []
    assert divergent(torch.stack([a, a, b])) == [(1, [0, 1], [2])]
    assert divergent(torch.stack([b, a, a])) == [(1, [1, 2], [0])]  # rank 0 is the odd one
    assert divergent(torch.stack([a, b])) == [(1, [0], [1])]  # 2 ranks: rank 0 is the reference
    only_value_sum = a.clone()
    only_value_sum[0, 2] = 99  # the fp64 value sum is for messages, never a verdict
    assert divergent(torch.stack([a, only_value_sum])) == []


class _Stub:
    """A 2-rank trainer whose all_gather returns this rank's table and a planted copy for rank 1."""

    def __init__(self, plant):
        self.global_rank, self.world_size, self.global_step, self.loggers = 0, 2, 0, []
        self.strategy = SimpleNamespace(root_device=torch.device("cpu"), all_gather=self._gather)
        self.plant, self.should_stop = plant, False

    def _gather(self, mine):
        other = mine.clone()
        self.plant(other, self.global_step)
        return torch.stack([mine, other])


def test_check_names_rank_param_and_last_equal_step_then_equal_again(tmp_path):
    channel = configure_channel(tmp_path)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))

    def plant(table, step):  # rank 1's copy of 1.weight differs at steps 3 and 4 only
        if step in (3, 4):
            table[2, 1] += 1

    trainer = _Stub(plant)
    cb = ReplicaParity(every_n_steps=1, on_error="stop")
    cb._entries = [("param", n, (lambda p=p: p.data)) for n, p in net.named_parameters()]
    for step in range(6):
        trainer.global_step = step
        cb.on_before_optimizer_step(trainer, None, None)
    errors = [f for f in channel.local if f.severity == "error"]
    assert len(errors) == 1 and errors[0].code == "replica_divergence" and errors[0].rank == 1
    assert errors[0].step == 3 and "rank 1 differs from rank(s) [0] in 1.weight" in errors[0].message
    assert "last equal at step 2" in errors[0].message and errors[0].details["last_equal_step"] == 2
    again = [f for f in channel.local if f.code == "replicas_equal_again"]
    assert [f.step for f in again] == [5] and trainer.should_stop  # stop acts on every rank


def test_one_process_is_off_and_config_errors_are_one_line():
    cb = ReplicaParity()
    cb.on_fit_start(SimpleNamespace(world_size=1), torch.nn.Linear(2, 2))
    cb.on_before_optimizer_step(SimpleNamespace(world_size=1), None, None)  # nothing to gather: returns
    assert cb._entries == [] and cb._checks == 0
    for kwargs, key in (({"every_n_steps": -1}, "every_n_steps"), ({"buffers": "yes"}, "buffers"),
                        ({"on_error": "skip"}, "on_error"), ({"max_findings_per_code": 0}, "max_findings_per_code")):
        with pytest.raises(ConfigError, match=f"callbacks.replica_parity.{key}=.*valid: ") as e:
            ReplicaParity(**kwargs)
        assert "\n" not in str(e.value)


def test_replay_pointer_only_for_a_subset_of_ranks():
    two = SimpleNamespace(world_size=2)
    assert "only rank 1 differs: run +callbacks=replica_parity" in _only(two, [1])
    assert _only(two, [0, 1]) == "" and _only(SimpleNamespace(world_size=1), [0]) == ""


# ---- (b) planted bugs and a healthy run, 2 processes ------------------------------------
BASE = SMOKE + [
    "trainer=ddp_sim", "trainer.max_steps=5", "trainer.val_check_interval=5", "trainer.limit_val_batches=1",
    "export.hf=false", "export.fp32=false", *SMALL_DEEPSEEK,
    "+callbacks=[replica_parity]", "callbacks.replica_parity.every_n_steps=1"]
PARAM = "model.layers.1.self_attn.o_proj.weight"
DRIFT = ["+callbacks.drift._target_=tests.planted.parity.PerturbParam", f"+callbacks.drift.param={PARAM}",
         "+callbacks.drift.rank=1"]


def _run(args, tmp_path, cache):
    proc = run_train(args, tmp_path, cache, timeout=600)
    assert_ok(proc)
    return read_findings(only_run_dir(tmp_path))


def _loud(found):
    return [(r["check"], r["code"], r["step"]) for r in found if r["severity"] != "info"]


def test_ddp_weight_written_in_forward_on_rank1_is_named_and_replay_points_here(tmp_path, shared_cache):
    found = _run([*BASE, "strategy=ddp", "+callbacks=[replica_parity,reproducibility]",
                  "callbacks.reproducibility.replay_steps=2", *DRIFT, "+callbacks.drift.step=1",
                  "+callbacks.drift.in_forward=true"], tmp_path, shared_cache)
    div = one(found, "replica_divergence")
    assert div["step"] == 1 and div["rank"] == 1 and div["details"]["first"] == PARAM
    assert div["details"]["names"] == [PARAM] and "last equal at step 0" in div["message"]
    replay = one(found, "nondeterministic_op")
    assert replay["rank"] == 1 and "only rank 1 differs: run +callbacks=replica_parity" in replay["message"]
    assert not [r for r in found if r["code"] == "replay_ok"]
    assert sorted(_loud(found)) == [("replica_parity", "replica_divergence", 1),
                                    ("reproducibility", "nondeterministic_op", 1)]
    summary = one(found, "parity_summary")  # DDP never re-syncs weights: still divergent at the end
    assert summary["details"]["checks"] == 6 and summary["details"]["divergent_at_end"] == {"param": 1}


@pytest.mark.slow
def test_zero2_weight_written_on_rank1_is_named_and_healed_by_the_next_step(tmp_path, shared_cache):
    found = _run([*BASE, "strategy=zero2", *DRIFT, "+callbacks.drift.step=3"], tmp_path, shared_cache)
    div = one(found, "replica_divergence")
    assert div["step"] == 3 and div["rank"] == 1 and div["details"]["names"] == [PARAM]
    assert "last equal at step 2" in div["message"] and "ZeRO-1/2 re-gathers" in div["message"]
    assert _loud(found) == [("replica_parity", "replica_divergence", 3)]
    assert one(found, "replicas_equal_again")["step"] == 4
    assert one(found, "parity_summary")["details"]["divergent_at_end"] == {}


@pytest.mark.slow
def test_zero3_silent_while_healthy_then_names_a_persistent_param_written_on_rank1(tmp_path, shared_cache):
    norm = "model.layers.1.input_layernorm.weight"  # 64 elements: below the persistence threshold, whole on every rank
    found = _run([*BASE, "strategy=zero3", *DRIFT[:1], f"+callbacks.drift.param={norm}", "+callbacks.drift.rank=1",
                  "+callbacks.drift.step=3"], tmp_path, shared_cache)
    assert _loud(found) == [("replica_parity", "replica_divergence", 3)]  # checks at steps 0-2: silent
    div = one(found, "replica_divergence")
    assert div["rank"] == 1 and div["details"]["names"] == [norm] and "last equal at step 2" in div["message"]
    details = one(found, "parity_summary")["details"]
    assert details["checks"] == 6 and details["zero3_partitioned_not_compared"] > 0


def test_ddp_batchnorm_statistics_are_not_a_divergence(tmp_path, shared_cache):
    """BatchNorm's running statistics differ per rank after each step; DDP (broadcast_buffers=True)
    copies rank 0's to every rank at the next forward: not a drift (was a buffer_divergence warning)."""
    found = _run([*BASE, "strategy=ddp", "model.net._target_=tests.planted.doctor_nets.BatchNormLM",
                  "trainer.max_steps=3"], tmp_path, shared_cache)
    assert _loud(found) == [], _loud(found)
    summary = one(found, "parity_summary")
    assert summary["details"]["checks"] >= 3 and summary["details"]["divergent_at_end"] == {}
