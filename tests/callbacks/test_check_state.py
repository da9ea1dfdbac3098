"""A check's running state survives a resume: ``DebugCallback.state_attrs`` -> ``state_dict`` ->
the checkpoint -> ``load_state_dict``.

- unit: every check with state round-trips it through ``torch.save``/``torch.load(weights_only=True)``
  into a fresh instance, in the same container types (a deque keeps its maxlen); a check without
  state saves ``{}``; checks that build their per-layer state in ``on_fit_start`` keep what Lightning
  restored before it (DDP) or after it (DeepSpeed).
- integration: a run interrupted at step 3 and resumed with ``resume=latest`` to step 6 ends with
  the same GradMonitor (and LayerHealth, LossSpike) state in its step-6 checkpoint as a run that was
  never interrupted; GradMonitor's warm-up counter counts all 6 steps.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

import dsdebug.callbacks as callbacks
from tests.helpers.runs import SMOKE, TINY_NET, train_in_process

CHECKS = sorted(name for name in callbacks._MODULES if name != "DebugCallback")

# A non-default value for every attribute a check keeps across a resume (a new entry in a check's
# state_attrs needs one here: test_every_state_attr_has_a_sample).
SAMPLES: dict[str, dict[str, Any]] = {
    "FreezeVerify": {"_base_sums": [[1.5, 2.25], [-0.5, 0.25]]},
    "GradMonitor": {"_ema_mean": 1.25, "_ema_var": 0.5, "_healthy_seen": 17, "_vanished": {"model.layers.1"},
                    "_counts": {"grad_spike": 2}, "_checked": 20, "_largest": (3.5, 12),
                    "_early_norms": [0.8, 1.1, 0.95], "_clip_ratios": [150.0, 210.5]},
    "WeightNorm": {"_first": [1.5, None], "_prev": [0.75, None], "_falling": [3, 0], "_named": [2, 0],
                   "_decay_log": [-0.25, 0.0], "_lowest": [0.5, None], "_checks": 9, "_counts": {"weight_collapse": 1}},
    "LayerHealth": {"_low_grad": [0, 2], "_low_update": [1, 0], "_seen": [5, 4], "_log_ema": [-1.5, 0.25],
                    "_exploding": {1}, "_counts": {"layer_grad_exploding": 1},
                    "_closest": {"min_grad_rel": 0.01, "min_update_rel": math.inf, "max_explode_ratio": 2.0,
                                 "min_early_rel": 0.2, "min_update_vs_optimizer": 0.3},
                    "_grad_checks": 7, "_lost": [3, 0], "_lost_causes": {"eps": ["model.layers.0"]}},
    "OutcomeMonitor": {"_gaps": [0.1, 0.25], "_reported": ["val_gap_growing"]},
    "LossSpike": {"_rollbacks": 1, "_in_row": 2, "_counts": {"loss_spike": 3}, "_checked": 40,
                  "_largest": {"score": 1.5, "step": 30, "z": 9.0, "jump": 0.5}},
    "MixedPrecisionCheck": {"streak": 2, "skipped": 5, "steps": 60, "_recent": deque([False, True, True], maxlen=100),
                            "_at_floor_reported": True, "_found": True, "search_skipped": 6, "search_scale": 2048.0},
    "MoERouter": {"_imbalanced": [0, 2], "_dead_seen": {(1, 3), (2, 0)}, "_aux": [(1.2, 7.5), (1.3, 7.1)],
                  "_aux_reported": True, "_counts": {"dead_experts": 1}},
    "NaNTriage": {"reruns": 2, "labels": {12: "transient", 30: "reproducible"}},
    "ReplicaParity": {"_counts": {"replica_divergence": 1}, "_checks": 4,
                      "_state": {"param": {"diverged": True, "last_equal": 3, "since": 5},
                                 "optimizer": {"diverged": False, "last_equal": 5, "since": None},
                                 "buffer": {"diverged": False, "last_equal": None, "since": None}}},
}


@pytest.fixture
def build(tmp_path, monkeypatch):
    """Build checks with their defaults; undo what some do to the process at construction (env, flags)."""
    monkeypatch.chdir(tmp_path)  # comm_debug prepares its flight-recorder folder in the run dir (cwd)
    built: list = []

    def make(name: str) -> Any:
        cb = getattr(callbacks, name)()
        built.append(cb)
        return cb

    yield make
    for cb in built:
        if "teardown" in type(cb).__dict__:  # comm_debug/reproducibility restore env and flags, log_sync its handler
            cb.teardown(None, None, "fit")


def _roundtrip(cb: Any, path: Path) -> dict[str, Any]:
    torch.save(cb.state_dict(), path)
    return torch.load(path, weights_only=True)


def _assert_same(got: Any, want: Any, fresh_default: Any, where: str) -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, deque):
        assert list(got) == list(want) and got.maxlen == fresh_default.maxlen, where
    else:
        assert got == want, where


def test_every_state_attr_has_a_sample_and_exists_after_init(build):
    for name in CHECKS:
        cls = getattr(callbacks, name)
        assert set(cls.state_attrs) == set(SAMPLES.get(name, {})), name
        cb = build(name)
        # the attribute exists from __init__: a load before on_fit_start (DDP) finds its container type
        missing = [a for a in cls.state_attrs if not hasattr(cb, a)]
        assert not missing, f"{name}: {missing} not set in __init__"


@pytest.mark.parametrize("name", CHECKS)
def test_state_roundtrips_through_torch_save_weights_only(name, build, tmp_path):
    cb = build(name)
    if not type(cb).state_attrs:
        assert cb.state_dict() == {}
        return
    for attr, value in SAMPLES[name].items():
        setattr(cb, attr, copy.deepcopy(value))
    saved = _roundtrip(cb, tmp_path / "state.pt")
    assert set(saved) >= set(type(cb).state_attrs)
    fresh, reference = build(name), build(name)
    fresh.load_state_dict(saved)
    for attr, want in SAMPLES[name].items():
        _assert_same(getattr(fresh, attr), want, getattr(reference, attr), f"{name}.{attr}")


def test_loss_spike_keeps_the_window_and_the_warmup(build, tmp_path):
    cb = build("LossSpike")  # window 50, warm-up 20
    for step in range(80):
        cb.detector.push(step, 5.0 - step / 100, 1.0 + step / 1000)
    fresh = build("LossSpike")
    fresh.load_state_dict(_roundtrip(cb, tmp_path / "state.pt"))
    assert list(fresh.detector.history) == list(cb.detector.history)[-50:]
    assert fresh.detector.history.maxlen == cb.detector.history.maxlen
    assert fresh.detector.judge(4.2, 1.08) == cb.detector.judge(4.2, 1.08)
    # a checkpoint written before state_attrs (keys "history", "rollbacks") still loads
    old = build("LossSpike")
    old.load_state_dict({"history": [(1, 2.0, None)], "rollbacks": 2})
    assert list(old.detector.history) == [(1, 2.0, None)] and old._rollbacks == 2


def _layer_health_fit(cb: Any, layers: int) -> None:
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(layers)])  # layers "0", "1", ...
    cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace()), net)


def _moe_fit(cb: Any, layers: int) -> None:
    moe = SimpleNamespace(observe=lambda fn: True, layers=list(range(1, layers + 1)), num_experts=4, top_k=2,
                          source="model")
    cb.on_fit_start(SimpleNamespace(global_step=0, global_rank=0), SimpleNamespace(moe=moe))


@pytest.mark.parametrize("name, fit", [("LayerHealth", _layer_health_fit), ("MoERouter", _moe_fit)])
def test_state_built_at_fit_start_survives_either_restore_order(name, fit, build, tmp_path):
    """DDP restores callbacks before on_fit_start (which builds the per-layer state), DeepSpeed after it."""
    cb = build(name)
    fit(cb, 2)
    for attr, value in SAMPLES[name].items():
        setattr(cb, attr, copy.deepcopy(value))
    saved = _roundtrip(cb, tmp_path / "state.pt")
    before, after = build(name), build(name)
    before.load_state_dict(saved)  # DDP
    fit(before, 2)
    fit(after, 2)
    after.load_state_dict(saved)  # DeepSpeed
    for restored in (before, after):
        restored.on_train_start(SimpleNamespace(global_step=3), None)
        for attr, want in SAMPLES[name].items():
            _assert_same(getattr(restored, attr), want, getattr(cb, attr), f"{name}.{attr}")
    # another net (3 layers): the per-layer state does not fit, the check starts afresh
    other = build(name)
    other.load_state_dict(saved)
    fit(other, 3)
    assert len(other._imbalanced if name == "MoERouter" else other._seen) == 3
    assert other._counts == {}


# ---- integration: interrupted + resume=latest == uninterrupted ------------------------------------------
class StopAt(Callback):
    """Ends the fit after optimizer step ``step``, as an interruption would (the periodic checkpoint of that
    step is written: ModelCheckpoint runs after the other callbacks)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


RESUME_RUN = [*SMOKE, *TINY_NET, "strategy=ddp", "trainer.max_steps=6", "trainer.val_check_interval=100",
              "callbacks.model_checkpoint.every_n_train_steps=3", "export.fp32=false", "export.hf=false",
              "+callbacks=[grad_monitor,layer_health,loss_spike]", "callbacks.grad_monitor.every_n_steps=1"]
STOP_AT_3 = [f"+callbacks.stop._target_={__name__}.StopAt", "+callbacks.stop.step=3"]


def _callback_state(ckpt: Path, cls: str) -> dict[str, Any]:
    """A check's state in a checkpoint (Lightning keys it by the callback's state_key): a DDP .ckpt file,
    or a DeepSpeed checkpoint dir, where Lightning's client state sits in the model-states file."""
    if ckpt.is_dir():
        (states_file,) = ckpt.glob("*/mp_rank_00_model_states.pt")
        states = torch.load(states_file, weights_only=False)["callbacks"]  # DeepSpeed's file holds more than tensors
    else:
        states = torch.load(ckpt, weights_only=True)["callbacks"]
    (state,) = [v for k, v in states.items() if k == cls or k.startswith(f"{cls}{{")]
    return state


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])  # zero2: the default, a DeepSpeed checkpoint dir
def test_grad_monitor_ema_survives_resume_latest(strategy, tmp_path, shared_cache):
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    run = [*RESUME_RUN, f"strategy={strategy}"]
    train_in_process(run + STOP_AT_3, interrupted, shared_cache)
    at_3 = _callback_state(interrupted / "checkpoints" / "step_000003.ckpt", "GradMonitor")
    assert not (interrupted / "checkpoints" / "step_000006.ckpt").exists()  # it stopped at step 3
    m = train_in_process(run + ["resume=latest"], interrupted, shared_cache)  # in place, like a requeue
    assert m["resumed_from"].endswith("step_000003.ckpt") and m["global_step"] == 6
    train_in_process(run, uninterrupted, shared_cache)

    resumed = _callback_state(interrupted / "checkpoints" / "step_000006.ckpt", "GradMonitor")
    straight = _callback_state(uninterrupted / "checkpoints" / "step_000006.ckpt", "GradMonitor")
    assert at_3["_healthy_seen"] == 3 and at_3["_checked"] == 3
    # warm-up counted over all 6 steps: a load_state_dict that did nothing would leave 3 here
    assert resumed["_healthy_seen"] == straight["_healthy_seen"] == 6
    assert resumed["_checked"] == 6 and resumed["_ema_mean"] > 0 and resumed["_ema_var"] > 0
    assert resumed == straight
    for cls in ("LayerHealth", "LossSpike"):
        assert _callback_state(interrupted / "checkpoints" / "step_000006.ckpt", cls) == \
            _callback_state(uninterrupted / "checkpoints" / "step_000006.ckpt", cls), cls
    assert len(_callback_state(interrupted / "checkpoints" / "step_000006.ckpt", "LossSpike")["history"]) == 6
