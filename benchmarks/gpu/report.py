"""results.md of ``gpu_check.py``: one table line per step, then what each step found."""

from __future__ import annotations

from typing import Any

# checks whose findings judge time: with runs side by side on one GPU (--jobs > 1) a finding of theirs
# may come from the sharing; such a line says how to confirm it
TIMING_CHECKS = ("throughput", "log_sync")


def _pct(x: Any) -> str:
    return f"{x:.1%}" if isinstance(x, (int, float)) else "-"


def _num(x: Any, fmt: str = "{:.0f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def _gib(x: Any) -> str:
    return f"{x / 2 ** 30:.2f} GiB" if isinstance(x, (int, float)) else "-"


def headline(name: str, step: dict) -> str:
    """The numbers of a step in one cell."""
    if step.get("status") == "skipped":
        return step.get("reason", "")
    if step.get("status") == "error":
        return step.get("error", "")
    if name == "env":
        v = step.get("versions", {})
        gpu = step.get("gpu") or "no GPU"
        return (f"{gpu}, driver {step.get('driver', '-')}, torch {v.get('torch')} (CUDA {step.get('torch_cuda')}, "
                f"NCCL {step.get('nccl', '-')}), deepspeed {v.get('deepspeed')}, lightning {v.get('lightning')}, "
                f"transformers {v.get('transformers')}")
    if name == "zero_bf16_full":
        return "; ".join(f"{n}: {r['result']}, {len(r['false_alarms'])} warning/error finding(s)"
                         for n, r in step.get("runs", {}).items())
    if name == "fp16":
        parts = []
        traj = step.get("trajectory")
        if isinstance(traj, dict):
            scale = [v for _, v in traj.get("loss_scale", [])]
            parts.append(f"loss scale {_num(scale[0]) if scale else '-'} -> {_num(scale[-1]) if scale else '-'}, "
                         f"{_num(traj.get('skipped_steps'))} skipped")
        else:
            parts.append(f"trajectory {traj}")
        ovf = step.get("overflow")
        parts.append(f"overflow named: {ovf.get('named')}" if isinstance(ovf, dict) else f"overflow {ovf}")
        nan = step.get("nan")
        if isinstance(nan, dict):
            parts.append(f"NaN named with module: {nan.get('named')} ({nan.get('precision')})")
        return "; ".join(parts)
    if name == "throughput":
        fw, raw, eager = step.get("framework", {}), step.get("raw", {}), step.get("framework_eager")
        return (f"framework {_num(fw.get('tokens_per_s'))} tok/s (MFU {_pct(fw.get('mfu'))}), raw "
                f"{_num(raw.get('tokens_per_s'))} tok/s (MFU {_pct(raw.get('mfu'))}), framework/raw "
                f"{_num(step.get('framework_over_raw'), '{:.3f}')} (fast paths on, model.compile=true)"
                + (f"; without compile {_num(eager.get('tokens_per_s'))} tok/s (MFU {_pct(eager.get('mfu'))})"
                   if eager else "") + f"; peak {_num(step.get('peak_tflops'))} TFLOP/s")
    if name == "memory":
        light = step.get("light", {})
        return (f"{step.get('kind')}: framework {_gib(light.get('peak_bytes'))}, raw {_gib(step.get('raw_cuda_peak_bytes'))}; "
                f"model states held/expected {_num(light.get('held_over_expected'), '{:.3f}')} ({light.get('code', '-')})")
    if name == "overhead":
        ms = step.get("step_ms", {})
        return (f"step ms none {_num(ms.get('none'), '{:.1f}')}, light {_num(ms.get('light'), '{:.1f}')}, full "
                f"{_num(ms.get('full'), '{:.1f}')}; light/none {_num(step.get('light_over_none'), '{:.3f}')}, "
                f"full/none {_num(step.get('full_over_none'), '{:.3f}')}")
    return ""


def markdown(results: dict[str, Any]) -> str:
    steps = results.get("steps", {})
    env = steps.get("env", {})
    settings = results.get("settings", {})
    lines = [f"# GPU check {'(dry run, CPU)' if settings.get('dry_run') else ''}".rstrip(), "",
             f"{results.get('date', '')}, commit {results.get('commit')}, {env.get('gpu') or 'no GPU'}, "
             f"{results.get('wall_s', '-')} s", "",
             "| step | status | numbers |", "|---|---|---|"]
    for name, step in steps.items():
        cell = headline(name, step).replace("|", "/")
        lines.append(f"| {name} | {step.get('status')} | {cell} |")
    lines += ["", "## Problems and false alarms", ""]
    any_problem = False
    for name, step in steps.items():
        for p in step.get("problems", []):
            lines.append(f"- {name}: {p}")
            any_problem = True
        if name == "zero_bf16_full":
            for run, r in step.get("runs", {}).items():
                for f in r.get("false_alarms", []):
                    shared = (" (timing, with runs side by side on the GPU: confirm with --only zero_bf16_full --jobs 1)"
                              if f.get("check") in TIMING_CHECKS and (settings.get("jobs") or 1) > 1 else "")
                    lines.append(f"- {run} step {f.get('step')}: {f.get('severity')} {f.get('check')}/{f.get('code')}: "
                                 f"{f.get('message')}{shared}")
                    any_problem = True
    if not any_problem:
        lines.append("none")
    lines += ["", "## Log lines that say 'warning' (not judged; read them for GPU-only noise)", ""]
    for name, run in results.get("runs", {}).items():
        for w in run.get("log_warnings", [])[:8]:
            lines.append(f"- {name}: `{w[:200]}`")
    tp = steps.get("throughput", {})
    if tp.get("model"):
        m = tp["model"]
        lines += ["", "## Throughput model", "",
                  f"{_num(m.get('params', 0) / 1e6)}M parameters ({_num(m.get('active', 0) / 1e6)}M active, "
                  f"embedding excluded), {m.get('batch_size')} x {m.get('seq_len')} tokens per step, "
                  f"{_num(m.get('flops_per_token', 0) / 1e9, '{:.2f}')} GFLOP/token; peak: {tp.get('peak_source')}; "
                  f"steps ({tp.get('warmup')}, {tp.get('warmup', 0) + tp.get('timed_steps', 0)}] timed"]
    return "\n".join(lines) + "\n"
