"""The run plan (config/plan.py): prepare returns it, the config is read-only after it, and every value
prepare changed is in the plan with the reason."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ReadonlyConfigError

from tests.helpers.runs import SMOKE, TINY_NET, compose_as_hydra_main, metrics


@pytest.fixture
def composed(tmp_path, shared_cache):
    made = []

    def compose(overrides, name="run"):
        made.append(1)
        return compose_as_hydra_main([*SMOKE, *TINY_NET, *overrides], tmp_path / name, shared_cache)

    yield compose
    if made:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().cfg = None


def test_the_config_is_read_only_after_prepare_however_it_is_written(composed):
    from dsdebug.config.prepare import prepare

    cfg = composed([])
    plan = prepare(cfg)
    assert plan.cfg is cfg
    writes = {
        "attribute": lambda: setattr(cfg.optim, "lr", 1.0),
        "item": lambda: cfg.data.__setitem__("batch_size", 3),
        "new key under open_dict": lambda: _under_open_dict(cfg),
        "merge": lambda: cfg.merge_with({"seed": 7}),
        "update": lambda: OmegaConf.update(cfg, "trainer.max_steps", 9),
        "delete": lambda: cfg.trainer.__delitem__("max_steps"),
        "the asked config": lambda: setattr(plan.asked.optim, "lr", 1.0),
    }
    for how, write in writes.items():
        with pytest.raises(ReadonlyConfigError):
            write()
            pytest.fail(f"a write by {how} went through")
    with pytest.raises(Exception):  # frozen dataclass
        plan.lr = 1.0


def _under_open_dict(cfg):
    with open_dict(cfg):
        cfg.callbacks.extra = {"_target_": "x"}


def test_the_plan_holds_what_prepare_derived_and_says_why_each_value_changed(composed):
    """Global batch -> per-rank batch, linear LR scaling, fused: auto: each derived value is typed in the plan,
    the composed config is kept as asked, and each changed key has prepare's own reason."""
    from dsdebug.config.prepare import prepare

    cfg = composed(["data.global_batch_size=8", "trainer.accumulate_grad_batches=2",
                    "+optim.scale_lr_base_batch_size=4", "optim.lr=1e-3", "optim.optimizer.fused=auto"])
    plan = prepare(cfg)
    assert (plan.world_size, plan.per_rank_batch, plan.accumulate, plan.global_batch) == (1, 4, 2, 8)
    assert plan.lr_asked == pytest.approx(1e-3) and plan.lr == pytest.approx(2e-3)
    assert plan.fused is True and plan.asked_for("optim.optimizer.fused") == "auto"
    changed = {a.key: a for a in plan.adjustments}
    assert set(changed) >= {"optim.optimizer.lr", "optim.optimizer.fused"}
    assert changed["optim.optimizer.lr"].asked == pytest.approx(1e-3)
    assert changed["optim.optimizer.lr"].used == pytest.approx(2e-3)
    if plan.asked_for("data.batch_size") != 4:
        assert changed["data.batch_size"].used == 4 and "global_batch_size" in changed["data.batch_size"].why
    assert all(a.why != "changed by prepare" for a in plan.adjustments), plan.adjustments
    assert plan.used("optim.optimizer.lr") == pytest.approx(2e-3)


def test_an_external_launchers_world_is_adopted_by_prepare_not_by_the_check(composed, monkeypatch):
    """torchrun's 2 x 2 world: validation checks the rest against it and writes nothing; prepare adopts it
    and the plan says so."""
    from dsdebug.config.prepare import prepare
    from dsdebug.config.validate import validate_config

    for key, value in {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4",
                       "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    cfg = composed(["data.global_batch_size=8"])
    before = OmegaConf.to_container(cfg, resolve=False)
    assert validate_config(cfg) == {"devices": 2, "num_nodes": 2}
    assert OmegaConf.to_container(cfg, resolve=False) == before  # the check wrote nothing
    plan = prepare(cfg)
    assert (cfg.trainer.devices, cfg.trainer.num_nodes, plan.world_size, plan.per_rank_batch) == (2, 2, 4, 2)
    changed = {a.key: a for a in plan.adjustments}
    assert changed["trainer.devices"].used == 2 and "launcher" in changed["trainer.devices"].why


def test_a_run_never_writes_its_config_and_leaves_the_plan_next_to_the_resolved_config(tmp_path, shared_cache):
    """A whole tiny fit (debug=full: every check built and bound to the config) with the read-only config: any
    write after prepare would have raised; run_plan.json is written and agrees with config_resolved.yaml."""
    from tests.helpers.runs import train_in_process

    run_dir = tmp_path / "run"
    train_in_process([*SMOKE, *TINY_NET, "debug=full", "trainer.max_steps=3", "data.global_batch_size=4",
                      "export.hf=false"], run_dir, shared_cache)
    assert metrics(run_dir)["global_step"] == 3
    plan = json.loads((run_dir / "run_plan.json").read_text())
    resolved = OmegaConf.load(run_dir / "config_resolved.yaml")
    assert plan["per_rank_batch"] == resolved.data.batch_size == 4
    assert plan["lr"] == pytest.approx(resolved.optim.optimizer.lr)
    assert plan["precision"] == str(resolved.trainer.precision) and isinstance(plan["adjustments"], list)
    assert plan["resume"]["checkpoint"] is None and plan["resume"]["in_place_step"] is None  # a fresh run
