"""Model-state bytes per rank under DDP and ZeRO-1/2/3 (+ offload), measured vs the ZeRO paper.

What it does: builds the framework's DeepSeek-V3 (``dsdebug.models.deepseek.build_deepseek_v3``),
wraps it with ``deepspeed.initialize`` (no Lightning: this is about DeepSpeed's partitioning),
trains ``--steps`` optimizer steps on 1 or N real CPU processes (gloo, ``DS_ACCELERATOR=cpu``),
then, after one more backward and before its optimizer step (params, grads and Adam states all
live), sums the bytes of every live tensor storage on each rank (``gc`` walk, deduplicated by
storage pointer, minus a baseline taken before the model was built) and splits them by the
DeepSpeed structure that holds them:

| category | what | e.g. |
|---|---|---|
| params | low-precision weights (module params, ZeRO-3 ``ds_tensor`` partitions) | ``bit16_groups_flat`` |
| grads | gradient storage (module ``.grad``, partition buffers, fp32 grads of the master) | ``averaged_gradients`` |
| master | fp32 master weights (the params the inner optimizer updates) | ``single_partition_of_fp32_groups`` |
| adam | optimizer moments (``exp_avg``, ``exp_avg_sq``) | ``basic_optimizer.state`` |
| buffers | other tensors DeepSpeed holds: reduce buckets, offload staging copies | ``ipg_buckets`` |
| unreached | live but not reachable from the engine (activation leftovers, temporaries) | |

It also takes the same snapshot at the end of autograd, just before DeepSpeed's gradient
reduction (``engine.allreduce_gradients``): ZeRO-1 holds full gradients only until then.

"ddp" is DeepSpeed ZeRO stage 0 (same bf16 mixed-precision optimizer path as the ZeRO stages:
bf16 weights/grads, fp32 master copy, Adam), not torch DDP. Offload: on a CPU box the
accelerator *is* RAM, so "offloaded" bytes are those held by the structures DeepSpeed puts on
the offload device (fp32 master, Adam, fp32 grads, bf16 staging copies; with param offload the
bf16 partitions too); the rest would sit on the accelerator.

Usage::

    python benchmarks/zero_memory.py                       # both sizes, 1 and 2 ranks, all strategies
    python benchmarks/zero_memory.py --sizes tiny --ranks 2 --strategies zero1,zero3 --steps 3
    python benchmarks/zero_memory.py --dtype fp32 --out logs/bench/zero_memory_fp32

Writes ``results.json``, ``results.md`` (also printed) and ``zero_memory.png`` under ``--out``
(default ``logs/bench/zero_memory``), and per-rank logs under ``--out``/logs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The formula and the structure walk live in src (the memory check uses them on live runs).
from dsdebug.models.model_states import DTYPES, STRATEGIES, paper_bytes  # noqa: E402
from dsdebug.models.model_states import storage_key as _storage_key  # noqa: E402
from dsdebug.models.model_states import structure_paths as _structure_paths  # noqa: E402

# Model sizes: kwargs for build_deepseek_v3. "large" is ~5x the default tiny model (8.7M).
SIZES = {
    "tiny": {},
    "large": {"hidden_size": 512, "num_hidden_layers": 8, "moe_intermediate_size": 384},
}
CATEGORIES = ("params", "grads", "master", "adam", "buffers", "unreached")
SEQ_LEN = 64  # tokens per step: enough that every routed expert gets tokens (so has a grad)


# ---------------------------------------------------------------------------------------------
# Measurement (runs inside each rank)
# ---------------------------------------------------------------------------------------------

def _live_storages() -> dict[int, int]:
    """data_ptr -> nbytes of every live tensor storage (meta and empty storages skipped)."""
    import gc

    import torch

    gc.collect()
    out: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.is_meta:
                continue
            storage = obj.untyped_storage()
            if storage.nbytes():
                out[storage.data_ptr()] = storage.nbytes()
        except Exception:  # half-built or exotic objects: not model state
            continue
    return out


def _categories(engine) -> dict[int, str]:
    """storage -> category, from the objects' roles (not their names) where DeepSpeed exposes them."""
    cat: dict[int, str] = {}

    def put(t, name):
        key = _storage_key(t)
        if key is not None:
            cat.setdefault(key, name)

    params = list(engine.module.parameters())
    for p in params:
        put(p, "params")
        put(getattr(p, "ds_tensor", None), "params")
    for p in params:
        put(p.grad, "grads")
    basic = engine.basic_optimizer
    for state in basic.state.values():
        for value in state.values():
            if hasattr(value, "untyped_storage"):
                put(value, "adam")
    for group in basic.param_groups:
        for p in group["params"]:
            put(p, "master")
            put(p.grad, "grads")
    return cat


def _offloaded(path: str, spec: dict) -> bool:
    """Would this DeepSpeed structure sit on the offload device (host) rather than the accelerator?"""
    host = ()
    if spec.get("offload_optimizer"):
        host += ("basic_optimizer", "fp32", "cpu_offload", "grad_partitions_flat_buffer", "norm_for_param_grads",
                 "accumulated_grads_in_cpu")
    if spec.get("offload_param"):
        host += ("fp16_partitioned_groups_flat", "ds_tensor", "lp_param_buffer")
    return any(word in path for word in host) and "gpu_offload" not in path


def _role_from_name(path: str) -> str:
    """Category of a storage no role claimed, from DeepSpeed's attribute name."""
    if "grad" in path and "temp_grad" not in path:
        return "grads"  # partition buffers, fp32 grads of the master, CPU-offload accumulators
    if "fp32" in path:
        return "master"  # e.g. ZeRO-3 fp32_partitioned_groups_flat between sub-group steps
    return "buffers"  # reduce buckets, offload staging copies, module buffers


def _snapshot(engine, spec: dict, base_total: int) -> dict:
    roots = [("optimizer", engine.optimizer), ("basic_optimizer", engine.basic_optimizer),
             ("module", engine.module), ("engine", engine)]
    # The engine walk first: it also sees tensors only C++ held so far (e.g. a .grad autograd
    # accumulated that no Python code touched yet), which a gc walk cannot.
    paths = _structure_paths(roots)
    role = _categories(engine)
    live = {**_live_storages(), **{key: nbytes for key, (_, nbytes) in paths.items()}}
    total = sum(live.values()) - base_total
    by_cat = dict.fromkeys(CATEGORIES, 0)
    by_structure: dict[str, int] = {}
    offloaded = 0
    for key, (path, nbytes) in paths.items():
        name = role.get(key) or _role_from_name(path)
        by_cat[name] += nbytes
        label = f"{name}: {path}"
        by_structure[label] = by_structure.get(label, 0) + nbytes
        offloaded += nbytes if _offloaded(path, spec) else 0
    by_cat["unreached"] = total - sum(by_cat.values())
    return {"total": total, "categories": by_cat, "offloaded": offloaded, "accelerator": total - offloaded,
            "structures": dict(sorted(by_structure.items(), key=lambda kv: -kv[1]))}


def _ds_config(spec: dict, hidden: int, dtype: str) -> dict:
    bucket = hidden * hidden  # the framework's "auto" bucket rule (src/config/ds_config.py)
    zero = {"stage": spec["stage"], "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket,
            # 0 so ZeRO-3 partitions every param; DeepSpeed's default (1e5 elements) keeps small
            # params whole on every rank, which for these models is most of them.
            "stage3_param_persistence_threshold": 0}
    if spec.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if spec.get("offload_param"):
        zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def measure(strategy: str, model_kwargs: dict, steps: int, dtype: str = "bf16") -> dict:
    """Train ``steps`` steps, then snapshot after the next backward; runs on every rank (collectives)."""
    import gc

    import deepspeed
    import torch

    from dsdebug.models.deepseek import build_deepseek_v3

    spec = STRATEGIES[strategy]
    torch.manual_seed(0)
    vocab = model_kwargs.get("vocab_size", 4096)
    batch = torch.randint(0, vocab, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    gc.collect()
    base_total = sum(_live_storages().values())
    model = build_deepseek_v3(**model_kwargs)
    psi = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    if spec.get("offload_optimizer"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config_hidden = model.config.hidden_size
    config = _ds_config(spec, config_hidden, dtype)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    del model, optimizer
    snapshots: dict[str, dict] = {}
    reduce_gradients = engine.allreduce_gradients
    capture = False

    def snapshot_then_reduce(*args, **kwargs):
        if capture:
            snapshots["end_of_backward"] = _snapshot(engine, spec, base_total)
        return reduce_gradients(*args, **kwargs)

    engine.allreduce_gradients = snapshot_then_reduce
    losses = []
    t0 = time.perf_counter()
    for step in range(steps + 1):
        capture = step == steps
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        losses.append(loss.item())
        del loss
        if capture:
            snapshots["before_step"] = _snapshot(engine, spec, base_total)
        engine.step()
    seconds = time.perf_counter() - t0
    engine.destroy()
    del engine, reduce_gradients, snapshot_then_reduce
    gc.collect()
    return {"strategy": strategy, "psi": psi, "largest_param": largest, "hidden_size": config_hidden,
            "losses": losses, "seconds": round(seconds, 2), **snapshots}


def _worker(spec_json: str) -> None:
    """One rank: init the process group once, measure each strategy in turn, write JSON."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    job = json.loads(spec_json)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    print(f"[rank {rank}] import + init_distributed: {time.perf_counter() - t0:.1f} s", flush=True)
    results = []
    for strategy in job["strategies"]:
        t0 = time.perf_counter()
        results.append(measure(strategy, job["model_kwargs"], job["steps"], job["dtype"]))
        print(f"[rank {rank}] {strategy}: {time.perf_counter() - t0:.1f} s (steps {results[-1]['seconds']} s)", flush=True)
    Path(job["result"].format(rank=rank)).write_text(json.dumps(results))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Launching ranks (parent process)
# ---------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(size: str, model_kwargs: dict, n: int, strategies: list[str], steps: int, dtype: str,
              out: Path, timeout: float) -> list[list[dict]]:
    """Launch ``n`` ranks as subprocesses; returns per-rank result lists. Kills every rank on error."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tag = f"{size}_n{n}"
    result = str(logs / f"{tag}_rank{{rank}}.json")
    job = json.dumps({"model_kwargs": model_kwargs, "steps": steps, "dtype": dtype,
                      "strategies": strategies, "result": result})
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(n), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for rank in range(n):
            log = open(logs / f"{tag}_rank{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--_worker", job], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, start_new_session=True))
            log.close()
        deadline = time.time() + timeout
        while any(p.poll() is None for p in procs) or any(p.returncode for p in procs):
            failed = [f"rank {r} exited {p.returncode}" for r, p in enumerate(procs) if p.returncode]
            if failed or time.time() > deadline:  # a dead rank leaves the others hanging in a collective
                time.sleep(0.5)  # let a rank that fails because of another one report too
                failed = [f"rank {r} exited {p.poll()}" for r, p in enumerate(procs) if p.poll()]
                why = ", ".join(failed) if failed else f"timed out after {timeout:.0f} s"
                raise RuntimeError(f"{tag}: {why}; see {logs}/{tag}_rank*.log")
            time.sleep(0.2)
        return [json.loads(Path(result.format(rank=r)).read_text()) for r in range(n)]
    finally:
        for p in procs:  # only our own ranks, each in its own session
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run_benchmark(sizes: dict[str, dict], ranks: list[int], strategies: list[str], steps: int, out: Path,
                  dtype: str = "bf16", timeout: float = 300) -> list[dict]:
    """Measure every (size, ranks, strategy); returns one record per combination (worst rank + all ranks)."""
    param_b, grad_b, k = DTYPES[dtype]
    records = []
    for size, kwargs in sizes.items():
        for n in ranks:
            t0 = time.time()
            per_rank = run_group(size, kwargs, n, strategies, steps, dtype, out, timeout)
            print(f"  {size} x {n} rank(s): {time.time() - t0:.0f} s", file=sys.stderr)
            for i, strategy in enumerate(strategies):
                ranks_ = [per_rank[r][i] for r in range(n)]
                worst = max(ranks_, key=lambda m: m["before_step"]["total"])
                psi = worst["psi"]
                records.append({
                    "size": size, "model_kwargs": kwargs, "psi": psi, "largest_param": worst["largest_param"],
                    "hidden_size": worst["hidden_size"], "ranks": n, "strategy": strategy,
                    "dtype": dtype, "measured": worst["before_step"], "end_of_backward": worst["end_of_backward"],
                    "formula": paper_bytes(strategy, psi, n, param_b, grad_b, k),
                    "per_rank_total": [m["before_step"]["total"] for m in ranks_],
                    "per_rank_end_of_backward": [m["end_of_backward"]["total"] for m in ranks_],
                    "losses": worst["losses"], "seconds": worst["seconds"]})
                records[-1]["residual"] = residual(records[-1])
    return records


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


# Why a DeepSpeed structure makes the measurement differ from the paper (matched on the path).
WHY = {
    "averaged_gradients": "the stage-1/2 gradient partition is sized to the whole params that intersect "
                          "the rank's partition: a param straddling the boundary is held whole on both ranks",
    "[].grad": "fp32 gradients of the master partition (the paper counts the gradient once, "
                      "in the params' dtype)",
    "single_partition_of_fp32_groups": "fp32 master partition, kept even when the params are fp32 "
                                       "(the fp32 formula has no master copy)",
    "fp32_partitioned_groups_flat": "fp32 master partition, kept even when the params are fp32 "
                                    "(the fp32 formula has no master copy)",
    "grad_partitions_flat_buffer": "gradient partition in the params' dtype",
    "param_buffer_of_bit16_for_cpu_offload": "staging copy of the param partition (host -> device after the CPU step)",
    "temp_grad_buffer": "grad staging buffer the size of the largest param",
    "ipg_buckets": "reduce bucket (reduce_bucket_size elements)",
}


def residual(r: dict) -> dict:
    """measured - formula per paper term, bytes (other = buffers + unreached, which the paper omits)."""
    c, f = r["measured"]["categories"], r["formula"]
    return {"params": c["params"] - f["params"], "grads": c["grads"] - f["grads"],
            "optimizer": c["master"] + c["adam"] - f["optimizer"], "other": c["buffers"] + c["unreached"]}


def _explain(r: dict) -> str | None:
    f_total = r["formula"]["total"]
    parts = []
    for term, excess in residual(r).items():
        if abs(excess) < 0.005 * f_total:
            continue
        cats = {"params": ("params",), "grads": ("grads",), "optimizer": ("master", "adam"),
                "other": ("buffers", "unreached")}[term]
        why = []
        for label, nbytes in r["measured"]["structures"].items():
            cat, path = label.split(": ", 1)
            reason = next((text for key, text in WHY.items() if key in path), None)
            if cat in cats and reason and nbytes >= 0.005 * f_total:
                why.append(f"`{path}` {_mib(nbytes)} MiB: {reason}")
        if term == "grads" and excess < 0 and STRATEGIES[r["strategy"]]["stage"] == 1:
            why.insert(0, "DeepSpeed's ZeRO-1 has already reduced the gradients into a partition (see notes)")
        if term == "other" and r["measured"]["categories"]["unreached"] >= 0.005 * f_total:
            why.append(f"unreached {_mib(r['measured']['categories']['unreached'])} MiB")
        parts.append(f"{term} {excess / 2**20:+.1f} MiB" + (f" ({'; '.join(why)})" if why else ""))
    if not parts:
        return None
    return f"- {r['size']} N={r['ranks']} {r['strategy']} ({r['measured']['total'] / f_total:.3f}x): " + "; ".join(parts)


NOTES = """Notes (what the table shows, and why it differs from the paper):
- Measured = bytes of live tensor storages per rank (gc walk + a walk of the DeepSpeed engine, deduplicated by
  storage, minus a baseline taken before the model was built), after the backward of step {last} and before its
  optimizer step. Category = the role of the structure holding the storage. "unreached" = live storages the
  engine walk cannot reach (temporaries, leftovers of an earlier strategy in the same process).
- `autograd end` = the same snapshot taken when autograd finishes, just before DeepSpeed reduces the gradients
  (`engine.allreduce_gradients`); `peak/formula` uses the larger of the two snapshots.
- ZeRO-1 in DeepSpeed {ds}: the full bf16 gradients exist only until the end of `engine.backward`, which
  reduces them into a gradient partition and frees them. Before the step ZeRO-1 therefore holds what the
  paper's ZeRO-2 holds (same bytes as zero2); at the end of autograd it holds the paper's ZeRO-1 (see
  `grads@autograd end`). With gradient accumulation the full gradients live across micro-batches.
- At the end of autograd ZeRO-2/3 still hold the gradient of the last param not yet reduced (here the
  largest one, the embedding, which is reduced on its own because it exceeds the bucket) and ZeRO-3 still
  holds that param gathered. ZeRO-3's other gathered params during forward/backward (its working set) and
  activations are transient and not model states; they are not measured.
- ddp = DeepSpeed stage 0 with bf16 (FP16_UnfusedOptimizer: bf16 params and grads, fp32 master copy, Adam):
  exactly 16 bytes/param. torch DDP with autocast would hold fp32 params/grads instead (4+4+8, same total).
- ZeRO-3 runs with `stage3_param_persistence_threshold: 0` so every param is partitioned; DeepSpeed's default
  (1e5 elements) keeps small params whole on every rank, which for these models is most params.
- Bucket sizes are `hidden_size**2` elements (the framework's "auto" rule). ZeRO-3's reduce bucket is allocated
  at full size up front: DeepSpeed's default 5e8 elements would add 1 GB (bf16) per rank to `buffers`.
- Offload (the box has no accelerator, so everything is RAM): "offloaded" = bytes in the structures DeepSpeed
  places on the offload device (fp32 master and grads, Adam moments, bf16 staging copies, and with
  `offload_param` the bf16 param partition); the formula column splits the paper's total the ZeRO-Offload way
  (optimizer states and gradient partition on the host, and the params with param offload). DeepSpeed keeps
  the host gradients in fp32 (4 bytes/param instead of 2) plus bf16 staging copies, hence ~1.25x.
"""


def markdown(records: list[dict], meta: dict) -> str:
    lines = [
        f"# ZeRO model-state memory per rank ({meta['dtype']}, measured vs Rajbhandari et al. 2020)",
        "",
        f"{meta['date']}, {meta['machine']}; torch {meta['torch']}, deepspeed {meta['deepspeed']}; "
        f"{meta['steps']} optimizer steps, measured in the step after; wall time {meta['wall_s']:.0f} s.",
        f"MiB per rank (the rank with the most). formula: the paper's, K={DTYPES[meta['dtype']][2]}; "
        "master+adam is its K*Psi term. ddp = DeepSpeed ZeRO stage 0.",
        "",
        "| size | Psi | N | strategy | params | grads | master+adam | other | before step | autograd end "
        "| formula | before/formula | peak/formula | grads@autograd end | accelerator / offloaded (formula) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        c, f, end = r["measured"]["categories"], r["formula"], r["end_of_backward"]
        peak = max(r["measured"]["total"], end["total"])
        m = r["measured"]
        offl = (f"{_mib(m['accelerator'])} / {_mib(m['offloaded'])} ({_mib(f['accelerator'])} / {_mib(f['offloaded'])})"
                if STRATEGIES[r["strategy"]].get("offload_optimizer") else "-")
        lines.append(
            f"| {r['size']} | {r['psi'] / 1e6:.1f}M | {r['ranks']} | {r['strategy']} | {_mib(c['params'])} "
            f"| {_mib(c['grads'])} | {_mib(c['master'] + c['adam'])} | {_mib(c['buffers'] + c['unreached'])} "
            f"| {_mib(r['measured']['total'])} | {_mib(end['total'])} | {_mib(f['total'])} "
            f"| {r['measured']['total'] / f['total']:.3f} | {peak / f['total']:.3f} "
            f"| {_mib(end['categories']['grads'])} | {offl} |")
    explained = [line for line in map(_explain, records) if line]
    if explained:
        lines += ["", "Residuals (before step, measured - formula, > 0.5% of the formula):", "", *explained]
    lines += ["", NOTES.format(last=meta["steps"] + 1, ds=meta["deepspeed"])]
    if meta["dtype"] == "fp32":
        lines.append("- fp32: the formula is 4+4+8 bytes/param (no master copy). ZeRO-1/2/3 still keep a separate "
                     "fp32 master partition (+4 bytes/param/N); stage 0 updates the params in place.")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sizes = list(dict.fromkeys(r["size"] for r in records))
    fig = Figure(figsize=(6.5 * len(sizes), 4.2), dpi=100)
    FigureCanvasAgg(fig)
    colors = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#8c8c8c", "#c44e52", "#e0e0e0")))
    for i, size in enumerate(sizes):
        ax = fig.add_subplot(1, len(sizes), i + 1)
        rows = [r for r in records if r["size"] == size]
        strategies = list(dict.fromkeys(r["strategy"] for r in rows))
        ranks = list(dict.fromkeys(r["ranks"] for r in rows))
        width = 0.8 / len(strategies)
        for g, n in enumerate(ranks):
            for s, strategy in enumerate(strategies):
                r = next((r for r in rows if r["ranks"] == n and r["strategy"] == strategy), None)
                if r is None:
                    continue
                x, bottom = g + (s - (len(strategies) - 1) / 2) * width, 0.0
                for cat in CATEGORIES:
                    v = max(r["measured"]["categories"][cat], 0) / 2**20
                    ax.bar(x, v, width * 0.9, bottom=bottom, color=colors[cat],
                           label=cat if (g, s) == (0, 0) else None)
                    bottom += v
                ax.plot([x - width * 0.45, x + width * 0.45], [r["formula"]["total"] / 2**20] * 2, color="black", lw=2,
                        label="paper formula" if (g, s) == (0, 0) else None)
                ax.plot(x, r["end_of_backward"]["total"] / 2**20, "o", color="black", ms=3,
                        label="total at autograd end" if (g, s) == (0, 0) else None)
                top = max(bottom, r["formula"]["total"] / 2**20, r["end_of_backward"]["total"] / 2**20)
                ax.text(x, top * 1.02, strategy, rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(ranks)), [f"N={n} rank(s)" for n in ranks])
        ax.set_ylabel("model-state MiB per rank")
        ax.set_title(f"{size} ({rows[0]['psi'] / 1e6:.1f}M params)")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
        if i == 0:
            fig.legend(fontsize=8, loc="lower center", ncol=len(CATEGORIES) + 2, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, non-zero exit
        self.exit(2, f"error: {message}\n")


def _choices(valid):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or repr(text)} is not valid; valid: {', '.join(valid)}")
        return list(dict.fromkeys(items))
    return parse


def _ranks(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 or v > 8 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; give comma-separated integers 1..8, e.g. 1,2")
    return sorted(set(values))


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; give an integer >= 1")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        _worker(argv[1])
        return 0
    parser = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=_choices(list(SIZES)), default=list(SIZES),
                        help=f"comma-separated model sizes ({', '.join(SIZES)}; default all)")
    parser.add_argument("--ranks", type=_ranks, default=[1, 2], help="comma-separated rank counts (default 1,2)")
    parser.add_argument("--strategies", type=_choices(list(STRATEGIES)), default=list(STRATEGIES),
                        help=f"comma-separated ({', '.join(STRATEGIES)}; default all)")
    parser.add_argument("--steps", type=_positive, default=2, help="optimizer steps before measuring (default 2)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="bf16 (paper setting) or fp32")
    parser.add_argument("--timeout", type=_positive, default=300, help="seconds per launch of N ranks (default 300)")
    parser.add_argument("--out", type=Path, default=REPO / "logs" / "bench" / "zero_memory", help="output directory")
    args = parser.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: cannot create directory ({e.strerror})")

    from importlib.metadata import version

    t0 = time.time()
    try:
        records = run_benchmark({s: SIZES[s] for s in args.sizes}, args.ranks, args.strategies, args.steps,
                                args.out, args.dtype, args.timeout)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    meta = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "steps": args.steps, "dtype": args.dtype,
            "machine": f"{_cpu_name()}, {os.cpu_count()} cores",
            "torch": version("torch"), "deepspeed": version("deepspeed"), "wall_s": time.time() - t0}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    table = markdown(records, meta)
    (args.out / "results.md").write_text(table)
    plot(records, args.out / "zero_memory.png")
    print(table)
    print(f"wrote {args.out}/results.json, results.md, zero_memory.png ({meta['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
