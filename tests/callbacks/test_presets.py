"""debug=none|light|full and the per-technique presets."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dsdebug.callbacks import is_debug_check
from tests.helpers.runs import CONF, REPO, metrics
from tests.helpers.shared_runs import healthy_run

PRESETS = sorted(p.stem for p in (CONF / "debug").glob("*.yaml"))
SEVEN = {"reproducibility", "comm_debug", "grad_monitor", "data_inspector", "profiler", "freeze_verify", "log_sync"}
# the forensics checks: all in debug=full, the cheap ones in debug=light
FORENSICS = {"replica_parity", "loss_spike", "layer_health", "moe_router", "memory", "throughput", "mixed_precision",
             "nan_triage", "outcome_monitor", "preflight", "train_mode", "optimizer_coverage", "weight_norm"}
FORENSICS_LIGHT = {"loss_spike", "moe_router", "memory", "throughput", "mixed_precision", "outcome_monitor",
                   "preflight", "train_mode", "optimizer_coverage"}


def _debug_callbacks(preset: str) -> set[str]:
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"debug={preset}"])
    GlobalHydra.instance().clear()
    return {name for name, c in cfg.callbacks.items() if is_debug_check(str(c.get("_target_", "")))}


def test_debug_none_adds_no_debug_callback(monkeypatch):
    monkeypatch.setenv("PROJECT_ROOT", str(REPO))
    assert _debug_callbacks("none") == set()


def test_presets_select_the_right_checks(monkeypatch):
    monkeypatch.setenv("PROJECT_ROOT", str(REPO))
    assert _debug_callbacks("full") == SEVEN | FORENSICS
    assert _debug_callbacks("light") == {"reproducibility", "grad_monitor", "data_inspector", "comm_debug", "log_sync",
                                         *FORENSICS_LIGHT}
    singles = {"repro": "reproducibility", "comm": "comm_debug", "grads": "grad_monitor", "data": "data_inspector",
               "profile": "profiler", "freeze": "freeze_verify", "logs": "log_sync"}
    for preset, callback in singles.items():
        assert callback in _debug_callbacks(preset), preset
    assert set(PRESETS) == {"none", "light", "full", *singles}


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_debug_full_on_a_healthy_two_process_run_is_silent(strategy, tmp_path_factory, shared_cache):
    run_dir, proc = healthy_run(strategy, tmp_path_factory, shared_cache)  # shared: tests/helpers/shared_runs.py
    assert metrics(run_dir)["global_step"] == 6
    records = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]
    assert {r["check"] for r in records} >= SEVEN - {"log_sync"}  # they ran and reported (info)
    bad = [r for r in records if r["severity"] != "info"]
    assert bad == [], json.dumps(bad, indent=1)[:3000]
    assert {r["rank"] for r in records} >= {0}
    # the end of fit: no incident, info findings are not listed, one verdict line (tests/trainer/test_console.py)
    assert proc.stdout.strip().splitlines()[-1].startswith("verdict: healthy: no warning or error (")


def test_the_issue_command_line_forms(monkeypatch):
    monkeypatch.setenv("PROJECT_ROOT", str(REPO))

    def cbs(overrides):
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        GlobalHydra.instance().clear()
        return cfg.callbacks

    assert "grad_monitor" not in cbs(["debug=full", "~callbacks.grad_monitor"])
    assert "profiler" in cbs(["+callbacks=profiler"])
    assert cbs(["+callbacks=grad_monitor", "callbacks.grad_monitor.every_n_steps=5"]).grad_monitor.every_n_steps == 5
    assert cbs(["debug=light", "callbacks.grad_monitor.every_n_steps=5"]).grad_monitor.every_n_steps == 5
