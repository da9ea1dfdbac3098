"""nan_triage: a non-finite step is re-run once from the same state and labelled -- a planted
transient NaN (once, the rerun is finite), a planted reproducible NaN (every call during the step,
named by module), a gradient-only NaN (backward rerun via autograd.grad), and 2 processes under
ZeRO-2 where all ranks rerun together (no hang). Planted modules: tests/planted/nan.py."""

from __future__ import annotations

import pytest
import torch

from dsdebug.callbacks.nan_triage import NaNTriage, _finite
from dsdebug.errors import ConfigError
from tests.helpers.runs import SMOKE, TINY_NET, assert_ok, only_run_dir, run_train, train_in_process
from tests.helpers.findings import one, read_findings

BASE = [*SMOKE, *TINY_NET, "trainer.max_steps=5", "trainer.val_check_interval=100", "+callbacks=nan_triage",
        "callbacks.nan_triage.on_error=skip"]


def planted(step: int, calls: str, module: str = "mlp.2") -> list[str]:
    return ["+callbacks.planted._target_=tests.planted.nan.NaNOutput", f"+callbacks.planted.module={module}",
            f"+callbacks.planted.step={step}", f"+callbacks.planted.calls={calls}"]


def loud(records: list[dict]) -> list[tuple]:
    return [(r["code"], r["step"]) for r in records if r["severity"] != "info"]


def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"max_reruns": 0}, "max_reruns"), ({"rerun": "yes"}, "rerun"),
                        ({"check_grads": 1}, "check_grads"), ({"on_error": "ignore"}, "on_error")):
        with pytest.raises(ConfigError, match=f"callbacks.nan_triage.{key}=.*valid: ") as e:
            NaNTriage(**kwargs)
        assert "\n" not in str(e.value)


def test_finite_walks_outputs():
    nan = torch.tensor([1.0, float("nan")])
    assert _finite(torch.ones(2)) and _finite(torch.tensor([1, 2])) and _finite(None)
    assert not _finite(nan) and not _finite((torch.ones(1), nan)) and not _finite({"logits": nan})


def test_transient_nan_zero2_rerun_is_finite(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    train_in_process([*BASE, *planted(2, "1")], run_dir, shared_cache)
    found = read_findings(run_dir, "nan_triage")
    assert loud(found) == [("nan_transient", 2)]  # steps 0, 1, 3, 4 healthy: silent
    f = found[0]
    assert f["severity"] == "error" and f["details"]["label"] == "transient" and f["rank"] == 0
    assert "non-finite loss on rank(s) [0] at step 2, batch 2; TRANSIENT" in f["message"]
    assert f["details"]["rerun"] == "forward" and f["details"]["rerun_nonfinite_ranks"] == []
    assert one(found, "nan_summary")["details"] == {"labels": {"2": "transient"}, "reruns": 1}


def test_reproducible_nan_ddp_names_module_and_batch(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    train_in_process([*BASE, "strategy=ddp", *planted(3, "null")], run_dir, shared_cache)
    found = read_findings(run_dir, "nan_triage")
    assert loud(found) == [("nan_reproducible", 3)]
    f = found[0]
    assert f["details"]["label"] == "reproducible" and f["details"]["module"] == "mlp.2"
    assert "at step 3, batch 3; REPRODUCIBLE on rerun on rank(s) [0]: first non-finite module output: mlp.2" \
        in f["message"]


def test_gradient_only_nan_is_rerun_through_backward(tmp_path, shared_cache):
    run_dir = tmp_path / "run"  # grad_monitor's planted hook: one NaN in head.weight's gradient at step 1
    train_in_process([*BASE, "strategy=ddp", "+callbacks.nan._target_=tests.planted.grads.CorruptGrad",
                      "+callbacks.nan.param=head.weight", "+callbacks.nan.step=1"], run_dir, shared_cache)
    f = one(read_findings(run_dir, "nan_triage"), "nan_reproducible")  # the hook fires in autograd.grad too
    assert f["step"] == 1 and f["details"]["rerun"] == "forward+backward" and f["details"]["module"] is None
    assert "finite loss on every rank but non-finite gradients" in f["message"]


@pytest.mark.slow
def test_two_processes_zero2_all_ranks_rerun_together(tmp_path, shared_cache):
    log_dir = tmp_path / "logs"  # NaN on rank 1 only, at step 2, every call: rank 0 must rerun too
    proc = run_train([*BASE, "trainer=ddp_sim", *planted(2, "null"), "+callbacks.planted.rank=1"],
                     log_dir, shared_cache, timeout=600)
    assert_ok(proc)
    found = read_findings(only_run_dir(log_dir), "nan_triage")
    assert loud(found) == [("nan_reproducible", 2)]
    f = found[0]
    assert f["rank"] == 1 and f["details"]["loss_ranks"] == [1] and f["details"]["rerun_nonfinite_ranks"] == [1]
    assert "first non-finite module output: mlp.2 (rank 1)" in f["message"]


# One planted non-finite value, three ways: every check that sees it (nan_triage, grad_monitor,
# loss_spike, the report's advisor; the update is applied, so the later steps go non-finite too) ends
# up in ONE incident whose first line names where it arose (src/findings/incidents.py).
VARIANTS = {
    "nan_in_a_middle_module": (["+callbacks.planted._target_=tests.planted.nan.NaNOutput",
                                "+callbacks.planted.module=mlp.1", "+callbacks.planted.step=1"], "mlp.1"),
    "inf_from_an_overflow": (["+callbacks.planted._target_=tests.planted.nan.OverflowOutput",
                              "+callbacks.planted.module=mlp.0", "+callbacks.planted.step=1"], "mlp.0"),
    "nan_in_the_loss_only": (["+callbacks.planted._target_=tests.planted.nan.NaNLoss", "+callbacks.planted.step=1"],
                             "the loss"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_planted_nonfinite_value_is_one_incident_naming_where_it_arose(variant, tmp_path, shared_cache):
    from dsdebug.findings.channel import FindingsChannel
    from dsdebug.findings.incidents import group

    plant, where = VARIANTS[variant]
    run_dir = tmp_path / "run"
    train_in_process([*SMOKE, *TINY_NET, "trainer.max_steps=4", "trainer.val_check_interval=100", "strategy=ddp",
                      "export.fp32=false", "export.hf=false", "+callbacks=[nan_triage,grad_monitor,loss_spike]",
                      *plant], run_dir, shared_cache)
    records = read_findings(run_dir)
    loud = [r for r in records if r["severity"] != "info"]
    assert {r["check"] for r in loud} >= {"nan_triage", "grad_monitor", "loss_spike"}, loud  # several saw it
    incidents = group(records)
    assert len(incidents) == 1, [(i.title(), i.source()) for i in incidents]
    incident = incidents[0]
    assert incident.title() == f"non-finite values from step 1 in {where} on rank 0"
    assert incident.source() == "nan_triage/nan_reproducible" and incident.count == len(loud)
    # grad_monitor sees every gradient non-finite: its parameter list (registration order) is no culprit
    grad = next(r for r in loud if r["check"] == "grad_monitor" and r["step"] == 1)
    assert "so not a culprit: embed.weight" in grad["message"] and "nan_triage names the module" in grad["message"]
    lines = FindingsChannel(run_dir).summary_lines(run_dir / "report.html", "completed")
    assert lines[1].startswith(f"ERROR   non-finite values from step 1 in {where} on rank 0")
    assert lines[-1].startswith("verdict: 1 incident (1 error); worst: non-finite values from step 1 in "
                                f"{where}") and lines[-1].endswith(f"report: {run_dir / 'report.html'}")


def test_a_nan_from_a_gradient_hook_is_one_incident_headed_by_the_parameter(tmp_path, shared_cache):
    """A hook puts a NaN in mlp.0.weight's gradient at every step, grad_monitor skips each update: grad_monitor names
    the parameter, nan_triage can only say "it arose in backward", and freeze_verify finds that nothing learned
    (every update was skipped). One incident, headed by the finding that names the parameter, with the parameters
    that did not learn as its evidence -- not a second incident advising a higher LR (issue 34)."""
    from dsdebug.findings.incidents import group

    run_dir = tmp_path / "run"
    train_in_process([*SMOKE, *TINY_NET, "trainer.max_steps=5", "trainer.val_check_interval=100", "strategy=ddp",
                      "export.fp32=false", "export.hf=false",
                      "+callbacks=[nan_triage,grad_monitor,loss_spike,freeze_verify]",
                      "callbacks.grad_monitor.on_error=skip",
                      "+callbacks.nan._target_=tests.planted.grads.CorruptGrad", "+callbacks.nan.param=mlp.0.weight",
                      "+callbacks.nan.step=0", "+callbacks.nan.every=true"], run_dir, shared_cache)
    records = read_findings(run_dir)
    loud = [r for r in records if r["severity"] != "info"]
    assert {(r["check"], r["code"]) for r in loud} >= {("grad_monitor", "nonfinite_grad"),
                                                      ("freeze_verify", "not_updated")}, loud
    incidents = group(records)
    assert len(incidents) == 1, [(i.title(), i.source()) for i in incidents]
    incident = incidents[0]
    assert incident.source() == "grad_monitor/nonfinite_grad" and incident.where == "mlp.0.weight", incident.title()
    assert incident.title() == "non-finite values from step 0 in mlp.0.weight"
    assert ("freeze_verify", "not_updated") in {(e.check, e.code) for e in incident.evidence}
