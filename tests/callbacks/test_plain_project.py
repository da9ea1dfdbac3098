"""The checks in a plain Hydra + Lightning project (``examples/hydra_template``, lightning-hydra-template's
layout; the checks come in by YAML only), under Lightning's ``ddp_spawn`` and DDP.

- fast: every check pickles after construction and mid-fit (``ddp_spawn`` sends the callbacks to its
  processes; a thread, lock or log handler in a check was a ``TypeError: cannot pickle``), and the copy works;
  CommDebug creates nothing in the current directory at construction;
- fast (the only ``ddp_spawn`` cover): the example with every check (``callbacks=dsdebug_full``) on 2 CPU
  processes and a NaN planted at step 2: the run completes, findings.jsonl lands in the logger's folder
  (``tensorboard/version_0/``), ``python -m dsdebug.report <run dir>`` finds it and names the NaN, and the
  TensorBoard event file holds the finding (TEXT tab);
- slow: the same project under ``strategy=ddp`` (Lightning re-runs the script per rank).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.helpers.runs import REPO, assert_ok

EXAMPLE = REPO / "examples" / "hydra_template"
DEEPSPEED_ONLY = {"DeepSpeedWallClock"}  # needs a DeepSpeed engine


def _all_checks() -> list[str]:
    import dsdebug.callbacks as cb

    return [n for n in cb._MODULES if n != "DebugCallback" and n not in DEEPSPEED_ONLY]


def _build(name: str):
    import dsdebug.callbacks as cb

    kwargs = {"wait": 1, "warmup": 0, "active": 1} if name == "Profiler" else {}
    return getattr(cb, name)(**kwargs)


# ---- pickling ---------------------------------------------------------------------------------
def test_every_check_pickles_after_construction_and_mid_fit(tmp_path, monkeypatch):
    import lightning as L

    from examples.plain_lightning.src.model import BoringModel
    from dsdebug.findings import channel as ch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ch, "_channel", ch.FindingsChannel(origin="default"))
    checks = [_build(n) for n in _all_checks()]
    copies = {type(c).__name__: pickle.loads(pickle.dumps(c)) for c in checks}  # before setup (ddp_spawn's case)
    log_sync = copies["LogSync"]
    assert log_sync.buffer is not None and log_sync.buffer in logging.getLogger().handlers  # re-created
    logging.getLogger().removeHandler(log_sync.buffer)
    failures: list[str] = []

    class PickleMidFit(L.Callback):  # after setup: threads, locks, the profiler and the Trainer exist
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step != 2:
                return
            for check in checks:
                try:
                    copy = pickle.loads(pickle.dumps(check))
                except Exception as exc:  # noqa: BLE001 - collect every failing check
                    failures.append(f"{type(check).__name__}: {type(exc).__name__}: {exc}")
                    continue
                if getattr(copy, "buffer", None) is not None:
                    logging.getLogger().removeHandler(copy.buffer)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, val_check_interval=2, limit_val_batches=1,
                        default_root_dir=tmp_path / "root", callbacks=[*checks, PickleMidFit()],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(BoringModel())
    assert not failures, failures
    assert not (tmp_path / "flight_recorder").exists()  # nothing in the current directory


def test_comm_debug_creates_nothing_at_construction_and_dumps_in_the_run_dir(tmp_path, monkeypatch):
    from dsdebug.callbacks import CommDebug

    monkeypatch.chdir(tmp_path)
    for key in ("TORCH_FR_DUMP_TEMP_FILE", "NCCL_DEBUG_FILE"):
        monkeypatch.delenv(key, raising=False)
    check = CommDebug(measure_comm=False, hang_timeout_s=0)
    assert list(tmp_path.iterdir()) == [] and "NCCL_DEBUG_FILE" not in os.environ  # no files in cwd
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    root = tmp_path / "run"
    trainer = SimpleNamespace(global_rank=0, world_size=1, local_rank=0, is_global_zero=True, global_step=0,
                              default_root_dir=str(root), strategy=SimpleNamespace(model=None))
    check.setup(trainer, None, "fit")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(root / "flight_recorder" / "rank_")
    assert (root / "flight_recorder").is_dir() and not (tmp_path / "flight_recorder").exists()
    check.teardown(trainer, None, "fit")
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ  # restored


def test_full_callbacks_config_holds_every_check():
    conf = yaml.safe_load((EXAMPLE / "configs" / "callbacks" / "dsdebug_full.yaml").read_text())
    light = yaml.safe_load((EXAMPLE / "configs" / "callbacks" / "dsdebug.yaml").read_text())
    targets = {v["_target_"].rsplit(".", 1)[1] for v in {**conf, **light}.values() if isinstance(v, dict)}
    assert set(_all_checks()) <= targets, set(_all_checks()) - targets


def test_plain_fit_sends_findings_to_wandb_and_records_the_run(tmp_path, monkeypatch):
    """1 process, the user's own TensorBoard + W&B (offline) loggers, GradMonitor, NaN at step 2: the checks
    attach the findings to both dashboards themselves; RunRecord writes metrics.json, HistoryLogger the norms."""
    pytest.importorskip("wandb")
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    from dsdebug.callbacks import GradMonitor
    from dsdebug.findings import channel as ch
    from examples.plain_lightning.src.model import BoringModel
    from tests.helpers.findings import wandb_records

    monkeypatch.setattr(ch, "_channel", ch.FindingsChannel(origin="default"))
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    root = tmp_path / "root"
    loggers = [TensorBoardLogger(root, name="tensorboard"), WandbLogger(save_dir=str(tmp_path), project="plain")]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, limit_val_batches=0, default_root_dir=root,
                        logger=loggers, callbacks=[GradMonitor()], enable_progress_bar=False, log_every_n_steps=1,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(BoringModel(nan_at_step=2))
    loggers[1].experiment.finish()
    assert trainer.logger is loggers[0]  # the user's first logger stays first (log_dir unchanged)
    log_dir = root / "tensorboard" / "version_0"
    record = json.loads((log_dir / "metrics.json").read_text())
    assert record["status"] == "completed" and record["global_step"] == 4 and record["runner"] == "lightning"
    assert record["loggers"] == ["TensorBoardLogger", "WandbLogger"]
    history = (log_dir / "history.jsonl").read_text()
    assert "grad/norm/layer" in history  # GradMonitor's per-layer norms, for the report's figure

    [wandb_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    alerts = [r.alert for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "alert"]
    assert [a.title for a in alerts] == ["dsdebug grad_monitor/nonfinite_grad"] * len(alerts) and alerts
    assert "step 2" in alerts[0].text
    [table] = wandb_file.parent.glob("files/media/table/findings_*.table.json")
    rows = json.loads(table.read_text())["data"]
    assert len(rows) == len((log_dir / "findings.jsonl").read_text().splitlines())  # every finding, once


# ---- the example project on 2 CPU processes ----------------------------------------------------
def _run_example(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> Path:
    project = shutil.copytree(EXAMPLE, tmp_path / "project", ignore=shutil.ignore_patterns("__pycache__", "logs"))
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "PROJECT_ROOT")}
    proc = subprocess.run([sys.executable, "src/train.py", "callbacks=dsdebug_full", "model.nan_at_step=2",
                           "data.num_samples=64", "trainer.max_epochs=1", "+trainer.log_every_n_steps=1", *overrides],
                          cwd=project, capture_output=True, text=True, timeout=600, env={**clean, "PYTHONUNBUFFERED": "1", **(env or {})})
    assert_ok(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
    assert not (project / "flight_recorder").exists()
    runs = sorted((project / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 1, runs  # one run dir, whichever launcher made the ranks
    return runs[0]


def _assert_nan_named(run_dir: Path, findings_dir: str = "tensorboard/version_0") -> None:
    findings = run_dir / findings_dir / "findings.jsonl"  # trainer.log_dir: the first logger's folder
    records = [json.loads(line) for line in findings.read_text().splitlines()]
    nan = [r for r in records if (r["check"], r["code"]) == ("grad_monitor", "nonfinite_grad")]
    assert nan and nan[0]["step"] == 2 and "non-finite loss" in nan[0]["message"], records
    assert {r.get("rank") for r in records} >= {0, None}

    # the report, given the Hydra run dir, finds the logger's findings file and names the NaN
    proc = subprocess.run([sys.executable, "-m", "dsdebug.report", str(run_dir)], capture_output=True, text=True,
                          timeout=300)
    assert_ok(proc)
    report = (run_dir / "report.md").read_text()
    assert f"read {findings_dir}/findings.jsonl" in report and "no findings:" not in report
    assert "grad_monitor/nonfinite_grad" in report and "non-finite loss" in report
    summary = report.split("## Findings")[0]
    assert "| status | completed |" in summary and "src/train.py callbacks=dsdebug_full" in summary, summary
    assert "enable debug=" not in report, "dsdebug-train's vocabulary in a plain project's report"
    # the checks' metrics reached the report (HistoryLogger beside the user's loggers): figures, not hints
    for figure in ("Loss and learning rate", "Gradient norm per layer", "Step time per rank"):
        assert f"![{figure}]" in report, figure

    # TensorBoard's TEXT tab holds the finding (the checks attached the findings to the user's logger)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((run_dir / "tensorboard" / "version_0").glob("events.out.tfevents.*"))
    texts = []
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            texts += [t.tensor_proto.string_val[0].decode() for t in acc.Tensors(tag) if tag.startswith("findings/")]
    assert any("grad_monitor/nonfinite_grad" in t and "step 2" in t for t in texts), texts[:5]


def test_hydra_template_ddp_spawn_every_check_names_a_planted_nan(tmp_path):
    run_dir = _run_example(tmp_path, "trainer=ddp_sim")
    _assert_nan_named(run_dir)


@pytest.mark.slow  # plain-project findings/report/TensorBoard are covered by the ddp_spawn run; this adds DDP's launcher
def test_hydra_template_ddp_names_a_planted_nan(tmp_path):
    """DDP (Lightning re-runs the script per rank) with CSV, TensorBoard and W&B (offline): the findings land in
    the first logger's folder (csv/version_0), TensorBoard and W&B get them from the checks."""
    pytest.importorskip("wandb")
    from tests.helpers.findings import wandb_records

    run_dir = _run_example(tmp_path, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                           "trainer.sync_batchnorm=false", "logger=many_loggers",
                           env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    _assert_nan_named(run_dir, "csv/version_0")
    [wandb_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    alerts = [r.alert for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "alert"]
    assert any(a.title == "dsdebug grad_monitor/nonfinite_grad" and "step 2" in a.text for a in alerts), alerts


@pytest.mark.parametrize("accumulate", [1, 3])
def test_the_step_loss_of_a_plain_module_is_what_training_step_returned(accumulate, tmp_path):
    """A plain LightningModule (no last_train_loss): the checks read outputs["loss"], which Lightning divides by
    accumulate_grad_batches before the callbacks see it; step_loss multiplies it back."""
    import lightning as L
    import torch

    from dsdebug.callbacks.grad_access import step_loss

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.returned: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = self.lin(batch[0]).pow(2).mean() + 1.0
            self.returned.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Read(L.Callback):
        seen: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(float(step_loss(pl_module, outputs)))

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=2)
    module, read = Plain(), Read()
    L.Trainer(max_epochs=1, accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[read],
              default_root_dir=tmp_path).fit(module, data)
    assert len(read.seen) == 6 and read.seen == pytest.approx(module.returned, rel=1e-6)
