"""Incidents (src/findings/incidents.py): findings that share a cause become one incident, its root
cause first, the others as evidence with counts; the verdict line the console ends with and the
report opens with. Records here are findings.jsonl rows as the checks write them; the runs that
produce them for real (planted NaN/Inf variants) are in tests/callbacks/test_cb_nan_triage.py."""

from __future__ import annotations

import subprocess
import sys

from dsdebug.findings.incidents import cause_of, group, verdict


def rec(check, code, severity="error", step=3, rank=None, message="", **details):
    return {"check": check, "code": code, "severity": severity, "step": step, "rank": rank,
            "message": message or f"{check} saw it", "advice": f"{check}'s advice", "details": details, "time": 0.0}


def one_nan() -> list[dict]:
    """One NaN at step 3, arising in model.3, applied (on_error=warn): every later step is NaN too,
    and the weights are NaN from model.0 on -- as 10 errors and 5 warnings looked in a real run."""
    records = [rec("grad_monitor", "nonfinite_grad", step=s, rank=0, params=["model.0.weight", "model.3.weight"],
                   message="non-finite loss on rank(s) [0]: NaN gradients in 4/4 parameters (model.0.weight, ...)")
               for s in range(3, 8)]
    records += [rec("loss_spike", "loss_spike", "warning", step=s, loss="nan", message="non-finite loss")
                for s in range(3, 8)]
    records += [rec("nan_triage", "nan_reproducible", step=3, rank=0, module="model.3", forward_index=7,
                    arose_in="model.3"),
                rec("nan_triage", "nan_reproducible", step=4, rank=0, module="model.0", forward_index=1,
                    arose_in="model.0"),  # the NaN weights of the applied update: a consequence
                rec("nan_triage", "nan_step", step=5), rec("nan_triage", "nan_step", step=6)]
    records.append(rec("advisor", "loss_diverging", step=2, message="train/loss became non-finite at step 2"))
    records.append(rec("reproducibility", "seeded", "info", step=0))
    return records


def test_one_nan_seen_by_every_check_is_one_incident_naming_where_it_arose():
    incidents = group(one_nan())
    assert len(incidents) == 1
    incident = incidents[0]
    assert incident.cause == "nonfinite" and incident.severity == "error" and incident.count == 15
    # root: nan_triage's rerun at the earliest step (the advisor's step-2 reading of the curve is
    # derived, grad_monitor lists parameters in registration order: model.0 first, not the origin)
    assert incident.source() == "nan_triage/nan_reproducible" and incident.step == 3
    assert incident.title() == "non-finite values from step 3 in model.3 on rank 0"
    evidence = {(e.check, e.code): e for e in incident.evidence}
    assert evidence[("grad_monitor", "nonfinite_grad")].count == 5
    assert evidence[("grad_monitor", "nonfinite_grad")].text() == "grad_monitor/nonfinite_grad x5 steps 3-7, rank(s) 0"
    assert evidence[("loss_spike", "loss_spike")].count == 5
    assert evidence[("nan_triage", "nan_reproducible")].steps == [4]
    assert ("advisor", "loss_diverging") in evidence


def test_root_is_the_first_module_in_forward_order_then_the_origin_rank():
    records = [rec("nan_triage", "nan_reproducible", rank=1, module="model.5", forward_index=9),
               rec("nan_triage", "nan_reproducible", rank=0, module="model.2", forward_index=4),
               rec("grad_monitor", "nonfinite_grad", rank=0)]
    assert group(records)[0].root["details"]["module"] == "model.2"
    hang = [rec("comm_debug", "hang", step=40, rank=None), rec("comm_debug", "hang", step=40, rank=1),
            rec("liveness", "rank_died", step=40, rank=1, message="rank 1 died (SIGKILL)"),
            rec("advisor", "nccl_timeout", step=None)]
    incidents = group(hang)
    assert len(incidents) == 1 and incidents[0].cause == "hang"
    assert incidents[0].source() == "liveness/rank_died" and incidents[0].rank == 1
    assert incidents[0].title() == "a rank died from step 40 on rank 1"
    # ranks that composed different configs: seen at setup by consistency, at step 0 by replica_parity
    differ = group([rec("replica_parity", "config_hash_mismatch", "warning", step=0, rank=1),
                    rec("consistency", "config_mismatch", "warning", step=None, rank=1)])
    assert len(differ) == 1 and differ[0].source() == "consistency/config_mismatch"  # at setup: first
    assert differ[0].title() == "ranks run different configs at setup on rank 1"


def test_without_nan_triage_the_root_names_no_module_it_cannot_know():
    records = [r for r in one_nan() if r["check"] != "nan_triage"]
    incident = group(records)[0]
    assert incident.source() == "grad_monitor/nonfinite_grad" and incident.where is None
    assert incident.title() == "non-finite values from step 3 on rank 0"  # not "in model.0"


def test_loss_only_nan_is_named_the_loss():
    records = [rec("nan_triage", "nan_reproducible", rank=0, module=None, arose_in="loss"),
               rec("grad_monitor", "nonfinite_grad", rank=0)]
    assert group(records)[0].title() == "non-finite values from step 3 in the loss on rank 0"


def test_other_causes_stay_apart_repeats_collapse_errors_first():
    records = [rec("log_sync", "straggler", "warning", step=s, rank=1) for s in (10, 20, 30)]
    records += [rec("data_inspector", "label_not_shifted", step=0), rec("loss_spike", "loss_spike", "warning",
                                                                         step=50, loss=9.1)]
    incidents = group(records)
    assert [i.source() for i in incidents] == ["data_inspector/label_not_shifted", "log_sync/straggler",
                                               "loss_spike/loss_spike"]
    straggler = incidents[1]
    assert straggler.count == 3 and straggler.step == 10 and straggler.evidence[0].count == 2
    assert cause_of(records[-1]) == "loss_spike/loss_spike"  # a finite spike is its own cause


def test_verdict_line():
    assert verdict([rec("reproducibility", "seeded", "info")] * 20, "/runs/x/report.html") == \
        "verdict: healthy: no warning or error (20 info finding(s) in the report); report: /runs/x/report.html"
    line = verdict(one_nan() + [rec("log_sync", "straggler", "warning", step=9)], "/r/report.html")
    assert line == ("verdict: 2 incidents (1 error, 1 warning); worst: non-finite values from step 3 in model.3 "
                    "on rank 0 [nan_triage/nan_reproducible, 14 related finding(s)]; report: /r/report.html")
    assert line.endswith("report: /r/report.html")  # the path last
    # a run that did not complete is never called healthy
    assert verdict([], None, "crashed") == "verdict: crashed; no check reported a warning or error"


def test_incidents_import_no_torch():
    code = "import sys, dsdebug.findings.incidents; print(sorted(m for m in ('torch', 'rich') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_report_opens_with_the_verdict_and_shows_incidents(tmp_path):
    import json

    from dsdebug.report.render import write_report

    (tmp_path / "findings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in one_nan()))
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "completed", "global_step": 8}))
    _, md = write_report(tmp_path)
    lines = [line for line in md.read_text().splitlines() if line.strip()]
    assert lines[1].startswith("verdict: 1 incident (1 error); worst: non-finite values from step 3 in model.3 "
                               "on rank 0 [nan_triage/nan_reproducible"), lines[:3]  # right under the title
    table = [line for line in lines if line.startswith("| non-finite values")]
    assert len(table) == 1 and "grad_monitor/nonfinite_grad x5" in table[0]
    # healthy: the banner says so; a crashed run is never healthy
    (tmp_path / "findings.jsonl").write_text(json.dumps(rec("nan_triage", "nan_summary", "info")) + "\n")
    _, md = write_report(tmp_path)
    assert md.read_text().splitlines()[2].startswith("verdict: healthy: no warning or error (1 info finding")
    (tmp_path / "crash.json").write_text(json.dumps({"status": "crashed", "exit_code": 1}))
    _, md = write_report(tmp_path)
    assert md.read_text().splitlines()[2] == "verdict: crashed; no check reported a warning or error"


def hook_nan() -> list[dict]:
    """A NaN put in blocks.1.weight's gradient by a hook at every step, each update skipped: grad_monitor names the
    parameter, nan_triage's rerun only says it arose in backward, freeze_verify finds that nothing learned."""
    records = [rec("nan_triage", "nan_reproducible", step=0, rank=0, module=None, arose_in="backward",
                   message="finite loss on every rank but non-finite gradients: it arose in backward")]
    records += [rec("grad_monitor", "nonfinite_grad", step=s, param="blocks.1.weight",
                    params=["blocks.1.weight"], message="NaN gradient in blocks.1.weight ... arose in backward")
                for s in range(0, 10)]
    records.append(rec("freeze_verify", "not_updated", step=3, steps=3, params=["blocks.0.weight", "blocks.1.weight"],
                       message="9 parameter(s) did not learn in 3 steps"))
    return records


def test_the_finding_naming_the_parameter_heads_the_incident_and_nothing_learned_is_its_consequence():
    incidents = group(hook_nan())
    assert len(incidents) == 1, [(i.title(), i.source()) for i in incidents]
    incident = incidents[0]
    assert incident.source() == "grad_monitor/nonfinite_grad"
    assert incident.title() == "non-finite values from step 0 in blocks.1.weight"
    evidence = {(e.check, e.code): e for e in incident.evidence}
    assert evidence[("freeze_verify", "not_updated")].steps == [3]
    assert evidence[("nan_triage", "nan_reproducible")].count == 1


def test_nothing_learned_before_any_nonfinite_step_is_its_own_incident():
    records = [r for r in hook_nan() if r["check"] != "freeze_verify"]
    for r in records:  # the NaN starts at step 10 now
        r["step"] += 10
    records.append(rec("freeze_verify", "not_updated", step=3, steps=3, message="did not learn in 3 steps"))
    incidents = group(records)
    assert sorted(i.source() for i in incidents) == ["freeze_verify/not_updated", "grad_monitor/nonfinite_grad"]


def lost_updates(cause: str = "eps") -> list[dict]:
    """Every layer's step lost (an eps of 1; a clip 1e-7), as the default model's debug=full run wrote it: layer_health
    names the layers and the cause at step 2, freeze_verify finds three norm gains unchanged at step 3, and with a
    clip grad_monitor's clip_dominates follows at step 4."""
    records = [rec("layer_health", "layer_update_lost", "warning", step=2, layer="model.norm", cause=cause,
                   layers=["model.norm", "model.layers.1"], message="layer model.norm moves 0.00032 x the step ...")]
    records.append(rec("freeze_verify", "not_updated", step=3, steps=3, params=["model.layers.1.q_a_layernorm.weight"],
                       message="3 parameter(s) did not learn in 3 steps"))
    if cause == "clip":
        records.append(rec("grad_monitor", "clip_dominates", "warning", step=4, message="2.5e+07x the clip threshold"))
    return records


def test_updates_lost_against_the_optimizer_head_their_consequences():
    for cause in ("eps", "clip"):
        incidents = group(lost_updates(cause))
        assert len(incidents) == 1, [(i.title(), i.source()) for i in incidents]
        incident = incidents[0]
        assert incident.source() == "layer_health/layer_update_lost" and incident.cause == f"updates_lost/{cause}"
        assert incident.title() == f"updates far below the optimizer's step ({cause}) from step 2 in model.norm"
        assert incident.severity == "error"  # freeze_verify's error stays the incident's severity
        assert {(e.check, e.code) for e in incident.evidence} == {("freeze_verify", "not_updated")} | (
            {("grad_monitor", "clip_dominates")} if cause == "clip" else set())


def test_a_clip_that_dominates_with_no_update_lost_to_the_clip_is_its_own_incident():
    incidents = group([rec("grad_monitor", "clip_dominates", "warning", step=4, message="30x the clip threshold")])
    assert [i.source() for i in incidents] == ["grad_monitor/clip_dominates"]
    records = [r for r in lost_updates("clip") if r["check"] != "grad_monitor"]
    records[0]["details"]["cause"] = "rounding"  # a lost update of another cause does not take the clip in
    records.append(rec("grad_monitor", "clip_dominates", "warning", step=40, message="30x the clip threshold"))
    assert sorted(i.source() for i in group(records)) == ["grad_monitor/clip_dominates",
                                                          "layer_health/layer_update_lost"]


def test_lost_updates_of_two_causes_are_two_incidents_and_unrelated_layers_stay_apart():
    records = lost_updates("eps")
    records.append(rec("layer_health", "layer_update_lost", "warning", step=5, layer="lm_head", cause="rounding",
                       layers=["lm_head"]))
    records.append(rec("freeze_verify", "not_updated", step=6, steps=3, params=["model.embed_tokens.weight"]))
    incidents = group(records)
    by_cause = {i.cause: i for i in incidents}
    assert set(by_cause) == {"updates_lost/eps", "updates_lost/rounding", "freeze_verify/not_updated"}
    assert by_cause["freeze_verify/not_updated"].root["details"]["params"] == ["model.embed_tokens.weight"]
