"""Every file under conf/ composes, and the objects it describes can be built."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.helpers.runs import CONF, REPO

GROUP_FILES = sorted(p for p in CONF.rglob("*.yaml") if p.parent != CONF)
# presets that write into the global package instead of a key of their own
OVERRIDE_STYLE = {"hparams_search", "experiment", "debug"}


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


@pytest.fixture(autouse=True)
def _project_root(monkeypatch, tmp_path):
    monkeypatch.setenv("PROJECT_ROOT", str(REPO))
    monkeypatch.setenv("DSDEBUG_CACHE_DIR", str(tmp_path / "cache"))


def test_every_group_file_is_covered():
    groups = {p.parent.relative_to(CONF).parts[0] for p in GROUP_FILES}
    assert {"model", "data", "strategy", "trainer", "optim", "logger", "callbacks", "debug",
            "experiment", "hparams_search", "paths", "hydra"} <= groups


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_config_file_composes(path: Path):
    group, option = path.parent.relative_to(CONF).as_posix(), path.stem
    if group == "hydra":
        cfg = _compose([])
        assert cfg.hydra.run.dir
        return
    if group.startswith("hydra/"):  # a preset for a Hydra plugin (hydra/launcher=slurm): it resolves
        cfg = _compose([f"{group}={option}"])
        assert cfg.hydra.runtime.choices[group] == option
        OmegaConf.to_container(OmegaConf.select(cfg, group.replace("/", ".")), resolve=True)
        return
    # callbacks and model adapters are added: +callbacks=<name>, +model/adapter=lora
    prefix = "+" if group in ("callbacks", "model/adapter") else ""
    cfg = _compose([f"{prefix}{group}={option}"])
    assert cfg.hydra.runtime.choices[group] == option
    if group not in OVERRIDE_STYLE:  # a group of its own (not a global preset): its key exists
        assert OmegaConf.select(cfg, group.replace("/", ".")) is not None or group in ("callbacks",)
    # every interpolation resolves (Hydra's runtime paths stand in for a real run)
    OmegaConf.update(cfg, "paths.output_dir", "/tmp/run", force_add=True)
    OmegaConf.update(cfg, "paths.work_dir", "/tmp", force_add=True)
    for key in cfg:
        if key != "hydra":
            OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]


def test_default_composition_matches_the_product_card():
    cfg = _compose([])
    assert cfg.model.net._target_ == "dsdebug.models.deepseek.build_deepseek_v3"
    assert cfg.data.source._target_ == "dsdebug.data.corpus.KJVCorpus"
    assert cfg.strategy.stage == 2 and cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 1
    assert cfg.optim.scheduler.warmup_ratio == 0.1 and cfg.optim.grad_clip == 1.0
    assert list(cfg.logger) == ["tensorboard"]
    base = {"model_checkpoint", "lr_monitor", "rich_progress_bar", "model_summary", "grad_scale", "consistency"}
    light = _compose(["debug=light"])
    # debug=light is the default: python train.py runs the cheap checks; debug=none is the opt-out
    assert set(cfg.callbacks) == set(light.callbacks) and set(cfg.callbacks) > base | {"preflight", "grad_monitor"}
    assert set(_compose(["debug=none"]).callbacks) == base
    assert set(_compose(["experiment=smoke"]).callbacks) == base  # the smoke run pins debug=none
    assert set(_compose(["experiment=smoke", "debug=light"]).callbacks) == set(light.callbacks)  # the command line wins


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_strategies_instantiate(strategy):
    from dsdebug.trainer.strategy import DebugDDPStrategy, DebugDeepSpeedStrategy

    obj = instantiate(_compose([f"strategy={strategy}"]).strategy)
    if strategy == "ddp":
        assert isinstance(obj, DebugDDPStrategy)
        return
    assert isinstance(obj, DebugDeepSpeedStrategy)
    zero = obj.config["zero_optimization"]
    assert zero["stage"] == int(strategy[4])
    assert obj.offloads_optimizer == ("offload" in strategy)
    assert ("offload_param" in zero) == (strategy == "zero3_offload")


@pytest.mark.parametrize("logger", ["tensorboard", "csv", "wandb", "many"])
def test_loggers_and_callbacks_instantiate(logger, tmp_path, monkeypatch):
    from lightning.pytorch.loggers import Logger

    from dsdebug.trainer.instantiate import instantiate_callbacks, instantiate_loggers

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = _compose([f"logger={logger}", f"hydra.run.dir={tmp_path}"])
    OmegaConf.update(cfg, "paths.output_dir", str(tmp_path), force_add=True)
    loggers = instantiate_loggers(cfg.logger)
    assert loggers and all(isinstance(lg, Logger) for lg in loggers)
    assert len(instantiate_callbacks(cfg.callbacks)) == len([c for c in cfg.callbacks.values() if c]) >= 6 + 12
    assert os.getcwd() == str(REPO) or not (Path.cwd() / "wandb").exists()


def test_optim_config_builds_a_warmup_cosine_schedule():
    import torch

    cfg = _compose(["optim.lr=1e-3"])
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    opt = instantiate(cfg.optim.optimizer)(params)
    sched = instantiate(cfg.optim.scheduler)(opt, total_steps=100)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert 0 < lrs[0] < 2e-4 and max(lrs) == pytest.approx(1e-3, rel=1e-6)  # the first update learns; warmup to the peak
    assert lrs.index(max(lrs)) == 10  # 10% warmup
    assert lrs[-1] == pytest.approx(1e-4, rel=0.05)  # cosine to min_lr_ratio * peak


def test_callbacks_are_added_removed_and_tuned_from_the_command_line():
    cfg = _compose(["~callbacks.lr_monitor", "callbacks.model_checkpoint.every_n_train_steps=5"])
    assert "lr_monitor" not in cfg.callbacks and cfg.callbacks.model_checkpoint.every_n_train_steps == 5


def test_smoke_experiment_is_a_short_quiet_run_that_later_overrides_beat(tmp_path):
    """experiment=smoke (the tests' base and a user's 1-minute sanity run): a few steps on a slice, CSV logs,
    no progress bar; what comes after it on the command line wins, logger and callbacks included."""
    from dsdebug.trainer.instantiate import instantiate_callbacks

    cfg = _compose(["experiment=smoke"])
    OmegaConf.update(cfg, "paths.output_dir", str(tmp_path), force_add=True)
    t = cfg.trainer
    assert (t.max_steps, t.val_check_interval, t.limit_val_batches, t.log_every_n_steps) == (4, 2, 2, 1)
    assert t.enable_progress_bar is False and cfg.data.max_tokens == 60000 and list(cfg.logger) == ["csv"]
    names = {type(c).__name__ for c in instantiate_callbacks(cfg.callbacks)}
    assert "ThrottledRichProgressBar" not in names and "VerifiedModelCheckpoint" in names
    cfg = _compose(["experiment=smoke", "logger=tensorboard", "trainer.max_steps=9", "+callbacks=rich_progress_bar",
                    "trainer.enable_progress_bar=true"])
    OmegaConf.update(cfg, "paths.output_dir", str(tmp_path), force_add=True)
    assert list(cfg.logger) == ["tensorboard"] and cfg.trainer.max_steps == 9
    assert "ThrottledRichProgressBar" in {type(c).__name__ for c in instantiate_callbacks(cfg.callbacks)}
