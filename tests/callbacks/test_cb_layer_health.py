"""layer_health: layers whose gradients vanish relative to the rest, whose updates are negligible
(a tiny per-group LR that AdamW's normalisation hides from gradient checks) and whose gradients
explode against their own history are named -- detection logic in-process, planted bugs in a
1-process ZeRO-2 run, and a 2-process ZeRO-3 run whose per-layer values are checked against
full gradients and gathered weights (tests/planted/layers.py)."""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import pytest
import torch

from dsdebug.callbacks.layer_health import LayerHealth
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel
from tests.helpers.runs import SMOKE, assert_ok, only_run_dir, run_train, train_in_process

LAYERS = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "lm_head"]
NUMEL = [4096 * 32, 2000, 2000, 2000, 32, 4096 * 32]


def _cb(**kwargs) -> LayerHealth:
    cb = LayerHealth(**{"warmup_steps": 3, "patience": 3, **kwargs})
    cb.set_layers(LAYERS, NUMEL)
    return cb


def _g_sq(rms: list[float]) -> torch.Tensor:
    return torch.tensor([r * r * n for r, n in zip(rms, NUMEL)], dtype=torch.float64)


def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"ratio_floor": 1.5}, "ratio_floor"), ({"patience": 0}, "patience"),
                        ({"every_n_steps": -1}, "every_n_steps"), ({"explode_factor": 0.5}, "explode_factor"),
                        ({"grad_every_n_steps": True}, "grad_every_n_steps"), ({"ema_beta": 1.0}, "ema_beta")):
        with pytest.raises(ConfigError, match=f"callbacks.layer_health.{key}=.*valid: ") as e:
            LayerHealth(**kwargs)
        assert "\n" not in str(e.value)


def test_relative_vanishing_needs_patience_is_per_element_and_reported_once_per_episode():
    configure_channel(None)
    cb = _cb(explode_factor=0)  # (a recovering layer's jump back is an explosion against its own history)
    # embedding: sparse rows dilute its RMS (x0.05) -- small, yet far from 1e-4; layers.1 at 1e-6 x the rest
    healthy = [5e-5, 1e-3, 1e-3, 1.2e-3, 3e-3, 5e-4]
    sick = [5e-5, 1e-3, 1e-9, 1.2e-3, 3e-3, 5e-4]
    assert cb.check(None, 0, _g_sq(healthy)) == []
    assert cb.check(None, 1, _g_sq(sick)) == [] and cb.check(None, 2, _g_sq(sick)) == []
    assert cb.check(None, 3, _g_sq(sick)) == [("layer_grad_vanishing_relative", "model.layers.1")]
    assert cb.check(None, 4, _g_sq(sick)) == []  # same episode: said once
    cb.check(None, 5, _g_sq(healthy))
    for step in (6, 7):
        assert cb.check(None, step, _g_sq(sick)) == []
    assert cb.check(None, 8, _g_sq(sick)) == [("layer_grad_vanishing_relative", "model.layers.1")]
    # the absolute norm (what grad_monitor's 1e-8 threshold sees) would not have caught it
    assert math.sqrt(float(_g_sq(sick)[2])) > 1e-8


def test_early_prior_names_a_block_orders_below_the_largest_even_when_all_blocks_are_low(tmp_path):
    """At a healthy init layers sit within ~1e-2 of each other; a branch scaled by 1e-4 is
    named after patience checks from step 0, also when every block is low (the median then is low too)."""
    configure_channel(tmp_path)
    cb = LayerHealth(patience=3, warmup_steps=5)
    layers = ["embed", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "norm", "head"]
    cb.set_layers(layers, [100.0] * 7)
    nnz = torch.full((7,), 100.0)
    healthy = torch.tensor([0.3, 1.0, 0.8, 0.9, 0.7, 2.0, 1.5]) ** 2 * 100
    all_low = healthy.clone()
    all_low[1:5] *= 1e-8  # every block's gradient x1e-4
    assert [cb.check(None, s, all_low, nnz=nnz) for s in range(3)][-1] == \
        [("layer_grad_vanishing_relative", f"model.layers.{i}") for i in range(4)]
    cb2 = LayerHealth(patience=3, warmup_steps=5)
    cb2.set_layers(layers, [100.0] * 7)
    sparse = nnz.clone()
    sparse[0] = 1.0  # the embedding: 1 row of 100 seen; its RMS over non-zero elements is what counts
    for s in range(20):  # healthy spread (x1/7): silent, also after the early window
        assert cb2.check(None, s, healthy * torch.tensor([0.01] + [1.0] * 6), nnz=sparse if s < 5 else None) == []
    assert cb2._closest["min_early_rel"] > 1e-2


def test_update_negligible_relative_to_median_skipped_steps_do_not_count():
    configure_channel(None)
    cb = _cb()
    ok = [4e-4, 1e-2, 1e-2, 1.1e-2, 2e-3, 1.4e-2]
    slow = [4e-4, 1e-2, 1e-2, 3e-9, 2e-3, 1.4e-2]
    assert cb.judge_updates(slow) == [] and cb.judge_updates(slow) == []
    assert cb.judge_updates([0.0] * 6) == []  # a skipped step (nothing moved): not judged, not counted
    found = cb.judge_updates(slow)
    assert [(code, LAYERS[i]) for code, i, *_ in found] == [("layer_update_negligible", "model.layers.2")]
    assert found[0][4]["relative"] < 1e-6
    cb2 = _cb()
    assert all(cb2.judge_updates(ok) == [] for _ in range(5))  # embedding at 1/25 of the median: fine
    assert cb2.judge_updates([None, *ok[1:]]) == []  # a layer with zero weights is not measured


def test_explosion_against_own_history_only_when_the_others_are_calm():
    configure_channel(None)
    cb = _cb()
    base = [0.05, 1.0, 0.8, 0.6, 0.02, 2.0]
    for _ in range(3):  # warm-up: no judgement
        assert cb.judge_explosion(base) == []
    assert cb.judge_explosion([v * 100 for v in base]) == []  # everyone x100: a global spike (grad_monitor's)
    cb = _cb()
    for _ in range(3):
        cb.judge_explosion(base)
    assert cb.judge_explosion([v * 2 if i != 3 else v for i, v in enumerate(base)]) == []  # x2: noise
    jump = [v * 100 if i == 3 else v for i, v in enumerate(base)]
    found = cb.judge_explosion(jump)
    assert [LAYERS[i] for _, i, *_ in found] == ["model.layers.2"] and found[0][4]["ratio"] > 50
    assert cb.judge_explosion(jump) == []  # still exploding: said once, history not polluted
    assert cb.judge_explosion(base) == [] and [LAYERS[i] for _, i, *_ in cb.judge_explosion(jump)] == ["model.layers.2"]


class _Logger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((step, metrics))


def test_hooks_measure_update_ratio_around_the_step_and_free_the_snapshot():
    configure_channel(None)
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    logger = _Logger()
    trainer = SimpleNamespace(global_rank=0, world_size=1, global_step=0, strategy=object(), loggers=[logger])
    cb = LayerHealth(every_n_steps=2, read_every_n_steps=1, first_update_steps=0)  # judged at once (queued: below)
    cb.on_fit_start(trainer, module)
    assert cb._layers == ["0", "1"]
    for step in range(3):
        trainer.global_step = step
        module.net(torch.randn(4, 8)).pow(2).mean().backward()
        before = [p.detach().clone() for p in module.net[1].parameters()]
        grads = [p.grad.clone() for p in module.net[1].parameters()]
        cb.on_before_optimizer_step(trainer, module, opt)
        opt.step()
        opt.zero_grad()
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, module, None, None, step)
        assert cb._pending is None  # the weight copy is gone after use
    assert [s for s, _ in logger.rows] == [0, 2]  # metrics at the cadence only
    expected = math.sqrt(sum(float((0.1 * g).pow(2).sum()) for g in grads) / sum(float(w.pow(2).sum()) for w in before))
    assert math.isclose(logger.rows[-1][1]["layers/update_ratio/1"], expected, rel_tol=1e-4)
    assert len(cb._rel_hist) == 3 and len(cb._upd_hist) == 2


def test_queued_steps_are_judged_in_order_at_their_own_steps_as_at_once():
    """read_every_n_steps=3: the per-layer sums wait on the device and are read 3 steps at a time; every step is
    judged, in order, with its own step, to the same numbers as judging each step at once."""
    def run(read_every: int) -> tuple[list, list, list]:
        cb = LayerHealth(every_n_steps=2, read_every_n_steps=read_every, first_update_steps=0)
        logger, seen = _drive(cb, 6)
        return seen, [r for r, _ in logger.rows], list(cb._rel_hist)

    at_once, queued = run(1), run(3)
    assert at_once[0] == [1, 2, 3, 4, 5, 6] and queued[0] == [0, 0, 3, 3, 3, 6]  # read every 3 steps
    assert queued[1] == at_once[1] == [0, 2, 4]  # metrics at their own steps
    assert queued[2] == at_once[2]


# ---- planted bugs in real runs ---------------------------------------------------------------
PLANTED = SMOKE + [
    "trainer.max_steps=7", "trainer.val_check_interval=7", "export.hf=false", "export.fp32=false",
    "+callbacks=layer_health", "callbacks.layer_health.every_n_steps=1", "callbacks.layer_health.warmup_steps=3",
    "model.net._target_=tests.planted.layers.BlockLM", "~model.net.hidden_size",
    "+model.net.scaled_block=1",  # (a) block 1's output x 1e-6
    "+model.net.slow_block=2", "optim.optimizer._target_=tests.planted.layers.adamw_planted_lr",  # (b) lr 1e-9
    "+callbacks.boom._target_=tests.planted.layers.ScaleBlockGrad", "+callbacks.boom.block=model.layers.3",
    "+callbacks.boom.from_step=4"]  # (c) block 3's gradient x 100 from step 4


def _findings(run_dir) -> list[dict]:
    path = run_dir / "findings.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["check"] == "layer_health"]


def test_zero2_planted_vanishing_block_slow_lr_group_and_exploding_block_are_named(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    m = train_in_process(PLANTED, run_dir, shared_cache)
    assert m["status"] == "completed"
    found = _findings(run_dir)
    loud = {(r["code"], r["details"]["layer"]): r for r in found if r["severity"] != "info"}
    assert set(loud) == {("layer_grad_vanishing_relative", "model.layers.1"),
                         ("layer_update_negligible", "model.layers.2"),
                         ("layer_grad_exploding", "model.layers.3")}, [(r["code"], r["message"]) for r in found]
    vanish = loud[("layer_grad_vanishing_relative", "model.layers.1")]
    assert vanish["step"] == 2 and "layer model.layers.1's gradient is" in vanish["message"]
    assert vanish["details"]["norm"] > 1e-8  # grad_monitor's absolute vanish_threshold would miss it
    slow = loud[("layer_update_negligible", "model.layers.2")]
    assert slow["step"] == 2 and slow["details"]["relative"] < 1e-4 and "model.layers.2 barely moves" in slow["message"]
    boom = loud[("layer_grad_exploding", "model.layers.3")]
    assert 4 <= boom["step"] <= 8 and boom["details"]["ratio"] > 50 and "step 4" in boom["message"]
    summary = [r for r in found if r["code"] == "layer_summary"][0]["details"]
    assert summary["source"] == "zero12" and summary["layers"][3] == "model.layers.2"
    assert summary["median_update_ratio"][3] < 1e-6 < summary["median_update_ratio"][2]


@pytest.mark.slow
def test_zero3_two_processes_values_match_full_tensors_and_name_the_block(tmp_path, shared_cache):
    args = SMOKE + [
        "trainer=ddp_sim", "strategy=zero3", "trainer.max_steps=5", "trainer.val_check_interval=5",
        "trainer.limit_val_batches=1", "export.hf=false", "export.fp32=false",
        "+callbacks=layer_health", "callbacks.layer_health.every_n_steps=1",
        # hidden 33: odd-sized norms, so ZeRO-3 pads rank 1's partitions (the padding must not count)
        "model.net._target_=tests.planted.layers.BlockLM", "model.net.hidden_size=33", "+model.net.scaled_block=1",
        "+callbacks.witness._target_=tests.planted.layers.LayerWitness", "+callbacks.witness.steps=[0,3]"]
    proc = run_train(args, tmp_path, shared_cache, timeout=600)
    assert_ok(proc)
    run_dir = only_run_dir(tmp_path)
    found = _findings(run_dir)
    loud = [(r["code"], r["details"]["layer"], r["step"]) for r in found if r["severity"] != "info"]
    assert loud == [("layer_grad_vanishing_relative", "model.layers.1", 2)]
    witness = json.loads((run_dir / "layer_witness.json").read_text())
    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r.get("layers/update_ratio/lm_head")}
    for step in ("0", "3"):
        layers = witness[step]
        rms = {k: math.sqrt(g / n) for k, (g, w, dw, n) in layers.items()}
        med = sorted(rms.values())[len(rms) // 2]  # 7 layers: the middle one
        for layer, (g, w, dw, n) in layers.items():
            got_u = float(rows[int(step)][f"layers/update_ratio/{layer}"])
            got_g = float(rows[int(step)][f"layers/grad_rel/{layer}"])
            assert math.isclose(got_u, math.sqrt(dw / w), rel_tol=1e-3), (step, layer, got_u, math.sqrt(dw / w))
            assert math.isclose(got_g, rms[layer] / med, rel_tol=1e-3), (step, layer, got_g, rms[layer] / med)
    assert [r for r in found if r["code"] == "layer_summary"][0]["details"]["source"] == "zero3"


EARLY_NETS = {  # residual branches scaled by 1e-4 from initialisation -> the blocks named
    "one_block": (["model.net._target_=tests.planted.layers.BlockLM", "+model.net.scaled_block=1",
                   "+model.net.scale=1e-4"], ["model.layers.1"]),
    "all_blocks": (["model.net._target_=tests.planted.early.ScaledResidualLM"],
                   [f"model.layers.{i}" for i in range(4)]),
}


@pytest.mark.parametrize("case", list(EARLY_NETS))
def test_residual_scaled_from_init_is_named_within_5_steps(case, tmp_path, shared_cache):
    net, blocks = EARLY_NETS[case]
    run_dir = tmp_path / "run"
    train_in_process(SMOKE + net + ["+callbacks=layer_health", "trainer.max_steps=5", "export.fp32=false",
                                    "export.hf=false", "trainer.val_check_interval=100"], run_dir, shared_cache)
    rows = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]
    found = [r for r in rows if r["code"] == "layer_grad_vanishing_relative"]
    assert sorted(r["details"]["layer"] for r in found) == blocks, found  # exactly the scaled blocks
    assert all(r["step"] <= 5 and r["details"]["early"] for r in found)  # onset is step 0
    assert all(r["details"]["grad_rel_largest"] < 1e-3 for r in found)


def test_the_first_steps_update_is_measured_each_step_and_judged_at_the_window_end():
    """first_update_steps=3: the update is measured at steps 0, 1, 2 (then at the cadence) and the queue is read at
    step 2 (a config that loses every update is named in the first steps, not at the first read_every_n_steps)."""
    logger, read = _drive(LayerHealth(every_n_steps=5, read_every_n_steps=10, first_update_steps=3), 12)
    assert [s for s, _ in logger.rows] == [0, 1, 2, 5, 10]
    assert read[:3] == [0, 0, 3] and read[-1] == 12


def _drive(cb: LayerHealth, steps: int) -> tuple[_Logger, list[int]]:
    """``steps`` SGD steps of a 2-layer net through the check's hooks (a trainer double, 1 rank); the logger and,
    after each step, how many gradient checks were judged."""
    configure_channel(None)
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    logger = _Logger()
    trainer = SimpleNamespace(global_rank=0, world_size=1, global_step=0, strategy=object(), loggers=[logger],
                              max_steps=steps)
    cb.on_fit_start(trainer, module)
    judged = []
    for step in range(steps):
        trainer.global_step = step
        module.net(torch.randn(4, 8)).pow(2).mean().backward()
        cb.on_before_optimizer_step(trainer, module, opt)
        opt.step()
        opt.zero_grad()
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, module, None, None, step)
        judged.append(len(cb._rel_hist))
    return logger, judged
