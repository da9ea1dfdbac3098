"""What runs inside each rank of ``zero_memory.py`` (split from it): build, train, snapshot the
live storages and split them by the DeepSpeed structure that holds them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dsdebug.models.model_states import STRATEGIES
from dsdebug.models.model_states import storage_key as _storage_key
from dsdebug.models.model_states import structure_paths as _structure_paths
from zero_memory_report import CATEGORIES

SEQ_LEN = 64  # tokens per step: enough that every routed expert gets tokens (so has a grad)


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
    from dsdebug.trainer.strategy import skip_shm_comm_op

    skip_shm_comm_op()  # as train.py: DeepSpeed's CPU shm comm op (inference only) is neither built nor loaded,
    # so a first run on a fresh machine measures the same memory as later ones
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
