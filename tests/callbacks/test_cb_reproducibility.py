"""reproducibility: seeds/env/flags recorded per rank, replay self-check names a nondeterministic
module, PyTorch's nondeterministic-op warnings become findings; the real step is unaffected."""

from __future__ import annotations

import json
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel
from tests.helpers.bad_input import cli_error_lines
from tests.helpers.runs import train_losses
from tests.helpers.findings import of, read_findings
from tests.helpers.shared_runs import data_run, healthy_run


@pytest.fixture
def isolated(monkeypatch):
    """The callback sets process-wide env vars and torch flags: undo them after the test."""
    for key in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(key, raising=False)
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.benchmark = flags[2], flags[3]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, shared_cache):
    return data_run("healthy", tmp_path_factory, shared_cache)


def test_healthy_run_is_silent_and_records_seeds_and_rng_states(healthy):
    run_dir, findings = healthy
    assert of(findings, "reproducibility") == []
    codes = {f["code"] for f in findings if f["check"] == "reproducibility"}
    assert {"seeded", "replay_ok"} <= codes
    record = json.loads((run_dir / "repro" / "rank0.json").read_text())
    assert record["PL_GLOBAL_SEED"] == "42" and record["env"]["PYTHONHASHSEED"] == "0"
    assert record["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # Trainer(deterministic=False) turns them off when built: the callback turns them back on
    assert record["flags"]["deterministic_algorithms"] and not record["flags"]["cudnn_benchmark"]
    states = torch.load(run_dir / "repro" / "rng_state_rank0.pt", weights_only=False)
    assert {"python", "numpy", "torch_cpu"} <= set(states)
    # this process was started without PYTHONHASHSEED: said, as info, for rank 0 only
    late = [f for f in findings if f["code"] == "hash_seed_late"]
    assert late and late[0]["severity"] == "info" and late[0]["rank"] == 0


def test_replay_does_not_change_the_real_training_step(healthy, tmp_path_factory, shared_cache):
    again, _ = data_run("healthy_again", tmp_path_factory, shared_cache)  # replay_steps=0, no profiler
    replayed = train_losses(healthy[0])
    assert sorted(replayed) == list(range(5))
    assert replayed == train_losses(again)  # bitwise


def test_planted_unseeded_noise_module_is_named(tmp_path_factory, shared_cache):
    _, findings = data_run("planted", tmp_path_factory, shared_cache)
    bad = [f for f in of(findings, "reproducibility") if f["code"] == "nondeterministic_op"]
    assert len(bad) == 1, bad  # the first divergence, once per rank
    f = bad[0]
    assert f["step"] == 0 and f["rank"] == 0 and "`net.noise`" in f["message"] and "UnseededNoise" in f["message"]
    assert f["details"]["module"] == "net.noise" and f["details"]["max_abs_diff_sampled"] > 0


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_two_processes_replay_and_record_every_rank(strategy, tmp_path_factory, shared_cache):
    run_dir, _ = healthy_run(strategy, tmp_path_factory, shared_cache)  # shared: tests/helpers/shared_runs.py
    findings = read_findings(run_dir)
    assert of(findings, "reproducibility") == []
    assert any(f["code"] == "replay_ok" for f in findings)
    rank1 = json.loads((run_dir / "repro" / "rank1.json").read_text())
    assert rank1["process_hash_seed"] == "0", "child ranks must inherit PYTHONHASHSEED"
    assert all(f["rank"] == 0 for f in findings if f["code"] == "hash_seed_late")
    assert (run_dir / "repro" / "rng_state_rank1.pt").is_file()


def test_pytorch_nondeterministic_op_warning_becomes_a_finding(tmp_path, isolated):
    from dsdebug.callbacks.reproducibility import Reproducibility

    channel = configure_channel(tmp_path)
    cb = Reproducibility(seed=42, replay_steps=0)
    trainer = SimpleNamespace(global_rank=0, global_step=3, world_size=1, default_root_dir=str(tmp_path))
    before = warnings.showwarning
    try:
        cb.on_train_start(trainer, torch.nn.Linear(2, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = cb._showwarning  # catch_warnings saved the original; put ours back
            torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]), accumulate=False)
    finally:
        cb.on_train_end(trainer, None)
        cb.teardown(trainer, None, "fit")
    assert warnings.showwarning is before
    # process-wide state is put back after fit (in-process fits, notebooks)
    assert "PYTHONHASHSEED" not in os.environ and not torch.are_deterministic_algorithms_enabled()
    found = [f for f in channel.read_all() if f["code"] == "nondeterministic_op"]
    assert len(found) == 1 and "`put_`" in found[0]["message"] and found[0]["step"] == 3
    assert "test_cb_reproducibility.py" in found[0]["message"]


def test_replay_comparison_names_the_first_differing_module():
    from dsdebug.callbacks.reproducibility.replay import first_difference

    def rec(name, value):
        t = torch.full((4,), float(value), dtype=torch.float64)
        return (name, [((4,), t.sum(), t)], "Linear")

    same = [rec("a", 1), rec("b", 2), rec("c", 3)]
    assert first_difference(same, list(same)) is None
    found = first_difference(same, [rec("a", 1), rec("b", 2.5), rec("c", 4)])
    assert found[0][0] == "b" and found[1] == 1 and found[2] == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs", [{"replay_steps": -1}, {"warn_only": "yes"},
                                    {"cublas_workspace_config": ":8:8"}])
def test_bad_values_are_config_errors(kwargs, isolated):
    from dsdebug.callbacks.reproducibility import Reproducibility

    with pytest.raises(ConfigError, match=r"callbacks\.reproducibility\.\w+=.*valid"):
        Reproducibility(**kwargs)


def test_bad_value_on_the_command_line_is_one_line(tmp_path, shared_cache, capsys):
    args = ["+callbacks=reproducibility", "callbacks.reproducibility.replay_steps=-2"]
    lines = cli_error_lines(args, tmp_path, shared_cache, capsys)  # in-process: tests/helpers/bad_input.py
    assert len(lines) == 1 and "callbacks.reproducibility.replay_steps=-2" in lines[0], lines
