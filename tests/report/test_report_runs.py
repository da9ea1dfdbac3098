"""Reports written by real runs, by rank 0, however the run ended: the shared healthy debug=full
run, the shared planted run, a crash, and Ctrl-C. The HTML parses, every plot decodes, and every
finding the run recorded appears."""

from __future__ import annotations

import html
import json
import os
import signal

import pytest

from tests.helpers.runs import SMOKE, TINY_NET, only_run_dir, run_train
from tests.helpers.procs import start_train, wait_for
from tests.helpers.findings import read_findings
from tests.helpers.shared_runs import healthy_run, planted_ddp_run
from tests.report.test_report_render import data_uri_pngs, parse


def _check_report(run_dir, min_images=1):
    page = parse(run_dir / "report.html")
    assert len(data_uri_pngs(page)) >= min_images
    text = page.all_text
    findings = read_findings(run_dir)
    for f in findings:
        assert f["message"] in text or html.unescape(f["message"]) in text, f
    md = (run_dir / "report.md").read_text()
    assert all(f["code"] in md for f in findings)
    return text, findings


def test_healthy_run_report(tmp_path_factory, shared_cache):
    run_dir, _ = healthy_run("zero3", tmp_path_factory, shared_cache)  # debug=full, 2 ranks
    text, findings = _check_report(run_dir, min_images=4)  # loss, grad norms, per-rank time and memory
    assert "completed" in text and findings  # debug=full reports info findings
    assert not [f for f in findings if f["check"] == "advisor"], "a healthy run must not trip a rule"
    from dsdebug.report.load import load_run
    from dsdebug.report.plots import moe_load

    run = load_run(run_dir)
    assert run.keys("moe/load/L"), "per-layer, per-expert load is logged for the MoE heatmap"
    m = run.metrics  # throughput for the sweep index: steps x batch x accumulation x ranks x seq_len / fit time
    tokens = m["global_step"] * run.cfg("data.batch_size") * run.cfg("trainer.accumulate_grad_batches") * 2 * 128
    assert m["throughput/tokens_per_s"] == pytest.approx(tokens / m["fit_time_s"], rel=0.01)
    assert moe_load(run) is not None


def test_planted_run_report(tmp_path_factory, shared_cache):
    run_dir, _ = planted_ddp_run(tmp_path_factory, shared_cache)
    text, findings = _check_report(run_dir)
    assert {"error", "warning"} <= {f["severity"] for f in findings}


def test_crashed_run_report(tmp_path, shared_cache):
    args = SMOKE + TINY_NET + ["export.fp32=false", "export.hf=false",
                              "+callbacks.plant._target_=tests.planted.comm.RaiseAtStep", "+callbacks.plant.step=2"]
    proc = run_train(args, tmp_path, shared_cache)
    assert proc.returncode == 1
    run_dir = only_run_dir(tmp_path)
    crash = json.loads((run_dir / "crash.json").read_text())
    assert crash["status"] == "crashed" and "planted crash at step 2" in crash["error"]
    text, _ = _check_report(run_dir)
    assert "planted crash at step 2" in text and "crashed" in text


@pytest.mark.slow  # a real run interrupted with SIGINT
def test_ctrl_c_run_report(tmp_path, shared_cache):
    args = SMOKE + TINY_NET + [
        "trainer.max_steps=100000", "export.fp32=false", "export.hf=false"]
    # a shell's background job inherits SIGINT ignored, and then Python installs no Ctrl-C handler:
    # give the run the terminal's default, as for a user at a prompt
    proc = start_train(args, tmp_path, shared_cache, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for(lambda: any(p.stat().st_size > 0 for p in tmp_path.glob("train/runs/*/history.jsonl")), 240,
             "the first logged step", proc)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    run_dir = only_run_dir(tmp_path)
    assert json.loads((run_dir / "crash.json").read_text())["status"] == "interrupted"
    text, _ = _check_report(run_dir)
    assert "interrupted" in text
