"""Where a training step's time goes, and what each fast path of the model changes (docs/gpu.md).

    python benchmarks/step_profile.py                          # CPU, the default tiny DeepSeek-V3, 8 x 128 tokens
    python benchmarks/step_profile.py --device cuda --model kit  # the GPU kit's 0.62B model, bf16, 8 x 2048
    python benchmarks/step_profile.py --variants reference,defaults --profile

One process walks the variants in ``VARIANTS`` (each switch added to the one before, the order they are
listed), each with a fresh net from the same seed: forward, loss (next-token CE + 0.01 x the MoE balance loss,
as ``CausalLMModule``), backward, AdamW step, timed per phase (``time.perf_counter`` after a device
synchronize: on a GPU the phases are serialised, so the sum is a little over a free-running step). Prints a
table per variant (median ms per phase over ``--steps`` after ``--warmup``), the peak memory where the device
has a counter (CUDA ``max_memory_allocated``), and with ``--profile`` the top operators of the first and last
variant (``torch.profiler``, self time). ``--out`` writes everything as JSON.

On CUDA the net's weights are bf16 and the optimizer steps them in place (what DeepSpeed's bf16 engine runs
on its fp32 copy is not reproduced: the kit's MFU step measures train.py itself, this script the model's
own kernels). Not a test: nothing is asserted; tests/models/test_fast_paths.py holds the equivalences.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# each variant adds one switch to the one before; "defaults" is what the project's config runs now
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("reference", {"attn": "sdpa", "cross_entropy": "full", "fused": False, "compile": False}),
    ("+sdpa_pad_v", {"attn": "sdpa_pad_v"}),
    ("+chunked_ce", {"cross_entropy": "chunked"}),
    ("defaults", {"fused": True}),  # + torch's fused AdamW: the project's defaults
    ("+compile", {"compile": True}),
]
TINY = dict(max_position_embeddings=128)  # conf/model/deepseek_v3_tiny.yaml at data.seq_len=128
KIT = dict(hidden_size=1280, num_hidden_layers=16, num_attention_heads=10, intermediate_size=3584,
           moe_intermediate_size=896, kv_lora_rank=384, q_lora_rank=640, qk_rope_head_dim=64, qk_nope_head_dim=64,
           v_head_dim=64, vocab_size=32768, max_position_embeddings=2048)  # benchmarks/gpu_check.py BIG_MODEL
PHASES = ("forward", "loss", "backward", "optimizer")


def run_variant(name: str, switches: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from dsdebug.models.compile_blocks import compile_blocks
    from dsdebug.models.deepseek import build_deepseek_v3
    from dsdebug.models.lm_loss import next_token_loss
    from dsdebug.models.moe_aux import RouterCapture
    from dsdebug.models.moe_loss import load_balancing_loss
    from dsdebug.models.optim import param_groups

    device = torch.device(args.device)
    torch.manual_seed(0)
    kwargs = KIT if args.model == "kit" else TINY
    with torch.device(device):  # initialised where it runs (the kit model's 0.62B on a CPU: seconds per variant)
        net = build_deepseek_v3(**kwargs, attn_implementation=switches["attn"])
    if device.type == "cuda":
        net = net.to(torch.bfloat16)
    capture = RouterCapture(net).attach()
    compile_blocks(net, switches["compile"])
    opt = torch.optim.AdamW(param_groups(net.named_parameters()), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=switches["fused"] or None)  # None: torch's default (before)
    vocab = net.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    rows: list[dict[str, float]] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        t0 = sync()
        logits = net(input_ids=ids).logits
        t1 = sync()
        aux = load_balancing_loss(capture.collect(), capture.num_experts, capture.top_k)
        loss = next_token_loss(logits, ids, switches["cross_entropy"]) + 0.01 * aux
        t2 = sync()
        loss.backward()
        t3 = sync()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = sync()
        del logits, loss, aux
        if step >= args.warmup:
            rows.append(dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3))))
    out: dict[str, Any] = {"variant": name, "switches": switches,
                           "ms": {p: 1000 * statistics.median(r[p] for r in rows) for p in PHASES}}
    out["ms"]["step"] = 1000 * statistics.median(sum(r.values()) for r in rows)
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    if args.profile and name in (args.variants[0], args.variants[-1]):
        out["top_ops"] = top_ops(net, capture, opt, ids, switches, device)
    return out


def top_ops(net: Any, capture: Any, opt: Any, ids: Any, switches: dict[str, Any], device: Any,
            limit: int = 15) -> list[dict[str, Any]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dsdebug.models.lm_loss import next_token_loss
    from dsdebug.models.moe_loss import load_balancing_loss

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            logits = net(input_ids=ids).logits
            aux = load_balancing_loss(capture.collect(), capture.num_experts, capture.top_k)
            (next_token_loss(logits, ids, switches["cross_entropy"]) + 0.01 * aux).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:limit]
    total = sum(getattr(e, key) for e in prof.key_averages())
    return [{"op": e.key, "calls": e.count // 3, "ms_per_step": getattr(e, key) / 3000,
             "share": getattr(e, key) / total if total else None} for e in events]


def markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    peak = any("peak_gib" in r for r in results)
    head = "| variant | " + " | ".join(PHASES) + " | step ms | vs reference |" + (" peak GiB |" if peak else "")
    lines = [head, "|" + "---|" * (len(PHASES) + 3 + peak)]
    base = results[0]["ms"]["step"]
    for r in results:
        ms = r["ms"]
        cells = " | ".join(f"{ms[p]:.1f}" for p in PHASES)
        lines.append(f"| {r['variant']} | {cells} | {ms['step']:.1f} | {ms['step'] / base:.2f} |"
                     + (f" {r['peak_gib']:.2f} |" if peak else ""))
    for r in results:
        if r.get("top_ops"):
            lines += ["", f"Top ops, {r['variant']} (self {'device' if args.device == 'cuda' else 'CPU'} time, per step):",
                      "", "| op | calls | ms | share |", "|---|---|---|---|"]
            lines += [f"| {o['op'][:70]} | {o['calls']} | {o['ms_per_step']:.1f} | {100 * (o['share'] or 0):.1f} % |"
                      for o in r["top_ops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="step_profile.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default="tiny", choices=("tiny", "kit"), help="tiny: the default model; kit: "
                   "gpu_check.py's 0.62B BIG_MODEL")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None, help="default 128 (tiny), 2048 (kit)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", default=",".join(n for n, _ in VARIANTS))
    p.add_argument("--profile", action="store_true", help="top operators of the first and last variant")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.seq = args.seq or (2048 if args.model == "kit" else 128)
    known = [n for n, _ in VARIANTS]
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in known]
    if bad or not args.variants:
        p.error(f"--variants {bad[0] if bad else repr('')}: valid: {', '.join(known)}")
    os.environ.setdefault("DS_ACCELERATOR", args.device)
    import torch

    results, switches = [], {}
    for name, change in VARIANTS:
        switches = {**switches, **change}
        if name in args.variants:
            results.append(run_variant(name, dict(switches), args))
            print(f"{name}: {results[-1]['ms']['step']:.1f} ms/step", flush=True)
    header = (f"{time.strftime('%Y-%m-%d')}, {args.device}"
              f"{' ' + torch.cuda.get_device_name(0) if args.device == 'cuda' else ''}, torch {torch.__version__}, "
              f"{args.model} model, {args.batch} x {args.seq} tokens, threads {torch.get_num_threads()}, "
              f"load {os.getloadavg()[0]:.1f}, median of {args.steps} steps after {args.warmup}")
    print(header)
    print(markdown(results, args))
    if args.out:
        Path(args.out).write_text(json.dumps({"header": header, "results": results}, indent=1))


if __name__ == "__main__":
    main()
