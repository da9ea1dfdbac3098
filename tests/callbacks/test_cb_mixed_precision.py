"""mixed_precision: loss-scale trajectory, overflow streaks, the scaler's floor, frequent overflow and
bf16 update underflow -- detection logic in-process (DeepSpeed's real DynamicLossScaler, torch's
GradScaler), a planted overflow streak under REAL fp16 on CPU (Lightning's MixedPrecision plugin +
torch GradScaler("cpu"), tests/planted/precision.py), bf16 weights with a too-small LR, and a healthy
bf16-mixed ZeRO-2 run that stays silent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsdebug.callbacks.loss_scale import ScalerReader
from dsdebug.callbacks.mixed_precision.underflow import subnormal_fraction
from dsdebug.callbacks.mixed_precision import MixedPrecisionCheck
from dsdebug.errors import ConfigError
from dsdebug.findings import get_channel
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, TINY_NET, train_in_process
from tests.helpers.findings import one, read_findings


def loud(records: list[dict]) -> list[tuple]:
    return [(r["code"], r["severity"], r["step"]) for r in records if r["severity"] != "info"]


def _fake_trainer() -> SimpleNamespace:
    return SimpleNamespace(global_step=0, global_rank=0, world_size=1, loggers=[], lightning_module=None)


def _drive(check: MixedPrecisionCheck, reader: ScalerReader, overflows: list[bool], step_scaler) -> list:
    """Feed one optimizer step per entry through the real scaler and the check; return the new findings."""
    trainer, start = _fake_trainer(), len(get_channel().local)
    check.reader = reader
    for step, overflow in enumerate(overflows):
        trainer.global_step = step + 1
        step_scaler(overflow)
        scale, skipped = reader.read()
        check.observe(trainer, step, scale, skipped)
    return [(f.code, f.severity, f.step) for f in get_channel().local[start:] if f.check == "mixed_precision"]


def test_deepspeed_dynamic_loss_scaler_streak_and_floor(monkeypatch):
    from deepspeed.runtime.fp16 import loss_scaler as ls

    monkeypatch.setattr(ls, "dist", SimpleNamespace(get_rank=lambda: 0))
    scaler = ls.DynamicLossScaler(init_scale=2.0 ** 8, scale_window=1000, min_scale=1.0, delayed_shift=2,
                                  consecutive_hysteresis=False, raise_error_at_min_scale=False)
    engine = SimpleNamespace(skipped_steps=0, optimizer=SimpleNamespace(loss_scaler=scaler))

    def step(overflow: bool) -> None:  # what DeepSpeed's engine does per step
        scaler.update_scale(overflow)
        engine.skipped_steps += overflow

    check = MixedPrecisionCheck(streak_warn=3, streak_error=6, warmup_steps=0)
    # 5 healthy steps, then every step overflows: hysteresis 2 keeps the scale for one step, then halves it
    found = _drive(check, ScalerReader("deepspeed", engine), [False] * 5 + [True] * 20, step)
    assert ("overflow_streak", "warning", 7) in found and ("overflow_streak", "error", 10) in found
    # 2^8 -> 1 takes 8 halvings after the hysteresis step (5): the floor is reached at step 13
    floor = [f for f in found if f[0] == "loss_scale_min"]
    assert floor == [("loss_scale_min", "error", 13)] and scaler.cur_scale == 1.0
    assert check.skipped == 20 and check.streak == 20


def test_torch_gradscaler_skips_are_read_from_backoff_and_frequency_is_windowed():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)

    def step(overflow: bool) -> None:  # a real scaled step; the overflow is a real inf gradient
        loss = scaler.scale((p * (float("inf") if overflow else 1.0)).sum())
        loss.backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    check = MixedPrecisionCheck(window=10, max_skip_fraction=0.15, warmup_steps=5, streak_warn=3)
    pattern = [False] * 5 + [True, False] * 10  # every other step: never a streak, 50% skipped
    found = _drive(check, ScalerReader("torch", scaler), pattern, step)
    assert check.skipped == 10 and check.streak == 0
    assert [f for f in found if f[0] == "frequent_overflow"] == [("frequent_overflow", "warning", 14),
                                                                  ("frequent_overflow", "warning", 24)]
    assert not [f for f in found if f[0] != "frequent_overflow"]
    # healthy: the scale grows (growth_interval 3) and nothing is reported
    check2 = MixedPrecisionCheck(window=10, warmup_steps=0)
    assert _drive(check2, ScalerReader("torch", scaler), [False] * 30, step) == [] and check2.skipped == 0


def test_subnormal_fraction_counts_only_nonzero_fp16_elements():
    g = torch.tensor([0.0, 0.0, 1e-6, 1e-3, 2e-5, 1.0], dtype=torch.float16)
    frac, n = subnormal_fraction([g, torch.full((4,), 1e-7), None])  # fp32 and None are not judged
    assert n == 4 and frac == pytest.approx(0.5)
    assert subnormal_fraction([torch.zeros(3, dtype=torch.bfloat16)]) == (0.0, 0)


def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"streak_warn": 0}, "streak_warn"), ({"max_skip_fraction": 1.5}, "max_skip_fraction"),
                        ({"min_scale": 0}, "min_scale"), ({"streak_warn": 5, "streak_error": 2}, "streak_error"),
                        ({"on_error": "skip"}, "on_error"), ({"every_n_steps": -1}, "every_n_steps")):
        with pytest.raises(ConfigError, match=f"callbacks.mixed_precision.{key}=.*valid: ") as e:
            MixedPrecisionCheck(**kwargs)
        assert "\n" not in str(e.value)


RUN = [*SMOKE, *TINY_NET, "strategy=ddp", "+callbacks=mixed_precision", "callbacks.mixed_precision.every_n_steps=1",
       "trainer.val_check_interval=100"]


def test_real_fp16_on_cpu_planted_overflow_streak_named_with_advice(tmp_path, shared_cache):
    run_dir = tmp_path / "run"  # with the gradient checks: Lightning's torch AMP path of the loss scale
    checks = [o.replace("+callbacks=mixed_precision", "+callbacks=[mixed_precision,grad_monitor,nan_triage]")
              for o in RUN]
    train_in_process([*checks, "trainer.max_steps=14", "callbacks.mixed_precision.min_scale=64",
                      "+callbacks.planted._target_=tests.planted.precision.RealFp16OnCpu",
                      "+callbacks.planted.module=mlp.2", "+callbacks.planted.overflow_step=3",
                      "+callbacks.planted.overflow_steps=20"], run_dir, shared_cache)
    found = read_findings(run_dir, "mixed_precision")
    # onset at step 3 (steps 0-2 healthy); the scale halves on every skip: 65536 -> 64 at step 12
    assert sorted(loud(found)) == [("loss_scale_min", "error", 12), ("overflow_streak", "error", 12),
                                   ("overflow_streak", "warning", 6)]
    warn = found[0]
    assert warn["code"] == "overflow_streak" and warn["severity"] == "warning"
    assert "4 consecutive optimizer steps skipped for overflow (steps 3..6)" in warn["message"]
    assert "loss scale now 4096 (was 65536)" in warn["message"]
    assert "loss_scale_window=1000" in warn["advice"] and "eps=1e-8" in warn["advice"] \
        and "bf16" in warn["advice"] and "max_norm=1.0" in warn["advice"]
    summary = one(found, "precision_summary")["details"]
    assert summary["scaler"] == "torch" and summary["skipped_steps"] == 11 and summary["precision"] == "16-mixed"
    # the first 3 overflows are the scaler's to absorb (skip + lower the scale); from the 4th in a row (step 6,
    # when overflow_streak warns) grad_monitor names the parameters and nan_triage reruns it -- with the step's
    # loss scale (65536 / 2^3), so the overflow comes back: reproducible, arisen in backward
    grads = [r for r in read_findings(run_dir, "grad_monitor") if r["code"] == "nonfinite_grad"]
    assert grads[0]["step"] == 6 and "not an overflow the loss scaler absorbs: 4 overflowed steps in a row" \
        in grads[0]["message"]
    nan = read_findings(run_dir, "nan_triage")
    assert [(r["code"], r["step"]) for r in nan if r["severity"] != "info"][:3] == [
        ("nan_reproducible", 6), ("nan_reproducible", 7), ("nan_reproducible", 8)]
    assert nan[0]["details"]["rerun_loss_scale"] == 8192.0 and nan[0]["details"]["arose_in"] == "backward"
    assert one(nan, "nan_summary")["details"]["overflows_absorbed"] == 3


def test_bf16_weights_with_tiny_lr_updates_rounded_away(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    train_in_process([*RUN, "trainer.max_steps=6", "trainer.precision=bf16-true", "optim.lr=1e-6",
                      "optim.scheduler.warmup_ratio=0", "callbacks.mixed_precision.warmup_steps=2"],
                     run_dir, shared_cache)
    found = read_findings(run_dir, "mixed_precision")
    hits = [r for r in found if r["code"] == "bf16_update_underflow"]
    assert [r["step"] for r in hits] == [2] and hits[0]["severity"] == "warning"  # once, then the summary
    assert hits[0]["details"]["fraction"] > 0.9 and "embed.weight" in hits[0]["message"]
    summary = one(found, "precision_summary")["details"]
    assert summary["bf16_weights"] > 0 and summary["worst_stale_fraction"] > 0.9


@pytest.mark.slow
def test_healthy_bf16_mixed_zero2_is_silent(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    train_in_process([*SMOKE, *SMALL_DEEPSEEK, "+callbacks=mixed_precision", "trainer.precision=bf16-mixed",
                      "trainer.max_steps=200", "trainer.val_check_interval=100", "trainer.log_every_n_steps=10",
                      "callbacks.mixed_precision.every_n_steps=10"], run_dir, shared_cache)
    found = read_findings(run_dir, "mixed_precision")
    assert loud(found) == []
    summary = one(found, "precision_summary")["details"]
    assert summary["steps"] == 0 and summary["scaler"] is None and summary["bf16_weights"] == 0  # fp32 masters
