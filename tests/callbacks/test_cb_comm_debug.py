"""comm_debug: debug env on every rank, comm share under DDP and ZeRO-3 (the shared healthy
debug=full runs, tests/helpers/shared_runs.py), and a planted hang (rank 1 stuck in a sleep) that the
watchdog names, dumps and ends with exit 124."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from dsdebug.distributed.hang_analysis import analyze
from dsdebug.distributed.hang_watchdog import HANG_EXIT_CODE
from dsdebug.callbacks.comm_debug import CommDebug
from dsdebug.distributed.timing import CommTracker
from dsdebug.errors import ConfigError
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, only_run_dir, run_train
from tests.helpers.findings import csv_column, read_findings
from tests.helpers.shared_runs import healthy_run


@pytest.fixture
def restore_env():
    """CommDebug sets NCCL/torch env vars in the process that builds it: undo that here."""
    import torch.distributed as dist

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    dist.set_debug_level_from_env()


@pytest.mark.parametrize("key, value", [("nccl_debug", "LOUD"), ("distributed_debug", "ALL"),
                                        ("async_error_handling", 7), ("hang_timeout_s", -1), ("hang_poll_s", 0)])
def test_bad_value_is_a_one_line_config_error(key, value):
    with pytest.raises(ConfigError, match=rf"^callbacks\.comm_debug\.{key}=.*valid: "):
        CommDebug(**{key: value})


def test_everything_off_means_no_env_no_tracker_no_thread(tmp_path, restore_env):
    cb = CommDebug(run_dir=str(tmp_path), nccl_debug=None, distributed_debug=None, async_error_handling=None,
                   trace_buffer_size=0, collective_timeout_s=None, measure_comm=False, hang_timeout_s=0)
    trainer = SimpleNamespace(global_rank=0, world_size=1, local_rank=0, is_global_zero=True, global_step=0,
                              default_root_dir=str(tmp_path), strategy=SimpleNamespace(model=None))
    threads = threading.active_count()
    cb.setup(trainer, None, "fit")
    cb.on_fit_start(trainer, None)
    cb.on_train_start(trainer, None)
    assert cb.env == {} and cb.tracker is None and cb.watchdog is None and CommTracker._instance is None
    assert threading.active_count() == threads


def test_env_is_set_at_construction_and_restored_at_teardown(tmp_path, restore_env, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    cb = CommDebug(run_dir=str(tmp_path), distributed_debug="DETAIL", measure_comm=False, hang_timeout_s=0)
    assert os.environ["NCCL_DEBUG"] == "INFO" and os.environ["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
    import torch.distributed as dist

    assert dist.get_debug_level() == dist.DebugLevel.DETAIL  # re-read now, not only in the children
    cb.teardown(None, None, "fit")
    assert os.environ["NCCL_DEBUG"] == "WARN" and "TORCH_DISTRIBUTED_DEBUG" not in os.environ


def test_tracker_counts_nesting_once_and_times_the_union_of_spans():
    tracker = CommTracker()  # not installed: wrap plain functions
    inner = tracker._wrap("all_gather", lambda: time.sleep(0.02))
    outer = tracker._wrap("all_gather_object", lambda: inner())
    t0 = time.perf_counter()
    outer()
    tracker._wrap("barrier", lambda: time.sleep(0.01))()
    t1 = time.perf_counter()
    assert tracker.seq == 2 and tracker.last[0] == "barrier" and not tracker.inflight
    assert 0.03 <= tracker.busy_s(t0, t1) <= t1 - t0
    assert tracker.busy_s(t1, t1 + 1) == 0.0


def test_analysis_names_the_rank_behind():
    now = time.time()
    beat = {"fired": True, "now": now, "step": 2, "seq": 21, "inflight": [], "where": {"in_comm": False}}
    # behind by collectives entered: rank 0 entered #22 and waits there
    beats = {0: {**beat, "seq": 22, "inflight": [{"name": "all_reduce"}]}, 1: beat}
    assert analyze(beats, 2, now, 6)["behind"] == [1]
    # same count, but rank 0 is in comm code (an untracked DDP buffer broadcast): rank 1 never arrived
    beats = {0: {**beat, "where": {"in_comm": True}}, 1: beat}
    assert analyze(beats, 2, now, 6)["culprits"] == [1]
    # rank 2 has no heartbeat; all alive ranks wait in the same collective: nobody alive is behind
    beats = {0: {**beat, "where": {"in_comm": True}}, 1: {**beat, "where": {"in_comm": True}}}
    assert analyze(beats, 3, now, 6) == {"behind": [], "unresponsive": [2], "culprits": [2], "waiting": [0, 1]}


@pytest.mark.parametrize("kind", ["ddp", "zero3"])
def test_comm_share_is_logged_between_zero_and_one(kind, tmp_path_factory, shared_cache):
    run_dir, _ = healthy_run(kind, tmp_path_factory, shared_cache)
    share, ms = csv_column(run_dir, "comm/share"), csv_column(run_dir, "comm/ms")
    assert share and set(share) == set(ms)
    assert all(0 < v < 1 for v in share.values()), share
    assert all(v > 0 for v in ms.values()), ms
    codes = {(f["check"], f["code"]) for f in read_findings(run_dir)}
    assert {("comm_debug", "settings"), ("comm_debug", "comm_summary")} <= codes
    assert not [f for f in read_findings(run_dir) if f["check"] == "comm_debug" and f["severity"] != "info"]


def test_hang_watchdog_names_the_stuck_rank_dumps_stacks_and_ends_the_job(tmp_path, shared_cache):
    args = SMOKE + SMALL_DEEPSEEK + [  # the hang does not depend on the model's size
        "trainer=ddp_sim", "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
        "export.hf=false", "export.fp32=false",
        "strategy=ddp", "+callbacks=comm_debug", "callbacks.comm_debug.hang_timeout_s=8",
        "callbacks.comm_debug.hang_poll_s=1", "+callbacks.plant._target_=tests.planted.comm.SleepOnRank",
        "+callbacks.plant.rank=1", "+callbacks.plant.step=2", "+callbacks.plant.seconds=600"]
    proc = run_train(args, tmp_path, shared_cache, timeout=300)  # the sleep alone would take 600 s
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-4000:]
    # no process of the job remains (the children carry the log dir in their command line)
    leftovers = [p for p in psutil.process_iter(["pid", "cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, leftovers
    run_dir = only_run_dir(tmp_path)
    hangs = [f for f in read_findings(run_dir) if f["code"] == "hang"]
    assert len(hangs) == 1, read_findings(run_dir)
    assert not [f for f in read_findings(run_dir) if f["code"] == "rank_died"]  # exit 124 on purpose
    hang = hangs[0]
    assert hang["severity"] == "error" and hang["rank"] == 1 and hang["step"] == 2
    assert "rank 1 is behind" in hang["message"] and "planted/comm.py" in hang["message"], hang["message"]
    assert "rank 0 waits in" in hang["message"]
    for rank in (0, 1):
        dump = (run_dir / f"hang_rank{rank}.txt").read_text()
        assert f"rank {rank} of 2" in dump and "faulthandler" in dump and "Thread" in dump
    assert "time.sleep(self.seconds)" in (run_dir / "hang_rank1.txt").read_text()
    # the debug env was in effect on both ranks (each rank logs it to its own file)
    for log_file in ("train.log", "rank1.log"):
        text = (run_dir / log_file).read_text()
        assert "NCCL_DEBUG=INFO" in text and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in text, log_file
        assert "torch distributed debug level INFO" in text and "process-group timeout 0:10:00" in text, log_file
    # the hung run still gets its report, with the advisor's NCCL-timeout advice
    assert json.loads((run_dir / "crash.json").read_text())["status"] == "hang"
    report = (run_dir / "report.html").read_text()
    assert "rank 1 is behind" in report and "nccl_timeout" in report and "NCCL_DEBUG=INFO" in report
