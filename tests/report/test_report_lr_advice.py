"""The learning rate named as the cause only on its evidence (issue 32, section 3): the configured peak LR
far above the usual range for its optimizer and model size AND a loss that diverged after the first
updates. Synthetic run records here (fast); real runs in test_report_lr_runs.py."""

from __future__ import annotations

import math
import random

import pytest

from dsdebug.findings.incidents import group
from dsdebug.report import rules
from dsdebug.report.load import RunData
from dsdebug.report.lr_range import family_of, lr_text, suggestion, usual_lr

ADAMW = {"_target_": "torch.optim.AdamW", "_partial_": True}


def _config(lr, optimizer=ADAMW, built=None, **extra):
    optim = {"lr": lr, "grad_clip": 1.0, "optimizer": {**optimizer, "lr": lr if built is None else built},
             "scheduler": {"warmup_ratio": 0.1}}
    return {"trainer": {"max_steps": 12, "accumulate_grad_batches": 1}, "data": {"batch_size": 8}, "optim": optim,
            **extra}


def _run(loss, config, findings=(), extra=None, metrics=None, every=1):
    history = {"train/loss": [(s, v) for s, v in enumerate(loss) if s % every == every - 1 or every == 1]}
    history.update(extra or {})
    return RunData(path=None, config=config, metrics=metrics or {}, findings=list(findings), history=history)


def _codes(run):
    return [f["code"] for f in rules.evaluate(run)]


def _lr_finding(run):
    found = [f for f in rules.evaluate(run) if f["code"] == "lr_too_high"]
    assert found, rules.evaluate(run)
    return found[0]


def _rec(check, code, step, severity="warning", **details):
    return {"check": check, "code": code, "step": step, "rank": 0, "severity": severity, "message": f"{check} {code}",
            "details": details}


# measured shapes (tests/planted nets and the default DeepSeek, 2026-11-28): train/loss per step at lr=3.0,
# 1e3 (AdamW) and 30 (SGD) on the tiny MLP; the healthy run at the default 3e-3
LR3 = [8.52, 64419.3, 519941.6, 188322.3, 144818.4, 51903.2, 29463.5, 21561.3, 10041.8, 7347.6, 5191.1, 4231.4]
LR1E3 = [8.52, 5.3e14, 1.9e21, 1.2e27, 1.2e27, 1.2e27] + [float("nan")] * 6
LR01 = [8.52, 7.92, 18.55, 19.67, 17.42, 13.59, 13.44, 10.62, 9.30, 7.78, 7.35, 6.86]
SGD30 = [8.52, 8.516, 625.4, 5179.0, 4585.7, 37.0, 66.1, 82.9, 64.5, 122.7, 50.7, 23.0]
HEALTHY = [8.52, 8.45, 8.34, 8.25, 8.17, 8.02, 7.97, 7.74, 7.86, 7.55, 7.70, 7.58]


def test_usual_range_by_optimizer_family_and_model_size():
    """GPT-3 Table 2.1 / Pythia for Adam (by total parameters, log-log between them), Lion a third of it,
    SGD 0.1 per 256 samples; no range (no advice) for optimizers without one."""
    assert [family_of(t) for t in ("torch.optim.AdamW", "deepspeed.ops.adam.FusedAdam", "DeepSpeedCPUAdam",
                                   "bitsandbytes.optim.AdamW8bit", "torch.optim.SGD", "lion_pytorch.Lion",
                                   "transformers.optimization.Adafactor", "Muon", None)] == [
        "adam", "adam", "adam", "adam", "sgd", "lion", None, None, None]
    small, gpt3_small, xl, huge = (usual_lr("torch.optim.AdamW", n) for n in (8.7e6, 125e6, 1.3e9, 1e12))
    assert (small.top, gpt3_small.top, xl.top, huge.top) == pytest.approx((1e-3, 6e-4, 2e-4, 6e-5))
    assert small.low == pytest.approx(1e-4) and "8.7M parameters" in small.text() and "GPT-3" in small.text()
    between = usual_lr("torch.optim.AdamW", 1e9).top
    assert 2e-4 < between < 2.5e-4  # 760M 2.5e-4 .. 1.3B 2e-4
    assert usual_lr("AdamW", None).top == 1e-3 and "unknown size" in usual_lr("AdamW", None).text()
    assert usual_lr("lion_pytorch.Lion", 8.7e6).top == pytest.approx(1e-3 / 3)
    assert usual_lr("torch.optim.SGD", None, 8).top == pytest.approx(0.1)
    assert usual_lr("torch.optim.SGD", None, 2048).top == pytest.approx(0.8)
    assert usual_lr("transformers.optimization.Adafactor", 8.7e6) is None
    assert [lr_text(x) for x in (3.0, 0.1, 1e3, 1e-3, 6e-4, 2.5e-4, 30.0)] == [
        "3", "0.1", "1e3", "1e-3", "6e-4", "2.5e-4", "30"]
    assert [lr_text(suggestion(usual_lr("AdamW", n))) for n in (8.7e6, 125e6, 1e9)] == ["1e-3", "6e-4", "2e-4"]


def test_lr_far_above_its_range_with_a_diverging_loss_is_named_with_its_evidence():
    findings = [_rec("memory", "model_states", 1, severity="info", psi=8709120),
                _rec("loss_spike", "loss_spike", 1, loss=64419.3), _rec("loss_spike", "loss_spike", 2, loss=519941.6),
                _rec("grad_monitor", "grad_exploding", 1, severity="error", norm=6890.0)]
    lr_curve = {"lr-AdamW": [(s, 1.5 if s == 0 else 3.0) for s in range(12)]}
    f = _lr_finding(_run(LR3, _config(3.0), findings, lr_curve))
    message, advice = f["message"], f["advice"]
    assert f["severity"] == "error" and f["step"] == 1 and f["check"] == "advisor"
    assert message.startswith("the learning rate is the likely cause: optim.lr=3 is 3000x the top of the usual peak LR")
    assert "1e-4..1e-3 for Adam/AdamW at 8.71M parameters" in message and "GPT-3 Table 2.1" in message
    assert "8.52 before any update (train/loss at step 0), 6.442e+04 at step 1" in message
    assert "the LR at step 1: 3" in message and "gradient norm 6890 at step 1 (grad_monitor/grad_exploding)" in message
    assert advice.startswith("set optim.lr=1e-3 (the top of the usual range)") and "3.3e-4" in advice
    assert "clipping cannot shrink them" in advice and "not changed" in advice
    d = f["details"]
    assert d["lr"] == 3.0 and d["usual_top"] == 1e-3 and d["try_lr"] == 1e-3 and d["ratio"] == pytest.approx(3000)
    assert {"loss_spike/loss_spike", "grad_monitor/grad_exploding", "advisor/loss_oscillating"} <= set(d["explains"])
    # the blown-up start no longer reads as "implausibly low" (leakage) once the loss comes down from 5e5
    assert "loss_implausibly_low" not in _codes(_run(LR3, _config(3.0), findings, lr_curve))


@pytest.mark.parametrize("case", ["adamw_1e3_nonfinite", "adamw_0.1_spike_then_recovers", "sgd_30",
                                  "default_run_sparse_curve", "lr_scaled_by_batch"])
def test_variants_of_the_failure(case):
    if case == "adamw_1e3_nonfinite":
        f = _lr_finding(_run(LR1E3, _config(1e3)))
        assert "optim.lr=1e3 is 1e6x" in f["message"] and "non-finite from step 6" in f["message"]
        assert f["details"]["nonfinite_step"] == 6 and "nonfinite" in f["details"]["explains"]
        assert "loss_not_falling" not in _codes(_run(LR1E3, _config(1e3)))  # not "check the LR is not too small"
    elif case == "adamw_0.1_spike_then_recovers":
        f = _lr_finding(_run(LR01, _config(0.1)))
        assert "optim.lr=0.1 is 100x" in f["message"] and "18.55 at step 2 (2.18x)" in f["message"] and f["step"] == 2
    elif case == "sgd_30":
        sgd = {"_target_": "torch.optim.SGD", "_partial_": True, "momentum": 0.9}
        f = _lr_finding(_run(SGD30, _config(30.0, sgd)))
        assert "optim.lr=30 is 300x" in f["message"] and "1e-3..0.1 for SGD at a global batch of 8 samples" in f["message"]
        assert f["advice"].startswith("set optim.lr=0.1") and "clipping cannot" not in f["advice"]
    elif case == "default_run_sparse_curve":
        # python train.py optim.lr=3.0: train/loss logged every 10 steps, the first steps only in loss_spike's
        # findings; the untrained loss from the validation before training
        loss = [8.4, 31.4, 133.0, 130.6, 252.3, 300.0, 400.0, 500.0, 700.0, 1075.7] * 4
        spikes = [_rec("loss_spike", "loss_spike", s, loss=loss[s]) for s in range(1, 6)]
        run = _run(loss, _config(3.0), spikes, metrics={"val/loss_at_start": 8.37}, every=10)
        assert 1 not in dict(run.history["train/loss"])
        f = _lr_finding(run)
        assert "8.37 before any update (val/loss before training), 31.4 at step 1 (3.75x)" in f["message"]
    else:  # optim.scale_lr_base_batch_size: the optimizer got 8x the typed LR; the advice is in optim.lr's units
        f = _lr_finding(_run(LR3, _config(0.5, built=4.0)))
        assert "optim.lr=0.5 (the optimizer's 4 after LR scaling" in f["message"] and "4000x" in f["message"]
        assert f["advice"].startswith("set optim.lr=1e-4")  # 1e-3 / 8, rounded down


def test_no_lr_advice_without_its_evidence():
    """Where "lower the LR" was wrong it stays silent, even at an LR far above the range: a model that sees its
    answer, one batch trained for many epochs, a loss that falls; and at an LR in range a diverging loss keeps
    its advice on the checks' own causes."""
    rng = random.Random(2)
    leak = [8.3 * math.exp(-s / 3) + 0.02 + abs(rng.gauss(0, 0.02)) for s in range(100)]  # near 0, swings +-100%
    offsets = [0.5, -0.4, 0.3, -0.4]
    memo = [3.0 + 2.0 * math.exp(-s / 30) + offsets[s % 4] + rng.gauss(0, 0.01) for s in range(100)]
    epochs = {"epoch": [(s, float(s // 4)) for s in range(100)]}
    high = _config(3.0)
    for name, run in (("leak", _run(leak, high)), ("memorised", _run(memo, high, extra=epochs)),
                      ("healthy", _run(HEALTHY, high)), ("falling at 30x", _run(HEALTHY, _config(0.03)))):
        assert "lr_too_high" not in _codes(run), name
    # a model that sees its answer from step 0, its loss wiggling near zero at an LR 30x the range's top: a rise of
    # 2x its minimum is 0.02 nats, not a divergence (ln(vocab) sets the scale)
    near_zero = [0.035, 0.026, 0.018, 0.031, 0.019, 0.018, 0.021, 0.018, 0.016, 0.013, 0.014, 0.012]  # measured
    lm = {**_config(0.03), "data": {"batch_size": 8, "vocab_size": 4096}}
    assert "lr_too_high" not in _codes(_run(near_zero, lm))
    assert "lr_too_high" in _codes(_run([v * 60 if s == 3 else v for s, v in enumerate(near_zero)], lm))  # +1.8 nats
    # the same diverging curves at an LR in its usual range (a planted bug: logits x20, a NaN): no LR finding
    for loss in (LR3, LR1E3, SGD30):
        assert "lr_too_high" not in _codes(_run(loss, _config(3e-3)))
    diverging = [f for f in rules.evaluate(_run(LR1E3, _config(3e-3))) if f["code"] == "loss_diverging"][0]
    assert diverging["advice"].startswith("the peak LR (optim.lr=3e-3) is under 10x the top of its usual range")
    assert "nan_triage" in diverging["advice"]
    far = [f for f in rules.evaluate(_run(LR1E3, _config(1e3))) if f["code"] == "loss_diverging"][0]
    assert far["advice"].startswith("lower the peak learning rate")
    # an optimizer without a known range; a loss non-finite before any update (step 0): not the LR's evidence
    assert "lr_too_high" not in _codes(_run(LR3, _config(3.0, {"_target_": "transformers.optimization.Adafactor"})))
    assert "lr_too_high" not in _codes(_run([float("nan")] * 12, high))


def test_a_plain_lightning_run_is_judged_from_its_logged_lr():
    """No config (the checks in a user's own Trainer): the LR monitor's curve names the optimizer and the peak."""
    run = _run(LR3, {}, extra={"lr-Adam": [(s, 3.0) for s in range(12)]})
    f = _lr_finding(run)
    assert "the optimizer's peak LR (lr-Adam)=3 is 3000x" in f["message"] and "set the optimizer's lr=1e-3" in f["advice"]


def test_the_lr_finding_is_the_root_of_one_incident_with_the_checks_as_its_evidence():
    records = [_rec("loss_spike", "loss_spike", s, loss=LR3[s]) for s in range(1, 6)]
    records += [_rec("grad_monitor", "grad_exploding", s, severity="error", norm=1e4) for s in range(1, 4)]
    records += [_rec("grad_monitor", "nonfinite_grad", 6, severity="error"), _rec("nan_triage", "nan_reproducible", 6,
                                                                                  severity="error", module="head")]
    records += [_rec("data_inspector", "batch_unlike_the_others", 0)]  # another cause, before the onset: its own
    before = group(records)
    assert {i.cause for i in before} == {"loss_spike/loss_spike", "grad_monitor/grad_exploding", "nonfinite",
                                         "data_inspector/batch_unlike_the_others"}
    run = _run(LR1E3, _config(1e3), records)
    advisor = rules.evaluate(run)
    incidents = group(records + advisor)
    assert [i.source() for i in incidents][:1] == ["advisor/lr_too_high"], [i.source() for i in incidents]
    lr = incidents[0]
    assert lr.title() == "learning rate far above its usual range from step 1" and lr.severity == "error"
    evidence = {(e.check, e.code): e.count for e in lr.evidence}
    assert evidence[("loss_spike", "loss_spike")] == 5 and evidence[("grad_monitor", "grad_exploding")] == 3
    assert ("nan_triage", "nan_reproducible") in evidence and ("advisor", "loss_diverging") in evidence
    assert [i.source() for i in incidents[1:]] == ["data_inspector/batch_unlike_the_others"]
    # a diagnosis takes only what it names: without it, nothing changes
    assert [i.source() for i in group(records + [a for a in advisor if a["code"] != "lr_too_high"])] != [
        i.source() for i in incidents]
