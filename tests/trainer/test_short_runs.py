"""A run always logs and validates its last step (src/checkpoint/final_step.py), so the report of a short
run has a loss curve and its val/loss is the final model's, not the step-0 sanity check's."""

from __future__ import annotations

import json

from tests.helpers.runs import SMOKE, TINY_NET, train_in_process


def test_short_run_logs_and_validates_its_last_step(tmp_path, shared_cache):
    # 5 optimizer steps of 2 micro-batches; validation every 3 steps (6 batches), logging every 10:
    # Lightning alone would log no train row and validate at step 3 only
    overrides = SMOKE + TINY_NET + [
        "trainer.max_steps=5", "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=10", "trainer.limit_val_batches=1", "data.max_tokens=20000",
        "export.fp32=false", "export.hf=false"]
    run_dir = tmp_path / "run"
    m = train_in_process(overrides, run_dir, shared_cache)
    assert m["global_step"] == 5  # the final validation waited for the last micro-batch of the window

    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/loss"]) for r in rows if "val/loss" in r]
    # Lightning's step of a row = optimizer steps done before it: sanity (0), after step 3, after step 5
    assert [s for s, _ in val] == [0, 2, 4], val
    assert val[-1][1] != val[0][1] and m["val/loss"] == val[-1][1] and m["val/loss_at_start"] == val[0][1]
    assert [r["step"] for r in rows if "train/loss" in r] == [4]  # the last step, though not a multiple of 10

    from dsdebug.report.load import load_run
    from dsdebug.report.figure import finite
    from dsdebug.report.plots import loss

    run = load_run(run_dir)
    assert finite(*run.series("train/loss"))[0] == [4] and loss(run) is not None
    md = (run_dir / "report.md").read_text()
    assert "![Loss and learning rate](report_files/loss.png)" in md and (run_dir / "report_files" / "loss.png").is_file()
    assert f"| val/loss | {m['val/loss']:.4f} |" in md  # the report and metrics.json agree
    assert "not recorded: the model is dense: no MoE routers found" in md  # says why, not "MoE models only"
