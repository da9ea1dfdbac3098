"""The LR named as the cause in real runs (issue 32, section 3), and not named where "lower the LR" was wrong.

Short in-process runs of the small plain net (tests/helpers/runs.py TINY_NET) with loss_spike and
grad_monitor, as in debug=light: the run's own findings.jsonl and the console's incidents are read back.
The rule's thresholds are unit-tested on synthetic curves in test_report_lr_advice.py."""

from __future__ import annotations

import pytest

from dsdebug.findings.incidents import group
from tests.helpers.findings import read_findings
from tests.helpers.runs import SMOKE, TINY_NET, train_in_process

BASE = SMOKE + TINY_NET + ["+callbacks=[loss_spike,grad_monitor]", "trainer.val_check_interval=100",
                           "export.fp32=false", "export.hf=false"]
SGD = ["optim.optimizer._target_=torch.optim.SGD", "~optim.optimizer.betas", "~optim.optimizer.eps",
       "+optim.optimizer.momentum=0.9"]


def _train(tmp_path, shared_cache, extra):
    run_dir = tmp_path / "run"
    train_in_process(BASE + extra, run_dir, shared_cache)
    return read_findings(run_dir)


def _lr_incident(findings):
    incidents = group(findings)
    assert incidents and incidents[0].source() == "advisor/lr_too_high", [(i.source(), i.title()) for i in incidents]
    return incidents


def test_lr_3_is_named_as_the_root_cause_with_its_evidence(tmp_path, shared_cache, capsys):
    """optim.lr=3.0 (AdamW): the loss is orders of magnitude above ln(vocab) from step 1; the console's first
    incident is the LR, naming the key, the value, the usual range and a value to try, with the spike and
    gradient findings as its evidence (each was an incident of its own before)."""
    findings = _train(tmp_path, shared_cache, ["optim.lr=3.0", "trainer.max_steps=8"])
    incidents = _lr_incident(findings)
    root = incidents[0].root
    assert "optim.lr=3 is 3000x the top of the usual peak LR, 1e-4..1e-3 for Adam/AdamW" in root["message"]
    assert "before any update (train/loss at step 0)" in root["message"] and incidents[0].step == 1
    assert root["advice"].startswith("set optim.lr=1e-3")
    evidence = {(e.check, e.code) for e in incidents[0].evidence}
    assert {("loss_spike", "loss_spike"), ("grad_monitor", "grad_exploding")} <= evidence, evidence
    assert not [i for i in incidents[1:] if i.cause in ("loss_spike/loss_spike", "grad_monitor/grad_exploding")]
    codes = {f["code"] for f in findings if f["check"] == "advisor"}
    assert not codes & {"loss_implausibly_low", "loss_not_falling"}, codes  # a blown-up start is not "leakage"
    console = capsys.readouterr().out
    assert "ERROR   learning rate far above its usual range from step 1  [advisor/lr_too_high]" in console
    assert "worst: learning rate far above its usual range from step 1 [advisor/lr_too_high" in console


@pytest.mark.slow  # 3 more real runs (~70 s on 2 cores); each magnitude and SGD is unit-tested on its measured curve
@pytest.mark.parametrize("case", ["adamw_1e3_nonfinite", "adamw_0.1", "sgd_30"])
def test_other_magnitudes_and_sgd_are_named(case, tmp_path, shared_cache):
    extra = {"adamw_1e3_nonfinite": ["optim.lr=1e3", "trainer.max_steps=8"],
             "adamw_0.1": ["optim.lr=0.1", "trainer.max_steps=10"],
             "sgd_30": [*SGD, "optim.lr=30", "trainer.max_steps=8"]}[case]
    incidents = _lr_incident(_train(tmp_path, shared_cache, extra))
    message = incidents[0].root["message"]
    if case == "adamw_1e3_nonfinite":  # the non-finite gradients are the LR's too, not an incident of their own
        assert "optim.lr=1e3 is 1e6x" in message and "nonfinite" not in [i.cause for i in incidents]
        assert ("grad_monitor", "nonfinite_grad") in {(e.check, e.code) for e in incidents[0].evidence}
    elif case == "adamw_0.1":
        assert "optim.lr=0.1 is 100x" in message
    else:
        assert "optim.lr=30 is 300x" in message and "for SGD at a global batch of 8 samples" in message


SILENT = {
    # a model that sees its answer (the causal mask leaks the next token): loss near 0 from step 0, wiggling
    # (loss_oscillating's warning) at an LR 30x the top of the range: no divergence
    "sees_its_answer_at_30x": ["model.net._target_=tests.planted.outcome.PeekingLM", "optim.lr=0.03",
                               "trainer.max_steps=12"],
    # one batch trained over and over, at an LR 30x the top of the range: the loss falls, no divergence
    "one_batch_at_30x": ["data.max_tokens=1400", "optim.lr=0.03", "trainer.max_steps=16"],
    # an LR in range, the loss blown up by planted bugs: logits x20 at step 3, a NaN loss at step 6
    "planted_bugs_lr_in_range": ["+callbacks.spike._target_=tests.planted.spike.SpikeLoss", "+callbacks.spike.steps=[3]",
                                 "+callbacks.nan._target_=tests.planted.nan.NaNLoss", "+callbacks.nan.step=6",
                                 "trainer.max_steps=10"],
}


@pytest.mark.parametrize("case", list(SILENT))
def test_no_lr_finding_where_lowering_the_lr_is_wrong(case, tmp_path, shared_cache):
    findings = _train(tmp_path, shared_cache, SILENT[case])
    assert not [f for f in findings if f["code"] == "lr_too_high"]
    incidents = group(findings)
    if case == "planted_bugs_lr_in_range":  # the checks' own findings stay the roots, naming the step
        roots = {(i.source(), i.step) for i in incidents}
        assert ("loss_spike/loss_spike", 3) in roots and any(i.cause == "nonfinite" and i.step == 6 for i in incidents), roots
        assert not [i for i in incidents if i.root["check"] == "advisor"]
