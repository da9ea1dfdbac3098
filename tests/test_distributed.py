"""Two CPU processes (gloo) for every strategy; reproducibility and exact resume on top.

Each strategy run trains 6 steps with checkpoints at 3 and 6. Reproducibility re-runs
ZeRO-2 and compares the loss curve bit for bit; resume restarts ZeRO-3 from its step-3
checkpoint and must reproduce steps 4-6 of the uninterrupted run.
"""

from __future__ import annotations

import pytest

from tests.conftest import FAST, assert_ok, metrics, only_run_dir, run_train, train_losses

STRATEGIES = ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
TWO_PROC = [a for a in FAST if not a.startswith(("trainer.max_steps", "trainer.val_check_interval"))] + [
    "trainer=ddp_sim",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "callbacks.model_checkpoint.every_n_train_steps=3",
    "export.hf=false",
]
_runs: dict = {}


def _two_proc_run(strategy, tmp_path_factory, shared_cache, extra=()):
    key = (strategy, tuple(extra))
    if key not in _runs:
        log_dir = tmp_path_factory.mktemp(f"{strategy}")
        proc = run_train(TWO_PROC + [f"strategy={strategy}", *extra], log_dir, shared_cache)
        assert_ok(proc)
        _runs[key] = (only_run_dir(log_dir), proc)
    return _runs[key]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_trains_with_two_cpu_processes(strategy, tmp_path_factory, shared_cache):
    run_dir, proc = _two_proc_run(strategy, tmp_path_factory, shared_cache)
    m = metrics(run_dir)
    assert m["world_size"] == 2 and m["global_step"] == 6
    expected_stage = None if strategy == "ddp" else int(strategy[4])
    assert m["zero_stage"] == expected_stage
    assert m["val/loss"] < m["val/loss_at_start"] - 0.5, "did not learn"
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(6))
    # rank 1 logged into the same run dir (its own file) and made no dir of its own
    assert (run_dir / "rank1.log").is_file()
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000003.ckpt", "step_000006.ckpt"]
    if strategy != "ddp":
        shards = list((run_dir / "checkpoints" / "step_000006.ckpt" / "checkpoint").glob("*optim_states.pt"))
        assert len(shards) == 2, "expected one optimizer shard per rank"
    assert (run_dir / "export" / "model_fp32.pt").is_file()
    if strategy == "zero3":
        # the model summary must count the partitioned parameters, not the empty local views
        assert "8.7 M" in proc.stdout, proc.stdout[-3000:]
    if "offload" in strategy:
        assert "DeepSpeedCPUAdam" in (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_same_seed_same_config_gives_identical_loss_curve(tmp_path_factory, shared_cache):
    first, _ = _two_proc_run("zero2", tmp_path_factory, shared_cache)
    log_dir = tmp_path_factory.mktemp("repro")
    assert_ok(run_train(TWO_PROC + ["strategy=zero2"], log_dir, shared_cache))
    second = only_run_dir(log_dir)
    assert train_losses(first) == train_losses(second)  # bitwise: floats compare exactly
    other_seed = tmp_path_factory.mktemp("seed")
    assert_ok(run_train(TWO_PROC + ["strategy=zero2", "seed=43", "trainer.max_steps=2"], other_seed, shared_cache))
    assert train_losses(only_run_dir(other_seed))[1] != train_losses(first)[1]


@pytest.mark.slow
def test_resume_mid_run_reaches_the_same_final_loss(tmp_path_factory, shared_cache):
    full, _ = _two_proc_run("zero3", tmp_path_factory, shared_cache)
    log_dir = tmp_path_factory.mktemp("resume")
    ckpt = full / "checkpoints" / "step_000003.ckpt"
    assert_ok(run_train(TWO_PROC + ["strategy=zero3", f"ckpt_path={ckpt}"], log_dir, shared_cache))
    resumed = only_run_dir(log_dir)
    full_losses, resumed_losses = train_losses(full), train_losses(resumed)
    assert sorted(resumed_losses) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed_losses[step] == pytest.approx(full_losses[step], rel=1e-6, abs=1e-6), step
    assert metrics(resumed)["val/loss"] == pytest.approx(metrics(full)["val/loss"], rel=1e-5)
