"""grad_monitor: planted NaN / exploding / spiking gradients are named before the update,
skip and stop drop the bad update, healthy steps are silent -- 1 process (ZeRO-2, DDP) and
2 processes (ZeRO-3, DDP). The runs are shared with test_cb_freeze_verify.py (tests/planted/grads.py)
and, for 2-process DDP, with other callbacks' tests (tests/helpers/shared_runs.py)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from dsdebug.callbacks.grad_access import layer_of
from dsdebug.callbacks.grad_monitor import GradMonitor
from dsdebug.errors import ConfigError
from tests.helpers.runs import assert_ok, metrics
from tests.helpers.findings import one, read_findings
from tests.helpers.shared_runs import grad_run, healthy_run, planted_ddp_run
from tests.planted.grads import changed_params


def loud(records: list[dict]) -> list[tuple]:
    return [(r["code"], r["step"]) for r in records if r["severity"] != "info"]


def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"max_norm": -1}, "max_norm"), ({"every_n_steps": 1.5}, "every_n_steps"),
                        ({"ema_beta": 1.0}, "ema_beta"), ({"on_error": "ignore"}, "on_error")):
        with pytest.raises(ConfigError, match=f"callbacks.grad_monitor.{key}=.*valid: ") as e:
            GradMonitor(**kwargs)
        assert "\n" not in str(e.value)


def test_layers_are_blocks_or_modules():
    assert layer_of("model.layers.3.mlp.experts.down_proj") == "model.layers.3"
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_of("lm_head.weight") == "lm_head"


def test_plain_optimizer_skip_leaves_weights_and_adam_state_untouched():
    from dsdebug.models.lm_module import _arm_skip
    from dsdebug.trainer.skip_step import arm_skip

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.1)
    p.grad = torch.ones(4)
    opt.step()
    weights, state = p.detach().clone(), copy.deepcopy(opt.state[p])
    p.grad = torch.full((4,), 1e6)
    for trainer in (SimpleNamespace(strategy=object(), global_step=1),  # Lightning's own strategies: the module
                    SimpleNamespace(strategy=object(), global_step=1, global_rank=0)):  # ... and our DDP's way
        p.grad = torch.full((4,), 1e6)
        undo = _arm_skip(trainer, opt) if not hasattr(trainer, "global_rank") else arm_skip(trainer, opt)
        opt.step()
        undo()
        assert torch.equal(p.detach(), weights)
        assert all(torch.equal(state[k], opt.state[p][k]) for k in state)


def test_zero2_nan_explosion_spike_vanishing_named_and_skipped(tmp_path_factory, shared_cache):
    _, run_dir = grad_run("zero2_dead_net", tmp_path_factory, shared_cache)  # in this process
    found = read_findings(run_dir, "grad_monitor")
    nan = one(found, "nonfinite_grad")  # planted: one NaN element in layers.0.weight's gradient at step 2
    assert nan["step"] == 2 and nan["severity"] == "error"
    assert "NaN gradient in layers.0.weight (layer layers.0) at step 2" in nan["message"]
    assert nan["details"]["params"] == ["layers.0.weight"]
    assert nan["details"]["params_finite_before_update"] is True  # reported before the update
    boom = one(found, "grad_exploding")  # planted: layers.1.weight's gradient x 1e6 at step 3
    assert boom["step"] == 3 and boom["details"]["param"] == "layers.1.weight"
    assert "largest in layers.1.weight" in boom["message"]
    spike = one(found, "grad_spike")  # planted: x 30 at step 5 (below max_norm)
    assert spike["step"] == 5 and spike["severity"] == "warning" and spike["details"]["param"] == "layers.1.weight"
    vanish = one(found, "vanishing_grad")  # the net's unused and detached layers get no gradient
    assert set(vanish["details"]["layers"]) == {"unused", "detached"}
    assert {c for c, _ in loud(found)} == {"nonfinite_grad", "grad_exploding", "grad_spike", "vanishing_grad"}
    assert not [s for c, s in loud(found) if s < 2 and c != "vanishing_grad"]  # healthy steps are silent
    # on_error=skip: the two error steps left every weight unchanged (DeepSpeed path); a normal step did not
    assert changed_params(run_dir, 2) == [] and changed_params(run_dir, 3) == []
    assert "layers.0.weight" in changed_params(run_dir, 1)
    summary = one(found, "grad_summary")
    assert summary["details"]["steps_checked"] == 6 and summary["details"]["source"] == "zero12"


def test_ddp_stop_saves_last_good_weights_and_exits_3(tmp_path_factory, shared_cache):
    proc, run_dir = grad_run("ddp_stop", tmp_path_factory, shared_cache)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stopped by grad_monitor/nonfinite_grad at step 3" in errors[0]
    found = read_findings(run_dir, "grad_monitor")
    nan = one(found, "nonfinite_grad")
    assert nan["step"] == 3 and "NaN gradient in lm_head.weight" in nan["message"]
    assert loud(found) == [("nonfinite_grad", 3)]
    assert metrics(run_dir)["status"] == "stopped_by_check" and metrics(run_dir)["global_step"] == 4
    assert changed_params(run_dir, 3) == [] and len(changed_params(run_dir, 2)) > 0  # torch-optimizer skip path
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


@pytest.mark.slow
def test_zero3_two_processes_nan_and_explosion_named_skip_and_norms_exact(tmp_path_factory, shared_cache):
    proc, run_dir = grad_run("zero3_2proc", tmp_path_factory, shared_cache)
    assert_ok(proc)
    found = read_findings(run_dir, "grad_monitor")
    nan = one(found, "nonfinite_grad")  # planted on rank 1 only, before the reduce-scatter
    assert nan["step"] == 3 and nan["details"]["params"] == ["model.layers.0.mlp.up_proj.weight"]
    assert "NaN gradient in model.layers.0.mlp.up_proj.weight (layer model.layers.0)" in nan["message"]
    assert nan["rank"] is None and nan["details"]["params_finite_before_update"] is True
    boom = one(found, "grad_exploding")  # planted on rank 0: o_proj's gradient x 1e6 at step 4
    assert boom["step"] == 4 and boom["details"]["param"] == "model.layers.0.self_attn.o_proj.weight"
    assert loud(found) == [("nonfinite_grad", 3), ("grad_exploding", 4)]  # steps 0-2 healthy: silent
    assert changed_params(run_dir, 4) == []  # on_error=skip under ZeRO-3: no weight moved
    assert one(found, "grad_summary")["details"]["source"] == "zero3"
    # under ZeRO-3 (param.grad is None) the norms come from the partitions: same value as DDP's full
    # grads (the healthy DDP run: same seed, data and model; layer 0 trains in both at step 0)
    ddp_dir, _ = healthy_run("ddp", tmp_path_factory, shared_cache)
    z3, ddp = _layer0_norm_at_step0(run_dir), _layer0_norm_at_step0(ddp_dir)
    assert z3 > 0 and math.isclose(z3, ddp, rel_tol=1e-5), (z3, ddp)


def test_ddp_two_processes_forward_nan_on_rank1_names_the_rank(tmp_path_factory, shared_cache):
    run_dir, _ = planted_ddp_run(tmp_path_factory, shared_cache)
    found = read_findings(run_dir, "grad_monitor")
    nan = one(found, "nonfinite_grad")  # planted: the MLP's output layer gives NaN on rank 1 at step 5
    assert nan["step"] == 5 and nan["rank"] == 1 and nan["details"]["nonfinite_loss_ranks"] == [1]
    assert "non-finite loss on rank(s) [1] at step 5" in nan["message"]
    assert loud(found) == [("nonfinite_grad", 5)]  # steps 0-4 healthy: silent


def _layer0_norm_at_step0(run_dir) -> float:
    import csv

    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("grad/norm/model.layers.0") and r["step"] == "0"]
    return float(rows[0]["grad/norm/model.layers.0"])


def test_early_spike_rule_judges_before_the_ema_is_warm():
    """Before warmup_steps the EMA is not trusted; 10x the median of the healthy norms so
    far is a spike from the 4th step on, while a few-fold early drift is not."""
    from dsdebug.callbacks.grad_monitor import GradMonitor

    gm = GradMonitor(warmup_steps=50)
    for norm in (2.0, 1.2, 3.5):  # healthy early drift (measured: a few-fold in the first steps)
        assert not gm._early_spike(norm)
        gm._update_ema(norm)
    assert not gm._early_spike(15.0) and gm._early_spike(40.0)  # median 2.0: x7.5 no, x20 yes
    assert not GradMonitor(warmup_steps=50, early_factor=0)._early_spike(40.0)
    gm._healthy_seen = 50  # warm: the EMA rule takes over
    assert not gm._early_spike(40.0)


def test_sums_of_squares_per_tensor_make_no_copy_per_step():
    """grad_monitor and layer_health sum each gradient's squares on its device; the index of the present ones
    is copied to the device once (a host-to-device copy waits for the GPU's stream: a sync per step before)."""
    from dsdebug.callbacks.grad_access import on_device, sumsq_per_tensor

    a, b = torch.tensor([3.0, 4.0]), torch.tensor([1.0])
    assert sumsq_per_tensor([a, b]).tolist() == [25.0, 1.0]
    assert sumsq_per_tensor([a, None, torch.empty(0), b], 2.0).tolist() == [6.25, 0.0, 0.0, 0.25]
    assert sumsq_per_tensor([None, None]).tolist() == [0.0, 0.0]
    before = on_device.cache_info()
    for _ in range(5):  # five steps, the same parameters missing: no new index tensor
        sumsq_per_tensor([a, None, b])
    after = on_device.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 4


@pytest.mark.parametrize("strategy, clip", [("ddp", "optim.grad_clip=1.0e-5"),  # Lightning clips (gradient_clip_val)
                                            ("zero2", "optim.grad_clip=1.0e-5")])  # DeepSpeed's gradient_clipping
def test_clipping_that_shrinks_every_update_is_named_with_the_key(strategy, clip, tmp_path, shared_cache):
    """Issue 34: a clip threshold orders of magnitude below the gradient norm shrinks every update (the run trains as
    with a far smaller LR) and nothing said so outside doctor=true. Named within the first 5 steps."""
    from tests.helpers.runs import SMOKE, TINY_NET, train_in_process

    run_dir = tmp_path / "run"
    out = train_in_process([*SMOKE, *TINY_NET, "trainer.max_steps=6", f"strategy={strategy}", clip,
                            "+callbacks=grad_monitor"], run_dir, shared_cache)
    assert out["status"] == "completed"
    f = one(read_findings(run_dir, "grad_monitor"), "clip_dominates")
    assert f["severity"] == "warning" and f["step"] == 4 and f["details"]["clip"] == pytest.approx(1e-5), f
    assert f["details"]["shrink"] > 1e4 and "optim.grad_clip" in f["advice"], f


def test_the_default_clip_on_a_healthy_run_says_nothing(tmp_path, shared_cache):
    from tests.helpers.runs import SMOKE, TINY_NET, train_in_process

    run_dir = tmp_path / "run"
    train_in_process([*SMOKE, *TINY_NET, "trainer.max_steps=6", "+callbacks=grad_monitor"], run_dir, shared_cache)
    assert not [r for r in read_findings(run_dir, "grad_monitor") if r["code"] == "clip_dominates"]


@pytest.mark.parametrize("attrs,expected", [
    ({}, None),  # a trainer-like object without clip settings (a custom loop, a test double): no clip, no error
    ({"gradient_clip_val": None}, None),
    ({"gradient_clip_val": 0.5}, 0.5),
    ({"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, None),  # value clipping has no norm threshold
    ({"gradient_clip_val": "auto"}, None),
])
def test_run_clip_reads_the_trainers_norm_clip_and_tolerates_its_absence(attrs, expected):
    from dsdebug.callbacks.grad_access import run_clip

    assert run_clip(SimpleNamespace(strategy=object(), **attrs)) == expected
