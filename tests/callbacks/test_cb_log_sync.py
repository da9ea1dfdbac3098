"""log_sync: per-rank stats with rank names under DDP and ZeRO-3 and a merged timeline of both
ranks (the shared healthy debug=full runs), a planted straggler (rank 1 sleeps 1 s every step,
in the shared planted DDP run) named, and a crashed job whose W&B run is still finished as
failed (offline). Shared runs: tests/helpers/shared_runs.py."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from dsdebug.callbacks.log_sync import LogSync
from dsdebug.config.prepare import sweep_logger_arguments
from dsdebug.distributed.sweep import wandb_sweep_identity
from dsdebug.errors import ConfigError
from tests.helpers.runs import SMOKE, TINY_NET, only_run_dir, run_train
from tests.helpers.findings import csv_column, read_findings, wandb_records
from tests.helpers.shared_runs import healthy_run, planted_ddp_run


@pytest.mark.parametrize("key, value", [("every_n_steps", 0), ("straggler_factor", 1.0), ("log_level", "LOUD"),
                                        ("straggler_patience", 0)])
def test_bad_value_is_a_one_line_config_error(key, value):
    with pytest.raises(ConfigError, match=rf"^callbacks\.log_sync\.{key}=.*valid: "):
        LogSync(**{key: value})


def test_multirun_job_gets_wandb_group_and_name_from_the_sweep(tmp_path, monkeypatch):
    monkeypatch.delenv("DSDEBUG_SWEEP_DIR", raising=False)
    sweep = tmp_path / "multiruns" / "2026-01-01_00-00-00"
    (sweep / "3").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("{}")
    assert wandb_sweep_identity(tmp_path / "runs" / "x") is None
    assert wandb_sweep_identity(sweep / "3") == {"group": "train-2026-01-01_00-00-00",
                                                 "name": "train-2026-01-01_00-00-00-3"}
    cfg = OmegaConf.create({"task_name": "train", "paths": {"output_dir": str(sweep / "3")},
                            "logger": {"wandb": {"group": "", "name": "train"}}})
    identity = wandb_sweep_identity(sweep / "3")
    assert sweep_logger_arguments(cfg, identity) == {"wandb": {"group": "train-2026-01-01_00-00-00",
                                                               "name": "train-2026-01-01_00-00-00-3"}}
    cfg.logger.wandb.group, cfg.logger.wandb.name = "mine", "my-run"  # the user's choice wins
    assert sweep_logger_arguments(cfg, identity) == {}
    assert sweep_logger_arguments(cfg, None) == {}  # not a sweep job


@pytest.mark.parametrize("kind", ["ddp", "zero3"])
def test_per_rank_stats_with_rank_names_and_a_merged_timeline(kind, tmp_path_factory, shared_cache):
    run_dir, _ = healthy_run(kind, tmp_path_factory, shared_cache)
    for stat in ("step_time", "compute_time", "comm_time", "loss", "mem_mb"):
        lo, hi = csv_column(run_dir, f"ranks/{stat}_min"), csv_column(run_dir, f"ranks/{stat}_max")
        assert lo and set(lo) == set(hi), stat
        assert all(lo[s] <= csv_column(run_dir, f"ranks/{stat}_mean")[s] <= hi[s] for s in lo), stat
        assert set(csv_column(run_dir, f"ranks/{stat}_max_rank").values()) <= {0.0, 1.0}, stat
    assert min(csv_column(run_dir, "ranks/mem_mb_min").values()) > 50  # RSS of a process holding torch
    records = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    lines = [r for r in records if r.get("kind") != "metrics"]
    assert {r["rank"] for r in lines} == {0, 1}, "log lines of both ranks"
    assert {r["rank"] for r in records if r.get("kind") == "metrics"} == {0, 1}
    merged = [m for m in (run_dir / "logs_merged.log").read_text().splitlines() if not m.startswith("    ")]
    assert any(" [rank 0] " in m for m in merged) and any(" [rank 1] " in m for m in merged)
    stamps = [m[:23] for m in merged]  # each entry starts with an ISO timestamp (ms)
    assert stamps == sorted(stamps), "merged log is in time order"


def test_planted_straggler_is_named(tmp_path_factory, shared_cache):
    run_dir, _ = planted_ddp_run(tmp_path_factory, shared_cache)  # rank 1 sleeps 1 s every step
    stragglers = [f for f in read_findings(run_dir) if f["code"] == "straggler"]
    assert len(stragglers) == 1, read_findings(run_dir)
    assert stragglers[0]["rank"] == 1 and stragglers[0]["message"].startswith("rank 1 is a straggler")
    assert 1.0 in csv_column(run_dir, "ranks/compute_time_max_rank").values()
    # log_sync and comm_debug say nothing else (the run's other plants are data_inspector's and
    # grad_monitor's, and their tests check those findings)
    others = [f for f in read_findings(run_dir) if f["check"] in ("log_sync", "comm_debug")
              and f["severity"] != "info" and f["code"] != "straggler"]
    assert not others, others


def test_healthy_zero3_run_is_silent(tmp_path_factory, shared_cache):
    run_dir, _ = healthy_run("zero3", tmp_path_factory, shared_cache)  # debug=full: every check on
    loud = [f for f in read_findings(run_dir) if f["severity"] != "info"]
    assert not loud, loud


@pytest.mark.slow
def test_crashed_job_still_finishes_its_wandb_run_and_timeline(tmp_path, shared_cache):
    args = SMOKE + [
        "logger=many", "trainer.val_check_interval=10", "trainer.limit_val_batches=1", "export.hf=false",
        "export.fp32=false", "+callbacks=log_sync", "callbacks.log_sync.every_n_steps=1", "callbacks.log_sync.warmup_steps=0",
        "+callbacks.plant._target_=tests.planted.comm.RaiseAtStep", "+callbacks.plant.step=2", *TINY_NET]
    proc = run_train(args, tmp_path, shared_cache, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert proc.returncode != 0 and "planted crash at step 2" in proc.stderr
    run_dir = only_run_dir(tmp_path)
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    run_files = list(offline[0].glob("run-*.wandb"))
    assert len(run_files) == 1, "no W&B run file"
    records = wandb_records(run_files[0])
    summary = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for u in r.summary.update}
    assert summary["status"] == "failed" and "planted crash at step 2" in summary["exception"], summary
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [1]
    history = {i.key or "/".join(i.nested_key) for r in records if r.WhichOneof("record_type") == "history"
               for i in r.history.item}
    assert {"ranks/step_time_max", "ranks/step_time_max_rank", "ranks/loss_min"} <= history, history
    assert [f["code"] for f in read_findings(run_dir) if f["code"] != "comm_setting"] == ["wandb_failed_run"]
    events = list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and any(b"ranks/loss_max" in p.read_bytes() for p in events)
    assert "[rank 0]" in (run_dir / "logs_merged.log").read_text()
