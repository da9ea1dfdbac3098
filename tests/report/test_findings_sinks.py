"""Findings on dashboards (src/findings/sinks.py): a run with a planted NaN leaves that finding in
TensorBoard's event file (text) and in the W&B offline run (an alert and the findings table);
secrets never reach them; a dashboard that fails does not stop a run."""

from __future__ import annotations

import json

from dsdebug.findings.channel import Finding, FindingsChannel
from dsdebug.findings.secrets import redact_text
from dsdebug.findings.sinks import attach_dashboards
from tests.helpers.findings import wandb_records
from tests.helpers.runs import SMOKE, TINY_NET, assert_ok, only_run_dir, run_train


class _Writer:
    def __init__(self) -> None:
        self.texts: list[tuple] = []
        self.alerts: list[dict] = []
        self.logged: list[dict] = []
        self.summary: dict = {}

    def add_text(self, tag, text, global_step=None):
        self.texts.append((tag, text, global_step))

    def flush(self):
        pass

    def alert(self, **kwargs):
        self.alerts.append(kwargs)

    def log(self, data):
        self.logged.append(data)


class TensorBoardLogger:  # recognised by class name, as Lightning's
    def __init__(self) -> None:
        self.experiment = _Writer()


class WandbLogger(TensorBoardLogger):
    pass


class CSVLogger:
    @property
    def experiment(self):
        raise AssertionError("a logger without a dashboard is never touched")


def _finding(severity: str, step: int = 3, message: str = "non-finite loss at step 3") -> Finding:
    return Finding(check="nan_triage", severity=severity, code=f"nan_{severity}", message=message,
                   advice="lower the LR", step=step, rank=0)


def test_errors_alert_every_finding_is_text_and_the_table_has_all(tmp_path):
    channel = FindingsChannel(tmp_path)
    early = channel.report(_finding("info", step=None))  # before the loggers exist: replayed on attach
    tb, wb = TensorBoardLogger(), WandbLogger()
    sink = attach_dashboards(channel, [CSVLogger(), tb, wb])
    channel.report(_finding("warning"))
    channel.report(_finding("error", message="loss nan; WANDB_API_KEY=abc123 in env"))
    assert [t[0] for t in tb.experiment.texts] == ["findings/nan_triage"] * 3
    assert tb.experiment.texts[0][2] == 0 and tb.experiment.texts[2][2] == 3  # setup -> step 0
    assert "**error** `nan_triage/nan_error` step 3, rank 0" in tb.experiment.texts[2][1]
    assert [a["title"] for a in wb.experiment.alerts] == ["dsdebug nan_triage/nan_error"]  # errors only
    assert wb.experiment.alerts[0]["level"] == "ERROR"
    assert "abc123" not in repr(tb.experiment.texts) + repr(wb.experiment.alerts)
    # another rank's finding (read from findings.jsonl at the end) is sent once; the table has all
    other = json.loads(Finding(check="log_sync", severity="error", code="straggler", message="rank 1 slow",
                               step=4, rank=1).to_json())
    sink.finish([*channel.read_all(), other])
    assert len(tb.experiment.texts) == 5 and len(wb.experiment.alerts) == 2
    # the incidents (src/findings/incidents.py): the verdict first, one line per root cause
    tag, text, step = tb.experiment.texts[-1]
    assert tag == "incidents" and step == 4
    assert text.startswith("verdict: 3 incidents (2 errors, 1 warning); worst: nan_triage/nan_error at step 3 ")
    assert "**error** log_sync/straggler at step 4 on rank 1" in text and "abc123" not in text
    incidents = wb.experiment.logged[-1]["incidents"]
    assert [row[2] for row in incidents.data] == ["nan_triage/nan_error", "log_sync/straggler", "nan_triage/nan_warning"]
    assert wb.experiment.summary["verdict"].startswith("verdict: 3 incidents")
    table = wb.experiment.logged[-1]["findings"]
    assert [row[2] for row in table.data] == ["nan_info", "nan_warning", "nan_error", "straggler"]
    assert [row[4] for row in table.data] == ["0", "0", "0", "1"]  # one type per column (W&B refuses mixed)
    assert early.code == "nan_info" and "abc123" not in repr(table.data)


def test_a_failing_dashboard_does_not_stop_the_run(tmp_path):
    broken = TensorBoardLogger()
    broken.experiment.add_text = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("disk full"))
    channel = FindingsChannel(tmp_path)
    attach_dashboards(channel, [broken])
    channel.report(_finding("error"))  # no exception
    assert len(channel.read_all()) == 1
    assert attach_dashboards(FindingsChannel(tmp_path), [CSVLogger()]) is None  # no dashboard: no sink


def test_redact_text():
    text = redact_text('WANDB_API_KEY=abc123, logger.wandb.api_key: "xyz" hf_token=t0k data.max_tokens=5 tokenizer=x')
    assert "abc123" not in text and "xyz" not in text and "t0k" not in text
    assert "data.max_tokens=5" in text and "tokenizer=x" in text


def test_planted_nan_reaches_tensorboard_and_wandb(tmp_path, shared_cache):
    """One 1-process run, logger=many (CSV, TensorBoard, W&B offline), a transient NaN at step 2."""
    args = SMOKE + [
        *TINY_NET, "logger=many", "trainer.max_steps=4", "trainer.val_check_interval=100", "export.fp32=false",
        "export.hf=false", "+callbacks=nan_triage", "callbacks.nan_triage.on_error=skip",
        "+callbacks.planted._target_=tests.planted.nan.NaNOutput", "+callbacks.planted.module=mlp.2",
        "+callbacks.planted.step=2", "+callbacks.planted.calls=1"]
    proc = run_train(args, tmp_path, shared_cache, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                                                      "WANDB_DIR": str(tmp_path / "wandb_dir")})
    assert_ok(proc)
    run_dir = only_run_dir(tmp_path)
    records = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]
    errors = [r for r in records if r["severity"] == "error"]
    # the planted NaN, and the report's advisor on the loss curve it left (added after fit)
    assert {(r["check"], r["code"], r["step"]) for r in errors} == {("nan_triage", "nan_transient", 2),
                                                                      ("advisor", "loss_diverging", 2)}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("findings/nan_triage/text_summary")}
    assert any(step == 2 and "`nan_triage/nan_transient` step 2, rank 0" in text for step, text in texts), texts

    [wandb_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    alerts = [r.alert for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "alert"]
    assert sorted((a.title, a.level) for a in alerts) == [("dsdebug advisor/loss_diverging", "ERROR"),
                                                          ("dsdebug nan_triage/nan_transient", "ERROR")]
    assert any("`nan_triage/nan_transient` step 2, rank 0" in a.text for a in alerts)
    [table] = wandb_file.parent.glob("files/media/table/findings_*.table.json")
    table = json.loads(table.read_text())
    code = table["columns"].index("code")
    assert sorted(row[code] for row in table["data"] if row[0] == "error") == ["loss_diverging", "nan_transient"]
    assert len(table["data"]) == len(records)  # every finding of the run, not only the errors


def test_attaching_again_returns_the_same_sink(tmp_path):
    """dsdebug-train attaches before fit and every check's setup attaches again: one sink, each finding once."""
    channel = FindingsChannel(tmp_path)
    tb = TensorBoardLogger()
    first = attach_dashboards(channel, [tb])
    assert attach_dashboards(channel, [tb]) is first and attach_dashboards(channel, [TensorBoardLogger()]) is first
    assert len(channel.sinks) == 1
    channel.report(_finding("error"))
    assert len(tb.experiment.texts) == 1
