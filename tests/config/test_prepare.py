"""prepare(cfg): the config is validated once and derived once on the way to fit."""

from __future__ import annotations

import pytest
from omegaconf import open_dict

from tests.helpers.runs import SMOKE, TINY_NET, compose_as_hydra_main, metrics


def _compose(overrides: list[str], run_dir, cache):
    """As @hydra.main hands the task function its config."""
    return compose_as_hydra_main(overrides, run_dir, cache)


@pytest.fixture
def validations(monkeypatch):
    """Counts every validate_config call, whoever makes it and however it was imported:
    _check_required is looked up in validate.py's globals by validate_config itself."""
    from dsdebug.config import validate

    calls = []
    original = validate._check_required
    monkeypatch.setattr(validate, "_check_required", lambda cfg: (calls.append(1), original(cfg))[1])
    yield calls
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None


def test_cli_run_validates_once_on_the_way_to_fit(tmp_path, shared_cache, validations):
    """The Hydra task function (trainer/cli.py run), a 1-process tiny fit: exactly one validation,
    and the derivations happened (the optimizer's lr is the scaled optim.lr, set by prepare)."""
    from dsdebug.train import run

    run_dir = tmp_path / "run"
    cfg = _compose([*SMOKE, *TINY_NET, "trainer.max_steps=2", "export.hf=false"], run_dir, shared_cache)
    batch = cfg.data.batch_size
    with open_dict(cfg):
        cfg.optim.scale_lr_base_batch_size = 2 * batch  # linear scaling: half of optim.lr
    run(cfg)
    assert len(validations) == 1, f"validate_config ran {len(validations)} times on the way to fit"
    assert metrics(run_dir)["global_step"] == 2
    assert cfg.optim.optimizer.lr == pytest.approx(cfg.optim.lr / 2)  # derived once, by prepare


def test_prepare_refuses_a_second_call_and_train_an_unprepared_config(tmp_path, shared_cache, validations):
    from dsdebug.config.prepare import is_prepared, prepare
    from dsdebug.trainer.entry import train

    cfg = _compose([*SMOKE, *TINY_NET], tmp_path / "run", shared_cache)
    with pytest.raises(RuntimeError, match="needs the run plan"):
        train(cfg)
    assert not is_prepared(cfg) and not validations
    assert prepare(cfg).cfg is cfg and is_prepared(cfg)
    with pytest.raises(RuntimeError, match="already called"):
        prepare(cfg)
    assert len(validations) == 1
    twin = _compose([*SMOKE, *TINY_NET], tmp_path / "run2", shared_cache)
    assert not is_prepared(twin)  # by identity, not by content


def test_bad_input_fails_in_prepare_before_anything_is_built(tmp_path, shared_cache, validations):
    from dsdebug.config.prepare import is_prepared, prepare
    from dsdebug.errors import ConfigError

    cfg = _compose([*SMOKE, *TINY_NET, "optim.lr=-1"], tmp_path / "run", shared_cache)
    with pytest.raises(ConfigError, match="optim.lr must be a positive number"):
        prepare(cfg)
    assert not is_prepared(cfg) and len(validations) == 1
