"""The report of a plain Lightning project's run: findings in a logger's subfolder are found, no all-clear
without a findings file read, and the run's own vocabulary (callback classes, the command it ran).

Run dirs are written here by hand, as a plain project leaves them (``tensorboard/version_0/findings.jsonl``
beside RunRecord's ``metrics.json`` and HistoryLogger's ``history.jsonl``); ``python -m dsdebug.report``
runs in this process (``__main__.main``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsdebug.report.__main__ import main

NAN = {"check": "grad_monitor", "severity": "error", "code": "nonfinite_grad", "step": 3, "rank": None,
       "message": "non-finite loss on rank(s) [0, 1] at step 3: NaN gradients in layer.weight (+callbacks=nan_triage "
       "names the module)", "advice": "lower the LR",
       "details": {}, "time": 1.0}
SUMMARY = {"check": "grad_monitor", "severity": "info", "code": "grad_summary", "step": 6, "rank": None,
           "message": "checked 6 steps", "advice": "", "details": {}, "time": 2.0}


def _write(folder: Path, records: list[dict], metrics: dict | None = None, history: list[dict] | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "findings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics))
    if history is not None:
        (folder / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))


def _report(run_dir: Path, capsys) -> tuple[str, str]:
    assert main([str(run_dir)]) == 0
    return (run_dir / "report.md").read_text(), capsys.readouterr().err


SPIKE = {"check": "loss_spike", "severity": "warning", "code": "loss_spike", "step": 3, "rank": None,
         "message": "loss spike at step 3", "advice": "inspect that batch (debug=data) and the LR", "details": {},
         "time": 1.5}


PLAIN = {"runner": "lightning", "status": "completed", "command": "python src/train.py trainer=ddp_sim",
         "strategy": "DDPStrategy", "world_size": 2, "precision": "32-true", "global_step": 6, "time_s": 3.1,
         "loggers": ["TensorBoardLogger"]}


def test_findings_in_a_logger_subfolder_are_found_and_named(tmp_path, capsys):
    run = tmp_path / "run"
    _write(run / "tensorboard" / "version_0", [NAN, SPIKE, SUMMARY], PLAIN,
           [{"step": s, "train/loss": 1.0 / (s + 1)} for s in range(6)])
    report, err = _report(run, capsys)
    assert "read tensorboard/version_0/findings.jsonl" in report and "no findings:" not in report
    assert "grad_monitor/nonfinite_grad" in report and "NaN gradients in layer.weight" in report
    assert "tensorboard/version_0/findings.jsonl" in err  # the command says which file it read
    summary = report.split("## Findings")[0]
    assert "| command | python src/train.py trainer=ddp_sim |" in summary  # what was run, not "python train.py"
    assert "| status | completed |" in summary
    # GradMonitor ran (its findings are there) but logged no per-layer norms: said in its own terms
    assert "GradMonitor ran" in report and "enable debug=" not in report
    assert "add LogSync() to the Trainer's callbacks" in report  # a check that did not run: its class
    assert "stopped before composing" not in report
    # a check's advice in dsdebug-train's words (debug=data) is said as the callback to add
    assert "inspect that batch (DataInspector()) and the LR" in report and "debug=data" not in report
    assert "(NaNTriage() names the module)" in report and "+callbacks=" not in report


def test_a_dsdebug_train_run_keeps_its_presets(tmp_path, capsys):
    run = tmp_path / "run"
    _write(run, [SPIKE], {"status": "completed", "global_step": 6})
    (run / "config_resolved.yaml").write_text("trainer:\n  devices: 1\n")
    report, _ = _report(run, capsys)
    assert "(debug=data)" in report and "read findings.jsonl" in report


def test_no_findings_file_is_not_an_all_clear(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "tensorboard" / "version_0").mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"status": "completed", "global_step": 6}))
    report, err = _report(run, capsys)
    assert "no findings:" not in report and "no check reported anything" not in report
    assert "no findings file" in report and str(run) in report  # where it looked
    assert "makes no claim" in err


def test_empty_findings_file_read_is_the_only_all_clear(tmp_path, capsys):
    run = tmp_path / "run"
    _write(run / "lightning_logs" / "version_0", [], PLAIN)
    report, _ = _report(run, capsys)
    assert "read lightning_logs/version_0/findings.jsonl" in report
    assert "no findings: no check reported anything" in report


def test_several_findings_files_are_merged_and_say_so(tmp_path, capsys):
    root = tmp_path / "logs"
    _write(root / "lightning_logs" / "version_0", [NAN], PLAIN)
    _write(root / "lightning_logs" / "version_1", [SUMMARY], PLAIN)
    report, err = _report(root, capsys)
    assert "2 findings files merged" in report and "source" in report
    assert "lightning_logs/version_0" in report and "lightning_logs/version_1" in report
    assert "grad_monitor/nonfinite_grad" in report and "grad_monitor/grad_summary" in report
    assert "2 file(s) read" in err


@pytest.mark.parametrize("plain", [True, False])
def test_hints_speak_the_runs_vocabulary(tmp_path, plain):
    from dsdebug.report.load import load_run
    from dsdebug.report.plots import how_to_enable

    run_dir = tmp_path / "run"
    if plain:
        _write(run_dir / "tensorboard" / "version_0", [], {**PLAIN, "loggers": []})
    else:
        _write(run_dir, [SUMMARY])
        (run_dir / "config_resolved.yaml").write_text("trainer:\n  devices: 1\n")
    run = load_run(run_dir)
    assert run.plain is plain
    text = how_to_enable(run, "grads", "grad_monitor", "GradMonitor", "per-layer norms")
    if plain:
        assert text.startswith("add GradMonitor() to the Trainer's callbacks"), text
    else:
        assert text == "enable debug=grads (grad_monitor)"


def test_check_names_map_to_their_classes():
    """The report's name -> class table (it cannot import the callbacks layer) matches every check."""
    import dsdebug.callbacks as callbacks
    from dsdebug.report.render import CHECK_CLASSES

    checks = {getattr(callbacks, cls).name: cls for cls in callbacks._MODULES
              if cls not in ("DebugCallback", "DeepSpeedWallClock")}
    assert CHECK_CLASSES == checks


def test_a_dense_model_is_not_told_to_add_moe_router(tmp_path, capsys):
    """MoERouter ran and found no router: the MoE figures say so instead of 'add MoERouter()'."""
    run = tmp_path / "run"
    dense = {"check": "moe_router", "severity": "info", "code": "no_routers", "step": 0, "rank": None,
             "message": "BoringModel has no MoE routers", "advice": "", "details": {}, "time": 1.0}
    _write(run / "lightning_logs" / "version_0", [dense], PLAIN)
    report, _ = _report(run, capsys)
    assert report.count("the model has no MoE router") == 2 and "add MoERouter()" not in report
