"""reproducibility: seeds/env/flags recorded per rank, replay self-check names a nondeterministic
module, PyTorch's nondeterministic-op warnings become findings; the real step is unaffected."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
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
    # this process was started without PYTHONHASHSEED, but it is alone (1 rank, no spawned worker):
    # no other process can hash differently, nothing to say (the 2-process runs below say it)
    assert [f for f in findings if f["code"] == "hash_seed_late"] == []


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
    # rank 0 was started with PYTHONHASHSEED=random (exported: kept), its child rank with 0: said, by rank 0
    late = [f for f in findings if f["code"] == "hash_seed_late"]
    assert [(f["rank"], f["severity"]) for f in late] == [(0, "info")], late
    assert "2 ranks got PYTHONHASHSEED=0" in late[0]["message"] and "PYTHONHASHSEED=0 python" in late[0]["advice"]
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


def _trainer(tmp_path, world_size=1, loader=None):
    return SimpleNamespace(global_rank=0, global_step=0, world_size=world_size, is_global_zero=True,
                           default_root_dir=str(tmp_path), train_dataloader=loader)


def test_trainer_deterministic_false_is_kept_and_said_or_forced_by_opt_in(tmp_path, isolated):
    """Trainer(deterministic=False) (trainer.deterministic=false) turns the flags off after the check's
    __init__ turned them on: the user's setting is kept with a warning naming the key; only
    force_deterministic=true turns them back on, and says so."""
    from dsdebug.callbacks.reproducibility import Reproducibility

    for force, code, on in ((False, "deterministic_off", False), (True, "deterministic_forced", True)):
        channel = configure_channel(tmp_path / code)
        cb = Reproducibility(seed=42, replay_steps=0, force_deterministic=force)
        assert torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(False)  # what Trainer(deterministic=False) does when built
        trainer = _trainer(tmp_path)
        cb.setup(trainer, None, "fit")
        cb.setup(trainer, None, "validate")  # a second setup keeps the decision
        assert torch.are_deterministic_algorithms_enabled() is on
        found = [f for f in channel.read_all() if f["code"].startswith("deterministic")]
        assert [(f["code"], f["severity"]) for f in found] == [(code, "warning")]
        assert "trainer.deterministic=false" in found[0]["message"]
        cb.teardown(trainer, None, "fit")
    # left alone (trainer.deterministic unset, this project's default): on, nothing to say
    channel = configure_channel(tmp_path / "unset")
    cb = Reproducibility(seed=42, replay_steps=0)
    cb.setup(_trainer(tmp_path), None, "fit")
    assert torch.are_deterministic_algorithms_enabled()
    assert not [f for f in channel.read_all() if f["severity"] != "info"]
    cb.teardown(_trainer(tmp_path), None, "fit")


def test_hash_seed_late_only_where_another_process_hashes_differently(tmp_path, isolated):
    """Rank 0 started without PYTHONHASHSEED: said with 2 ranks, or with workers started by spawn;
    not for 1 rank with no or forked workers (they share its seed)."""
    from torch.utils.data import DataLoader

    from dsdebug.callbacks.reproducibility import Reproducibility

    data = list(range(4))
    cases = {"alone": (1, None, False), "forked workers": (1, DataLoader(data, num_workers=2,
                                                                           multiprocessing_context="fork"), False),
             "2 ranks": (2, None, True),
             "spawned workers": (1, DataLoader(data, num_workers=2, multiprocessing_context="spawn"), True)}
    for name, (world, loader, said) in cases.items():
        channel = configure_channel(tmp_path / name)
        cb = Reproducibility(seed=42, replay_steps=0)
        trainer = _trainer(tmp_path / name, world, loader)
        cb._report_hash_seed(trainer)
        late = [f for f in channel.read_all() if f["code"] == "hash_seed_late"]
        assert bool(late) is said, (name, late)
        cb.teardown(trainer, None, "fit")
    assert "2 data-loader worker(s) started by spawn" in late[0]["message"]


# ---- which presets switch deterministic kernels on (issue 33: light must not; repro and full do) ----------
_ONE_STEP = ["trainer.max_steps=1", "trainer.val_check_interval=1", "trainer.limit_val_batches=1",
             "trainer.num_sanity_val_steps=0", "export.fp32=false", "export.hf=false", "~callbacks.model_checkpoint",
             "+callbacks.flag_witness._target_=tests.planted.data.FlagWitness"]


@pytest.mark.parametrize("preset, on", [("light", False), ("repro", True), ("full", True)])
def test_deterministic_kernels_are_off_in_light_and_on_in_repro_and_full(preset, on, tmp_path, shared_cache,
                                                                           isolated):
    """One in-process step per preset; tests/planted/data.py FlagWitness reads torch's flags at the first
    training batch (after every setup). light keeps seeds and env vars; repro/full add deterministic mode
    (warn only) without filling new memory (strict mode only)."""
    from tests.helpers.runs import SMOKE, TINY_NET, train_in_process

    torch.backends.cudnn.deterministic = False
    run_dir = tmp_path / "run"
    train_in_process(SMOKE + TINY_NET + [f"debug={preset}", *_ONE_STEP], run_dir, shared_cache)
    flags = json.loads((run_dir / "torch_flags.json").read_text())
    assert flags["deterministic_algorithms"] is on and flags["cudnn_deterministic"] is on, flags
    assert flags["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # set in every preset (no cost; see the check)
    if on:
        assert flags["warn_only"] and flags["fill_uninitialized_memory"] is False, flags
    record = json.loads((run_dir / "repro" / "rank0.json").read_text())
    assert record["flags"]["deterministic_algorithms"] is on and record["PL_GLOBAL_SEED"] == "42"
    seeded = [f for f in read_findings(run_dir) if f["code"] == "seeded"]
    assert len(seeded) == 1 and f"deterministic algorithms {'on, warn only' if on else 'off'}" in seeded[0]["message"]
    assert ("(debug=light) leaves torch's flags" in seeded[0]["message"]) is (not on)


def test_the_default_config_is_light_without_deterministic_kernels():
    """python train.py with no override composes debug=light, and light's reproducibility check leaves
    torch's deterministic flags alone (compose only: the in-process light run above shows the flags)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tests.helpers.runs import CONF

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("train", return_hydra_config=True)
            repro = compose("train", overrides=["debug=repro"])
    finally:
        GlobalHydra.instance().clear()
    assert cfg.hydra.runtime.choices.debug == "light"
    assert cfg.callbacks.reproducibility.deterministic is False
    assert repro.callbacks.reproducibility.deterministic is True


def test_fill_uninitialized_memory_auto_fills_only_in_strict_mode_and_an_explicit_value_is_kept(tmp_path, isolated):
    from dsdebug.callbacks.reproducibility import Reproducibility

    cases = [  # (kwargs, a strict mode already on (trainer.deterministic=true), expected: warn_only, fill)
        ({}, False, (True, False)),                                  # debug=repro/full: warn only, no fill
        ({"warn_only": False}, False, (False, True)),                # strict: filled
        ({}, True, (False, True)),                                   # trainer.deterministic=true stays strict
        ({"fill_uninitialized_memory": True}, False, (True, True)),  # the user's value, as given
        ({"warn_only": False, "fill_uninitialized_memory": False}, False, (False, False)),
    ]
    for kwargs, strict_before, (warn_only, fill) in cases:
        torch.use_deterministic_algorithms(strict_before)
        torch.utils.deterministic.fill_uninitialized_memory = not fill  # so a test can see it set
        cb = Reproducibility(seed=42, replay_steps=0, **kwargs)
        cb.setup(_trainer(tmp_path), None, "fit")
        got = (torch.is_deterministic_algorithms_warn_only_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
        assert torch.are_deterministic_algorithms_enabled() and got == (warn_only, fill), (kwargs, strict_before, got)
        cb.teardown(_trainer(tmp_path), None, "fit")


def test_deterministic_false_leaves_the_trainers_flags_alone_through_teardown(tmp_path, isolated):
    """debug=light with trainer.deterministic=true: Lightning's strict mode is the user's, kept during the
    run and after it (the check never set the flags, so it puts nothing back)."""
    from dsdebug.callbacks.reproducibility import Reproducibility

    torch.utils.deterministic.fill_uninitialized_memory = True
    cb = Reproducibility(seed=42, replay_steps=0, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # what Trainer(deterministic=True) does when built
    cb.setup(_trainer(tmp_path), None, "fit")
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    cb.teardown(_trainer(tmp_path), None, "fit")
    assert torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") is None  # env vars: put back as before


def test_fill_without_deterministic_is_a_config_error(isolated):
    from dsdebug.callbacks.reproducibility import Reproducibility

    with pytest.raises(ConfigError, match=r"callbacks\.reproducibility\.fill_uninitialized_memory=true does nothing "
                                          r"with callbacks\.reproducibility\.deterministic=false.*valid: ") as e:
        Reproducibility(deterministic=False, fill_uninitialized_memory=True)
    assert "\n" not in str(e.value)
    Reproducibility(deterministic=False, fill_uninitialized_memory=False).teardown(_trainer(Path(".")), None, "fit")
