"""fp16 under a dynamic loss scaler (issue 33.2): the gradient checks judge unscaled gradients and leave the
overflows the scaler absorbs to it; only a streak or a collapsing scale is a finding, and nan_triage keeps its
reruns for the non-finite values the scaler does not absorb.

Two ways in. In-process, through the checks' hooks, with a stand-in for DeepSpeed's fp16 engine (``Fp16Engine``):
a real fp16 net (parameters and gradients fp16, as DeepSpeed holds them), DeepSpeed's own DynamicLossScaler,
the backward of loss x scale, the hooks in Lightning's order (the gradients are still loss-scaled in
``on_before_optimizer_step``: DeepSpeed unscales inside its step) and the engine's skip-on-overflow. And real
DeepSpeed fp16 through Lightning on this CPU (``tests/planted/precision.py`` ``DeepSpeedFp16OnCpu``; the
project refuses ``trainer.precision=16-mixed`` here, the planted callback switches it on).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from dsdebug.callbacks import grad_monitor as grad_monitor_module
from dsdebug.callbacks.layer_health import check as layer_health_module
from dsdebug.callbacks import nan_triage as nan_triage_module
from dsdebug.callbacks.grad_monitor import GradMonitor
from dsdebug.callbacks.layer_health import LayerHealth
from dsdebug.callbacks.loss_scale import ABSORBED_STREAK, OverflowJudge, ScalerReader
from dsdebug.callbacks.loss_spike import LossSpike
from dsdebug.callbacks.loss_spike import check as loss_spike_module
from dsdebug.callbacks.mixed_precision import MixedPrecisionCheck
from dsdebug.callbacks.mixed_precision import check as mixed_precision_module
from dsdebug.callbacks.nan_triage import NaNTriage
from dsdebug.findings import get_channel
from tests.helpers.findings import read_findings
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, TINY_NET, train_in_process
from tests.planted.nan import NaNOutput
from tests.planted.precision import RealFp16OnCpu

PLANT = "model.layers.1.mlp"  # the GPU kit's module (benchmarks/gpu_check.py PLANT_MODULE)


# ---- the overflow verdict itself --------------------------------------------------------------------------

def _ds_reader(init: float, min_scale: float = 1.0, dynamic: bool = True) -> tuple[ScalerReader, Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    scaler = (DynamicLossScaler(init_scale=init, scale_window=1000, min_scale=min_scale, delayed_shift=2,
                                consecutive_hysteresis=False, raise_error_at_min_scale=False)
              if dynamic else LossScaler(scale=init))
    return ScalerReader("deepspeed", SimpleNamespace(skipped_steps=0, optimizer=SimpleNamespace(loss_scaler=scaler))), \
        scaler


def _verdicts(judge: OverflowJudge, steps: str, scaler: Any = None) -> str:
    """One letter per step: f finite, o overflow (finite loss, non-finite gradients), n non-finite loss ->
    F finite, A absorbed, N not absorbed. ``scaler``: DeepSpeed's, stepped after each verdict as the engine does."""
    out = ""
    for s in steps:
        verdict = judge.judge(loss_finite=s != "n", grads_finite=s == "f")
        out += {"finite": "F", "absorbed": "A", "not_absorbed": "N"}[verdict]
        if scaler is not None and getattr(scaler, "dynamic", False):
            scaler.update_scale(s != "f")
    return out


@pytest.fixture
def ds_rank0(monkeypatch):
    from deepspeed.runtime.fp16 import loss_scaler as ls

    monkeypatch.setattr(ls, "dist", SimpleNamespace(get_rank=lambda: 0))  # its OVERFLOW! log line asks the rank


def test_the_initial_search_and_three_in_a_row_are_absorbed_the_fourth_is_not(ds_rank0):
    reader, scaler = _ds_reader(2.0 ** 32)
    judge = OverflowJudge(reader)
    # a 12-step search (2^32 -> 2^21), then healthy; later a streak of 5
    assert _verdicts(judge, "o" * 12 + "fff" + "ooooo", scaler) == "A" * 12 + "FFF" + "AAANN"
    assert ABSORBED_STREAK == 3 and judge.absorbed == 15 and judge.why.startswith("5 overflowed steps in a row")
    # a non-finite loss is never the scaler's: the forward pass does not see the loss scale
    assert _verdicts(judge, "fnf", scaler) == "FNF" and "the loss itself is non-finite" in judge.why


def test_a_scale_at_its_floor_absorbs_nothing_and_neither_does_a_static_or_absent_scaler(ds_rank0):
    reader, scaler = _ds_reader(2.0 ** 20, min_scale=2.0 ** 17)
    judge = OverflowJudge(reader)
    # NaN gradients from step 0: hysteresis keeps 2^20 once, then 2^19, 2^18, 2^17 = the floor
    assert _verdicts(judge, "oooooo", scaler) == "AAAANN"
    assert judge.why.startswith("the loss scale is at its floor 131072")
    static, _ = _ds_reader(1024.0, dynamic=False)
    assert _verdicts(OverflowJudge(static), "of") == "NF"  # a static scale never lowers: nothing absorbed
    assert _verdicts(OverflowJudge(None), "ofn") == "NFN" and OverflowJudge(None).why == ""  # bf16 / fp32


def test_torch_gradscaler_search_is_bounded_by_a_scale_below_one():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    judge = OverflowJudge(ScalerReader("torch", scaler))
    # 8, 4, 2, 1 absorbed; the 5th step would run at 0.5: no scale fits (GradScaler has no floor of its own)
    assert _verdicts(judge, "oooooo") == "AAAANN" and "below 1" in judge.why
    assert _verdicts(OverflowJudge(ScalerReader("torch", scaler), resumed=True), "oooo") == "AAAN"  # past its search


def test_grad_factor_is_what_the_gradients_still_carry_under_torch_amp():
    """Lightning's 16-mixed unscales before on_before_optimizer_step (factor 1); an optimizer that unscales in its
    own step (fused AdamW: Lightning skips unscale_) leaves the scale in: the factor is the scale, on the device."""
    p = torch.nn.Parameter(torch.ones(3))
    for fused in (False, True):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        opt = torch.optim.AdamW([p], fused=fused)
        reader = ScalerReader("torch", scaler)
        p.grad = None
        scaler.scale((p * 2.0).sum()).backward()
        if not fused:
            scaler.unscale_(opt)
            assert reader.grad_factor(opt) == 1.0 and torch.equal(p.grad, torch.full((3,), 2.0))
        else:
            factor = reader.grad_factor(opt)
            assert isinstance(factor, torch.Tensor) and torch.equal(p.grad / factor, torch.full((3,), 2.0))
        assert float(reader.backward_scale()) == 1024.0
        scaler.step(opt)
        scaler.update()


# ---- the checks through their hooks, with a stand-in for DeepSpeed's fp16 engine ----------------------------

class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))


class TinyFp16LM(nn.Module):
    """embedding -> 2 residual MLP blocks (``model.layers.<i>.mlp``, the GPU kit's names) -> head."""

    def __init__(self, vocab: int = 64, width: int = 16) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, width)
        self.model.layers = nn.ModuleList([Block(width) for _ in range(2)])
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        for block in self.model.layers:
            h = h + block.mlp(h)
        return self.lm_head(h)


class Module(nn.Module):
    """What the checks see of a LightningModule: ``net``, the step's loss (nan_triage's rerun calls it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyFp16LM().half()  # DeepSpeed fp16 holds fp16 weights and gradients

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


class Fp16Engine:
    """DeepSpeed's fp16 step around Lightning's hooks: backward of loss x scale, the hooks on loss-scaled
    gradients, then skip-on-overflow and the scaler's update (``engine.skipped_steps``)."""

    def __init__(self, init_scale: float, min_scale: float = 1.0) -> None:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

        self.scaler = DynamicLossScaler(init_scale=init_scale, scale_window=1000, min_scale=min_scale, delayed_shift=2,
                                        consecutive_hysteresis=False, raise_error_at_min_scale=False)
        self.optimizer = SimpleNamespace(loss_scaler=self.scaler)
        self.skipped_steps = 0
        self.scales: list[float] = []  # the scale each step's backward ran with


_start = [0]  # where this test's findings begin in the process-wide channel (earlier tests' stay in it)


@pytest.fixture(autouse=True)
def _this_tests_findings():
    _start[0] = len(get_channel().local)


def records() -> list:
    """The findings this test reported (Finding objects)."""
    return get_channel().local[_start[0]:]


def fit(monkeypatch, checks: list, steps: int, init_scale: float, plants: tuple = (), min_scale: float = 1.0,
        lr: float = 0.05) -> tuple[list[tuple], Fp16Engine]:
    """Run ``steps`` optimizer steps of the fp16 net through the checks' hooks; the new findings
    (check, code, severity, step) and the engine."""
    from deepspeed.runtime.fp16 import loss_scaler as ls

    monkeypatch.setattr(ls, "dist", SimpleNamespace(get_rank=lambda: 0))
    engine = Fp16Engine(init_scale, min_scale)
    for module in (grad_monitor_module, nan_triage_module, loss_spike_module, layer_health_module,
                   mixed_precision_module):  # the run's scaler is DeepSpeed's (a stand-in strategy is not one)
        monkeypatch.setattr(module, "read_scaler", lambda trainer: ScalerReader("deepspeed", engine))
    module = Module()
    params = [p for p in module.parameters()]
    trainer = SimpleNamespace(global_step=0, global_rank=0, world_size=1, loggers=[], strategy=object(),
                              lightning_module=module, current_epoch=0, max_steps=steps, training=True,
                              precision="16-mixed", precision_plugin=None, accumulate_grad_batches=1)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (4, 9), generator=gen) for _ in range(steps)]
    start = len(get_channel().local)
    for c in [*checks, *plants]:
        for hook in ("on_fit_start", "on_train_start"):
            if hasattr(c, hook):
                getattr(c, hook)(trainer, module)
    opt = SimpleNamespace(param_groups=[{"lr": lr}])
    for step, batch in enumerate(batches):
        trainer.global_step = step
        for c in checks:
            c.on_train_batch_start(trainer, module, batch, step)
        loss = module.training_step(batch, step)
        for c in checks:
            c.on_before_backward(trainer, module, loss)
        scale = engine.scaler.cur_scale
        engine.scales.append(scale)
        for p in params:
            p.grad = None
        (loss * scale).backward()  # DeepSpeed's engine.backward: the loss scale goes in here
        for c in checks:
            c.on_before_optimizer_step(trainer, module, opt)
        overflow = not all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
        if not overflow and not getattr(module, "skip_optimizer_step", False):
            with torch.no_grad():
                for p in params:
                    p -= (lr * p.grad.float() / scale).half()
        engine.scaler.update_scale(overflow)  # what engine.step() does after the hook
        engine.skipped_steps += overflow
        trainer.global_step = step + 1
        for c in checks:
            c.on_train_batch_end(trainer, module, {"loss": loss}, batch, step)
    for c in checks:
        c.on_train_end(trainer, module)
    found = [(f.check, f.code, f.severity, f.step) for f in get_channel().local[start:]]
    return found, engine


def the_checks(**nan_kwargs) -> list:
    return [GradMonitor(every_n_steps=1), NaNTriage(**nan_kwargs), MixedPrecisionCheck(every_n_steps=1),
            LossSpike(use_grad_norm=True, read_every_n_steps=1), LayerHealth(every_n_steps=1, warmup_steps=1)]


def loud(found: list[tuple]) -> list[tuple]:
    return [f for f in found if f[2] != "info"]


def summary(check: str, code: str) -> dict:
    hits = [f for f in records() if f.check == check and f.code == code]
    return hits[-1].details


SEARCH = 2.0 ** 22  # this net's scaled gradients overflow fp16 down to 2^19: 5 skipped steps, then 2^18 fits


@pytest.mark.parametrize("init,skipped,search", [(SEARCH, 5, 5), (2.0 ** 20, 3, 2), (2.0 ** 16, 0, 0)],
                         ids=["scale_search", "search_then_one_more_overflow", "no_overflow_x65536"])
def test_a_healthy_fp16_run_is_silent_with_norms_unscaled(monkeypatch, init, skipped, search):
    found, engine = fit(monkeypatch, the_checks(), 10, init)
    assert loud(found) == []
    assert engine.skipped_steps == skipped and engine.scales[-1] == min(init, 2.0 ** 18)
    grads = summary("grad_monitor", "grad_summary")
    assert 0.1 < grads["largest_norm"] < 10  # unscaled (loss-scaled: ~4e4 at 2^16, x4 more at 2^18)
    assert grads["overflows_absorbed"] == skipped and summary("nan_triage", "nan_summary") == \
        {"reruns": 0, "overflows_absorbed": skipped}
    precision = summary("mixed_precision", "precision_summary")
    assert precision["search_skipped"] == search and precision["skipped_steps"] == skipped
    assert precision["initial_scale"] == init and precision["search_scale"] == engine.scales[search]
    spikes = summary("loss_spike", "loss_spike_summary")
    assert spikes["counts"] == {} and spikes["steps_checked"] == 10


def test_a_planted_nan_after_the_search_is_named_with_its_module(monkeypatch):
    found, engine = fit(monkeypatch, the_checks(), 7, SEARCH, plants=(NaNOutput(PLANT, step=5),))
    assert engine.skipped_steps == 6  # 5 for the search (steps 0-4), 1 for the NaN
    before = [f for f in loud(found) if f[3] < 5]
    assert before == []  # the search's overflows: no finding, no rerun
    nan = [f for f in found if f[0] == "nan_triage" and f[2] != "info"]
    assert nan == [("nan_triage", "nan_reproducible", "error", 5)]
    record = next(f for f in records() if f.code == "nan_reproducible")
    assert record.details["module"] == PLANT and record.details["rerun_index"] == 1
    assert ("grad_monitor", "nonfinite_grad", "error", 5) in found  # a non-finite loss is never the scaler's
    assert summary("nan_triage", "nan_summary")["overflows_absorbed"] == 5


def test_a_transient_nan_after_the_search_gets_the_only_rerun(monkeypatch):
    # max_reruns=1: the search's 5 overflows must leave it for the NaN, which does not come back on rerun
    found, _ = fit(monkeypatch, the_checks(max_reruns=1), 7, SEARCH, plants=(NaNOutput(PLANT, step=5, calls=1),))
    assert [f for f in found if f[0] == "nan_triage" and f[2] != "info"] == [
        ("nan_triage", "nan_transient", "error", 5)]
    assert [f for f in loud(found) if f[3] < 5] == []


def test_an_overflow_streak_after_the_search_is_named_and_rerun_with_the_loss_scale(monkeypatch):
    # from step 7 the gradient out of the planted module is x1e30: beyond fp16 at any scale
    plant = RealFp16OnCpu(module=PLANT, overflow_step=7, overflow_steps=10)
    found, engine = fit(monkeypatch, the_checks(), 12, SEARCH, plants=(plant,))
    # the search (steps 0-4) and steps 7, 8, 9 are absorbed like any overflow; the 4th in a row (step 10) is not
    assert sorted(loud(found)) == [("grad_monitor", "nonfinite_grad", "error", 10),
                                   ("grad_monitor", "nonfinite_grad", "error", 11),
                                   ("mixed_precision", "overflow_streak", "warning", 10),
                                   ("nan_triage", "nan_reproducible", "error", 10),
                                   ("nan_triage", "nan_reproducible", "error", 11)]
    rerun = next(f for f in records() if f.code == "nan_reproducible" and f.step == 10)
    assert rerun.details["rerun"] == "forward+backward" and rerun.details["arose_in"] == "backward"
    assert rerun.details["rerun_loss_scale"] == engine.scales[10]  # the step's scale: the overflow came back
    assert "4 overflowed steps in a row" in rerun.message
    grad = next(f for f in records() if f.code == "nonfinite_grad" and f.step == 10)
    assert "not an overflow the loss scaler absorbs: 4 overflowed steps in a row" in grad.message
    streak = next(f for f in records() if f.code == "overflow_streak")
    assert "(steps 7..10)" in streak.message and f"(was {2 ** 18})" in streak.message


def test_a_scale_that_collapses_to_its_floor_from_the_start(monkeypatch):
    # NaN gradients from step 0 (never a good step): the search halves the scale to DeepSpeed's floor
    plant = RealFp16OnCpu(module=PLANT, overflow_step=0, overflow_steps=100)
    found, engine = fit(monkeypatch, the_checks(), 7, SEARCH, plants=(plant,), min_scale=2.0 ** 19)
    # hysteresis keeps 2^22 at step 0; 2^21, 2^20, 2^19 = the floor after step 3; step 4 on runs at the floor
    assert engine.scales == [2.0 ** 22, 2.0 ** 22, 2.0 ** 21, 2.0 ** 20, 2.0 ** 19, 2.0 ** 19, 2.0 ** 19]
    assert [f for f in loud(found) if f[0] == "mixed_precision"] == [
        ("mixed_precision", "loss_scale_min", "error", 3)]  # no overflow_streak: a search is not a streak
    assert ("grad_monitor", "nonfinite_grad", "error", 4) in found and \
        ("nan_triage", "nan_reproducible", "error", 4) in found
    assert [f for f in loud(found) if f[3] < 3] == []
    floor = next(f for f in records() if f.code == "nonfinite_grad" and f.step == 4)
    assert "the loss scale is at its floor 524288" in floor.message


def test_steps_judged_later_are_judged_at_their_own_scale(monkeypatch):
    # grad_monitor with policy warn reads its queue every read_every_n_steps (here: at the last step, 6), when the
    # scale is already at its floor: steps 0-3 ran above it and are still the search's, absorbed
    plant = RealFp16OnCpu(module=PLANT, overflow_step=0, overflow_steps=100)
    found, engine = fit(monkeypatch, [GradMonitor(every_n_steps=0), MixedPrecisionCheck(every_n_steps=1)], 7,
                        SEARCH, plants=(plant,), min_scale=2.0 ** 19)
    assert [f[3] for f in found if f[1] == "nonfinite_grad"] == [4, 5, 6]
    assert summary("grad_monitor", "grad_summary")["overflows_absorbed"] == 4


# ---- real DeepSpeed fp16 through Lightning on this CPU --------------------------------------------------------

DS_FP16 = [*SMOKE, "strategy=zero2", "trainer.val_check_interval=100", "export.fp32=false", "export.hf=false",
           "+callbacks.fp16._target_=tests.planted.precision.DeepSpeedFp16OnCpu"]


@pytest.mark.slow  # 40-80 s: fp16 is emulated on this CPU (the in-process fakes above cover the logic fast)
def test_real_deepspeed_fp16_overflows_then_planted_nan_in_the_kits_module(tmp_path, shared_cache):
    """The GPU kit's fp16 case on CPU: the tiny DeepSeek under DeepSpeed's fp16 (ZeRO-2), its scaler starting
    at 2^21 so the first steps overflow, a NaN planted in model.layers.1.mlp at step 5, debug=light +
    nan_triage: steps 0-4 silent, the NaN named with its module."""
    run_dir = tmp_path / "run"
    train_in_process([*DS_FP16, *SMALL_DEEPSEEK, "debug=light", "+callbacks=nan_triage", "trainer.max_steps=6",
                      "+callbacks.fp16.initial_scale_power=21", "+callbacks.nan._target_=tests.planted.nan.NaNOutput",
                      f"+callbacks.nan.module={PLANT}", "+callbacks.nan.step=5"], run_dir, shared_cache)
    records = read_findings(run_dir)
    loud_records = [(r["check"], r["code"], r["step"]) for r in records if r["severity"] != "info"]
    assert [r for r in loud_records if r[0] != "advisor" and r[2] != 5] == []  # healthy steps: silent
    nan = [r for r in records if r["code"] == "nan_reproducible"]
    assert len(nan) == 1 and nan[0]["step"] == 5 and nan[0]["details"]["module"] == PLANT
    precision = next(r for r in records if r["code"] == "precision_summary")["details"]
    assert precision["scaler"] == "deepspeed" and precision["search_skipped"] >= 2  # it did overflow first
    # every skipped step but the NaN's was an overflow the scaler absorbed: no rerun spent on them
    assert next(r for r in records if r["code"] == "nan_summary")["details"] == \
        {"labels": {"5": "reproducible"}, "reruns": 1, "overflows_absorbed": precision["skipped_steps"] - 1}
