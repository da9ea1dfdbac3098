"""benchmarks/overhead.py: the summary math, the interleaving, and one real (small) cell.

The real cell fits debug=none and debug=light twice each in ONE process, the way the benchmark
measures, and checks what the numbers rest on: each fit had exactly its variant's callbacks,
the rounds ran in rotated order, and no fit left process-wide state behind (deterministic
mode, threads, log handlers, wrapped collectives, signal handlers) that would bill one
variant's cost to the next.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.runs import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import harness  # noqa: E402
import overhead  # noqa: E402

SCRIPT = REPO / "benchmarks" / "overhead.py"


def test_rotated_rounds_put_every_variant_first_once():
    items = ["none", "light", "full"]
    orders = [harness.rotated(items, r) for r in range(3)]
    assert [o[0] for o in orders] == items
    assert all(sorted(o) == sorted(items) for o in orders)


def test_window_stats_charge_periodic_steps_not_random_slow_ones():
    # warm-up 2; window steps 2..11: step 10 is periodic (cadence 10) and costs 1 s extra,
    # step 5 is slowed by something else on the machine
    steps = [5.0, 4.0] + [1.0] * 3 + [3.0] + [1.0] * 4 + [2.0, 1.0]
    stats = harness.window_stats(steps, warmup=2, window=10, cadences=(10,))
    assert stats["median_s"] == 1.0
    assert stats["steady_s"] == pytest.approx(1.1)     # the periodic excess, spread over 10 steps
    assert stats["mean_s"] == pytest.approx(1.3)       # the mean also charges the random slow step
    assert stats["warmup_s"] == 9.0
    assert harness.window_stats(steps, 2, 10)["steady_s"] == 1.0  # no cadence: the median
    with pytest.raises(ValueError, match="needs 13"):
        harness.window_stats(steps, warmup=3, window=10)


def _fit(r, variant, step, warm_extra=0.0, setup=0.5):
    return {"round": r, "variant": variant, "setup_s": setup, "tokens_per_step": 1024, "leaked": {},
            "step_s": [step + warm_extra / 2] * 2 + [step] * 4, "window": 4, "cadences": []}


def test_summary_ratio_is_per_round_so_drift_cancels():
    # the machine gets 2x slower in round 1; light costs 10 % in both rounds, plus 3 s once
    cell = {"warmup": 2, "window": 4, "fits": [
        _fit(0, "none", 1.0), _fit(0, "light", 1.1, warm_extra=3.0),
        _fit(1, "light", 2.2, warm_extra=3.0), _fit(1, "none", 2.0)]}
    rows = overhead.summarize(cell)
    assert rows["none"]["steady"] == 0
    assert rows["light"]["steady"] == pytest.approx(0.10)
    assert rows["light"]["oneoff_s"] == pytest.approx(3.0)
    # default run: +10 % per step, plus 3 s over 300 steps at the median none rate (1.5 s)
    assert rows["light"]["default_run"] == pytest.approx(0.10 + 3.0 / (300 * 1.5))
    assert rows["light"]["tokens_per_s"] == pytest.approx(1024 / 1.65)


def test_cpu_ab_sums_every_rank_over_the_same_window():
    # 2 ranks; the window is steps 2..5; light burns 5 % more CPU on each rank in both rounds, while the
    # wall time of round 1 is disturbed by a neighbour (CPU does not move)
    def fit(r, variant, step, cpu):
        return {**_fit(r, variant, step), "cpu_step_s": [[9.0, 9.0] + [cpu] * 4, [8.0, 8.0] + [cpu] * 4]}

    cell = {"warmup": 2, "window": 4, "fits": [fit(0, "none", 1.0, 0.8), fit(0, "light", 1.0, 0.84),
                                                 fit(1, "light", 1.5, 0.84), fit(1, "none", 1.0, 0.8)]}
    rows = overhead.summarize(cell)
    assert rows["light"]["cpu_steady"] == pytest.approx(0.05) and rows["none"]["cpu_steady"] == 0
    assert rows["light"]["cpu_step_ms"] == pytest.approx(1680.0)  # 2 ranks x 0.84 s
    assert (rows["light"]["cpu_steady_min"], rows["light"]["cpu_steady_max"]) == (pytest.approx(0.05),) * 2
    assert overhead.window_cpu_s({"cpu_step_s": [[1.0] * 5]}, warmup=2, window=4) is None  # too short
    assert overhead.summarize({"warmup": 2, "window": 4, "fits": [_fit(0, "none", 1.0)]})["none"]["cpu_steady"] is None

    import overhead_report

    md = overhead_report.table({"cells": {"zero2:2": {"summary": rows, "rounds": 2, "warmup": 2, "wall_s": 1.0}}})
    assert "| 1680 | +5.0% | +5.0%..+5.0% |" in md and "CPU A/B steady **over**" in md


def test_direct_share_is_hook_time_over_the_rest_of_the_window():
    fit = {"window": 4, "step_s": [9.0, 9.0, 1.0, 1.0, 1.0, 1.0],
           "hook_s": {"grad_monitor": [5.0, 0, 0.1, 0.1, 0.1, 0.1], "data_inspector": [0, 0, 0, 0, 0.2, 0]}}
    share = overhead.direct_share(fit, warmup=2)
    assert share["direct"] == pytest.approx(0.6 / 3.4)
    assert share["direct_by_cb"]["data_inspector"] == pytest.approx(0.2 / 3.4)
    assert overhead.direct_share({"window": 4, "step_s": [1.0] * 6}, 2) == {"direct": 0.0, "direct_by_cb": {}}


def test_bad_flags_are_one_line_errors():
    for args, needle in ((["--cells", "zero9:2"], "--cells entry 'zero9:2'"),
                         (["--variants", "none,grad_montor"], "--variants grad_montor unknown"),
                         (["--rounds", "0"], "--rounds=0"),
                         (["--cells", "zero2:1", "--variants", "none", "--override", "model.net.hidden_sze=3"],
                          "model.net.hidden_sze")):
        proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0, args
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr


@pytest.mark.slow
def _preset_checks(preset: str) -> dict[str, str]:
    """The checks a debug preset selects: config name -> class name (conf/debug/<preset>.yaml's defaults)."""
    import yaml

    conf = REPO / "conf"
    names = [d.split("/")[2].split("@")[0] for d in yaml.safe_load((conf / "debug" / f"{preset}.yaml").read_text())["defaults"]
             if isinstance(d, str) and d.startswith("/callbacks/")]
    return {n: yaml.safe_load((conf / "callbacks" / f"{n}.yaml").read_text())[n]["_target_"].rsplit(".", 1)[1]
            for n in names}


def test_small_cell_fits_each_variant_in_one_process_without_leaks(tmp_path, shared_cache):
    out = tmp_path / "bench"
    cmd = [sys.executable, str(SCRIPT), "--cells", "zero2:1", "--variants", "none,light", "--rounds", "2",
           "--warmup", "2", "--window", "3", "--prime", "0", "--out", str(out),
           "--override", "model.net.hidden_size=64", "--override", "model.net.num_hidden_layers=2",
           "--override", "data.max_tokens=60000"]
    env = {**__import__("os").environ, "DSDEBUG_CACHE_DIR": str(shared_cache)}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cell = json.loads((out / "zero2_x1" / "cell.json").read_text())
    assert [(f["round"], f["variant"]) for f in cell["fits"]] == [(0, "none"), (0, "light"), (1, "light"), (1, "none")]
    light = _preset_checks("light")  # name -> class, as conf/debug/light.yaml selects them
    debug = set(light.values())
    for fit in cell["fits"]:
        assert fit["window"] == (50 if fit["variant"] == "light" else 3)  # light's cadence is 50 steps
        assert len(fit["step_s"]) == 2 + fit["window"] and all(t > 0 for t in fit["step_s"])
        # CPU time of every rank (1 here) over the same steps: positive, at most wall x cores (+ slack)
        (cpu,) = fit["cpu_step_s"]
        assert len(cpu) == len(fit["step_s"]) and all(c > 0 for c in cpu)
        assert sum(cpu) <= sum(fit["step_s"]) * (__import__("os").cpu_count() or 1) + 0.05
        assert fit["leaked"] == {}, (fit["variant"], fit["leaked"])
        has = debug & set(fit["callbacks"])
        assert has == (debug if fit["variant"] == "light" else set()), (fit["variant"], fit["callbacks"])
        assert "PreemptionCheckpoint" in fit["callbacks"]  # the framework's own callbacks stay in every variant
        # the stopwatch wrapped exactly the debug callbacks, and their hooks ran during the steps
        timed = set(fit["hook_s"])
        assert timed == (set(light) if fit["variant"] == "light" else set()), timed
        if timed:
            assert all(sum(fit["hook_s"][cb][2:5]) > 0 for cb in ("grad_monitor", "data_inspector")), fit["hook_s"]
    results = json.loads((out / "overhead.json").read_text())
    rows = results["cells"]["zero2:1"]["summary"]
    assert set(rows) == {"none", "light"} and rows["light"]["rounds"] == 2
    assert rows["light"]["cpu_step_ms"] > 0 and rows["light"]["cpu_steady"] is not None
    assert results["machine"]["versions"]["deepspeed"]
    assert "| light |" in (out / "overhead.md").read_text()
    assert (out / "overhead.png").read_bytes()[:4] == b"\x89PNG"


def test_each_variant_window_holds_its_cadences_a_whole_number_of_times(tmp_path):
    def window(variant, base=20):
        cfg = harness.compose([*harness.QUIET, *overhead.variant_overrides(variant)], tmp_path)
        return overhead.cadence_window(cfg, base)
    assert window("none") == 20
    assert window("light") == 50          # grad_monitor / data_inspector / log_sync every 50 steps
    assert window("full") == 50           # replica_parity / mixed_precision every 50 steps, the rest every 1-10
    assert window("grad_monitor", base=25) == 30


def test_the_harness_fits_a_variant_in_process_as_train_py_builds_it(tmp_path, shared_cache, monkeypatch):
    """harness.fit (make bench, bench-comm, scaling, determinism): prepare -> build -> bind -> fit with the step
    timer; every check of debug=full built and run."""
    monkeypatch.setenv("DSDEBUG_CACHE_DIR", str(shared_cache))
    result = harness.fit(["model.net._target_=tests.planted.data.HealthyTinyLM", "trainer.max_steps=3", "debug=full"],
                         tmp_path / "run")
    assert len(result["step_s"]) == 3 and result["wall_s"] > 0
    assert {"ConsistencyCheck", "GradMonitor", "LayerHealth", "Preflight"} <= set(result["callbacks"]), result["callbacks"]
