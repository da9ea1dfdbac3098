"""Each troubleshooting rule (the troubleshooting table, the usual problem list) fires on a run whose records
show the problem, with the evidence in its message, and stays silent on a healthy run."""

from __future__ import annotations

import math
import random

import pytest

from dsdebug.report import rules
from dsdebug.report.history import HistoryLogger
from dsdebug.report.load import read_history
from dsdebug.report.load import RunData, load_run

CONFIG = {"trainer": {"max_steps": 100, "accelerator": "cpu", "precision": "32-true"},
          "optim": {"lr": 3e-3, "scheduler": {"warmup_ratio": 0.1}}}


def _run(loss=None, val=None, crash=None, findings=(), config=None, extra=None, metrics=None):
    history = {}
    if loss is not None:
        history["train/loss"] = list(enumerate(loss))
    if val is not None:
        history["val/loss"] = [(s, v) for s, v in val]
    history.update(extra or {})
    return RunData(path=None, config=config or CONFIG, metrics=metrics or {}, findings=list(findings),
                   history=history, crash=crash)


def _healthy_loss(n=100, seed=0):
    rng = random.Random(seed)
    return [8.0 * math.exp(-s / 40) + 3.0 + rng.gauss(0, 0.03) for s in range(n)]


HEALTHY = _run(loss=_healthy_loss(), val=[(25, 6.0), (50, 5.0), (75, 4.6), (99, 4.4)],
               extra={"comm/share": [(s, 0.2) for s in range(0, 100, 10)],
                      "time/data_fraction": [(50, 0.05)]})


def test_a_healthy_run_fires_no_rule():
    assert rules.evaluate(HEALTHY) == []


def _fires(run, code):
    found = [f for f in rules.evaluate(run) if f["code"] == code]
    assert found, rules.evaluate(run)
    f = found[0]
    assert f["check"] == "advisor" and f["message"] and f["advice"]
    return f


def test_loss_not_falling():
    flat = [6.0 + 0.01 * math.sin(s) for s in range(100)]
    f = _fires(_run(loss=flat), "loss_not_falling")
    assert "5.99" in f["message"] and "steps 10-99" in f["message"] and "optim.lr" in f["advice"]
    # falling only during warmup, flat after: still fires; falling after warmup: silent
    assert not [x for x in rules.evaluate(_run(loss=_healthy_loss())) if x["code"] == "loss_not_falling"]


def test_loss_not_falling_orders_the_evidence_the_run_recorded():
    """A diagnosis from evidence, not a guess: frozen params first, then the LR, then clipping."""
    flat = [6.0 + 0.01 * math.sin(s) for s in range(100)]
    plain = _fires(_run(loss=flat), "loss_not_falling")
    assert plain["details"]["causes"] == [] and "evidence" not in plain["message"]
    frozen = {"check": "freeze_verify", "code": "not_in_optimizer", "severity": "error",
              "message": "model.layers.1.w is not in the optimizer"}
    config = {**CONFIG, "optim": {**CONFIG["optim"], "grad_clip": 1.0}}
    extra = {"lr-AdamW": [(s, 3e-4) for s in range(100)], "grad/norm/global": [(s, 80.0) for s in range(100)]}
    f = _fires(_run(loss=flat, findings=[frozen], config=config, extra=extra), "loss_not_falling")
    causes = f["details"]["causes"]
    assert len(causes) == 3 and "freeze_verify" in causes[0] and "10% of optim.lr" in causes[1]
    assert "clipped 80x" in causes[2] and f["advice"].startswith("make those parameters train")
    tiny = _fires(_run(loss=flat, extra={"lr-AdamW": [(s, 1e-9) for s in range(100)]}), "loss_not_falling")
    assert tiny["details"]["causes"] == ["the LR never exceeded 1.0e-09"]


def test_loss_oscillating():
    rng = random.Random(1)
    noisy = [v + rng.choice([-1, 1]) * 0.8 for v in _healthy_loss()]
    f = _fires(_run(loss=noisy), "loss_oscillating")
    assert "swings" in f["message"] and "warmup" in f["advice"] and "accumulate_grad_batches" in f["advice"]


def test_lower_the_lr_needs_its_own_evidence_leakage_and_memorisation_are_named_instead():
    """Once, "oscillating -> lower the LR" fired on a model that could see the answer and on a run
    that trained on the same few sequences; each now gets its own finding and no LR advice."""
    rng = random.Random(2)
    leak = [8.3 * math.exp(-s / 3) + 0.02 + abs(rng.gauss(0, 0.02)) for s in range(100)]  # near 0, +-100%
    codes = [f["code"] for f in rules.evaluate(_run(loss=leak, extra={"epoch": [(s, 0.0) for s in range(100)]}))]
    assert "loss_oscillating" not in codes and "loss_implausibly_low" in codes, codes
    f = _fires(_run(loss=leak), "loss_implausibly_low")
    assert "leakage" in f["message"] and "causality" in f["advice"] and "lower the LR" not in f["advice"]
    # 4 batches per epoch, 25 epochs: each batch's loss comes round again (not near zero: only the period tells)
    offsets = [0.5, -0.4, 0.3, -0.4]
    memo = [3.0 + 2.0 * math.exp(-s / 30) + offsets[s % 4] + rng.gauss(0, 0.01) for s in range(100)]
    epochs = {"epoch": [(s, float(s // 4)) for s in range(100)]}
    codes = [f["code"] for f in rules.evaluate(_run(loss=memo, extra=epochs))]
    assert "loss_oscillating" not in codes, codes
    assert "loss_oscillating" in [f["code"] for f in rules.evaluate(_run(loss=memo))]  # without the epochs: LR's
    few = [8.3 * math.exp(-s / 10) + 0.01 + 0.3 * offsets[s % 4] ** 2 for s in range(100)]
    f = _fires(_run(loss=few, extra=epochs), "loss_implausibly_low")
    assert "25 passes" in f["message"] and "memorised" in f["message"]


def test_loss_diverging_and_nan():
    loss = _healthy_loss()[:50] + [3.5 * 1.1 ** i for i in range(50)]
    f = _fires(_run(loss=loss), "loss_diverging")
    assert "rose to" in f["message"] and f["severity"] == "error"
    nan = _healthy_loss()[:60] + [float("nan")] * 40
    f = _fires(_run(loss=nan), "loss_diverging")
    assert "non-finite at step 60" in f["message"] and f["step"] == 60


def test_val_loss_rising():
    f = _fires(_run(loss=_healthy_loss(), val=[(25, 5.0), (50, 4.0), (75, 4.4), (99, 4.9)]), "val_loss_rising")
    assert "best at step 50" in f["message"] and "step 50" in f["advice"]
    assert not [x for x in rules.evaluate(_run(val=[(25, 5.0), (50, 4.0), (75, 4.1)])) if x["code"] == "val_loss_rising"]


@pytest.mark.parametrize("crash,findings", [
    ({"error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}, []),
    (None, [{"code": "rank_died", "message": "rank 1 (pid 7) killed by SIGKILL (often the kernel OOM killer)"}]),
])
def test_out_of_memory(crash, findings):
    f = _fires(_run(loss=_healthy_loss(), crash=crash, findings=findings), "out_of_memory")
    assert "zero3" in f["advice"] and "seq_len" in f["advice"]


def test_out_of_memory_silent_on_other_crashes():
    run = _run(loss=_healthy_loss(), crash={"error": "ValueError: bad value"},
               findings=[{"code": "rank_died", "message": "rank 1 (pid 7) exited with code 1"}])
    assert not [x for x in rules.evaluate(run) if x["code"] == "out_of_memory"]


def test_too_slow():
    f = _fires(_run(loss=_healthy_loss(), extra={"comm/share": [(s, 0.7) for s in range(5)]}), "too_slow")
    assert "collectives take 70%" in f["message"]
    gpu_fp32 = {**CONFIG, "trainer": {**CONFIG["trainer"], "accelerator": "gpu"}}
    f = _fires(_run(loss=_healthy_loss(), config=gpu_fp32), "too_slow")
    assert "32-true on a GPU" in f["message"] and "bf16-mixed" in f["advice"]


@pytest.mark.parametrize("crash,findings", [
    ({"error": "torch.distributed.DistBackendError: [Rank 1] Watchdog caught collective operation timeout"}, []),
    ({"exit_code": 124, "error": "hang watchdog: no progress for 300 s"}, []),
    (None, [{"code": "hang", "message": "rank 1 stuck in all_reduce for 300 s"}]),
])
def test_nccl_timeout(crash, findings):
    f = _fires(_run(loss=_healthy_loss()[:20], crash=crash, findings=findings), "nccl_timeout")
    assert "NCCL_DEBUG=INFO" in f["advice"] and "ASYNC_ERROR_HANDLING" in f["advice"]


def test_mixed_precision_unstable():
    fp16 = {**CONFIG, "trainer": {**CONFIG["trainer"], "precision": "16-mixed"}}
    bad = [{"code": "nonfinite_grad", "step": 12, "message": "..."}]
    f = _fires(_run(loss=_healthy_loss(), config=fp16, findings=bad), "mixed_precision_unstable")
    assert "step 12" in f["message"] and "loss_scale_window" in f["advice"]
    assert not [x for x in rules.evaluate(_run(loss=_healthy_loss(), findings=bad))
                if x["code"] == "mixed_precision_unstable"]  # bf16/fp32: not a loss-scaling problem


def test_checkpoint_restore_failed():
    resumed = {**CONFIG, "resume": "latest"}
    crash = {"error": "checkpoint file /x/step_000004.ckpt/checkpoint/a.pt is corrupted: sha256 differs"}
    f = _fires(_run(config=resumed, crash=crash), "checkpoint_restore_failed")
    assert "step_000004" in f["message"] and "latest_valid" in f["advice"]
    assert not [x for x in rules.evaluate(_run(config=CONFIG, crash=crash)) if x["code"] == "checkpoint_restore_failed"]


def test_history_logger_round_trip(tmp_path):
    logger = HistoryLogger(tmp_path)
    logger.log_metrics({"train/loss": 5.0, "lr-AdamW": 1e-3}, step=1)
    logger.log_metrics({"train/loss": float("nan")}, step=2)
    (tmp_path / "history.jsonl").open("a").write('{"step": 3, "train/lo')  # cut by a crash
    history = read_history(tmp_path)
    assert history["lr-AdamW"] == [(1, 1e-3)]
    assert history["train/loss"][0] == (1, 5.0) and math.isnan(history["train/loss"][1][1])
    run = load_run(tmp_path)
    assert run.series("train/loss")[0] == [1, 2] and run.status == "unknown"
