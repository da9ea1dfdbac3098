"""profiler: Chrome trace per rank, sorted top-ops table, step-time breakdown metrics, and a
data-wait warning naming the dataloader when the input pipeline is the bottleneck."""

from __future__ import annotations

import csv
import json

import pytest

from dsdebug.callbacks.profiler import Profiler
from dsdebug.errors import ConfigError
from tests.helpers.findings import of, read_findings
from tests.helpers.shared_runs import data_run, healthy_run

BREAKDOWN = ["time/step_ms", "time/data_ms", "time/forward_ms", "time/backward_ms", "time/optimizer_ms",
             "time/comm_ms", "time/data_fraction"]


def _trace_names(path) -> set[str]:
    trace = json.loads(path.read_text())
    return {e.get("name", "") for e in trace["traceEvents"]}


def test_healthy_run_trace_table_and_breakdown(tmp_path_factory, shared_cache):
    run_dir, findings = data_run("healthy", tmp_path_factory, shared_cache)
    assert of(findings, "profiler") == []
    names = _trace_names(run_dir / "profiler" / "trace_rank0.json")
    assert {"aten::mm", "dsdebug/forward", "dsdebug/backward"} <= names
    assert any(n.startswith("ProfilerStep#") for n in names)
    assert (run_dir / "profiler" / "top_ops_rank0.txt").read_text().count("aten::") >= 5
    rows = json.loads((run_dir / "profiler" / "top_ops_rank0.json").read_text())["rows"]
    times = [r["self_cpu_us"] for r in rows]
    assert len(rows) == 15 and times == sorted(times, reverse=True)
    with open(run_dir / "csv" / "metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row.get("time/step_ms")]
    assert logged and all(float(logged[0][k]) >= 0 for k in BREAKDOWN)
    info = [f for f in findings if f["code"] == "step_breakdown"]
    assert info and "forward" in info[0]["message"] and "trace_rank0.json" in info[0]["message"]


def test_slow_collate_is_a_data_bound_warning_naming_the_loader(tmp_path_factory, shared_cache):
    _, findings = data_run("planted", tmp_path_factory, shared_cache)
    bad = of(findings, "profiler")
    assert [f["code"] for f in bad] == ["data_bound"]
    f = bad[0]
    assert f["rank"] == 0 and "collate_fn=slow_collate" in f["message"] and "num_workers=0" in f["message"]
    assert f["details"]["metrics"]["time/data_fraction"] > 0.3 and "num_workers" in f["advice"]


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_two_processes_write_a_trace_per_rank(strategy, tmp_path_factory, shared_cache):
    run_dir, _ = healthy_run(strategy, tmp_path_factory, shared_cache)  # shared: tests/helpers/shared_runs.py
    findings = read_findings(run_dir)
    assert of(findings, "profiler") == []
    for rank in (0, 1):
        names = _trace_names(run_dir / "profiler" / f"trace_rank{rank}.json")
        assert any(n.startswith("ProfilerStep#") for n in names)
        assert any(n.startswith(("gloo:", "c10d::")) for n in names), "collectives missing from the trace"
    breakdown = json.loads((run_dir / "profiler" / "breakdown_rank1.json").read_text())
    assert breakdown["time/comm_ms"] > 0


@pytest.mark.parametrize("kwargs", [{"active": 0}, {"data_warn_fraction": 0}, {"with_stack": "no"}])
def test_bad_values_are_config_errors(kwargs):
    with pytest.raises(ConfigError, match=r"callbacks\.profiler\.\w+=.*valid"):
        Profiler(**kwargs)

