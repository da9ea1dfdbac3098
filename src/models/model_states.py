"""Model-state bytes per rank: the ZeRO paper's formula, and what a rank actually holds.

Shared by ``benchmarks/zero_memory.py`` (which measures every stage on 1 and N processes) and
the ``memory`` check (``src/callbacks/memory.py``, which compares a live run with the formula).

Rajbhandari et al. 2020 (mixed-precision Adam): 2 bytes/param of low-precision weights, 2 of
gradients and K=12 of optimizer state (fp32 master + two moments). Per rank with N ranks:
DDP (2+2+K)Psi; ZeRO-1 2Psi+2Psi+KPsi/N; ZeRO-2 2Psi+(2+K)Psi/N; ZeRO-3 (2+2+K)Psi/N.
"""

from __future__ import annotations

import collections
import re
from typing import Any

__all__ = ["DTYPES", "STRATEGIES", "bytes_per_param", "held_bytes", "layout_of", "paper_bytes", "storage_key",
           "structure_paths"]

# Layouts: ZeRO stage and offload. "ddp" is stage 0 (every rank holds everything).
STRATEGIES = {
    "ddp": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_param": True},
}
# Bytes per parameter: low-precision params, grads, and K (optimizer states incl. fp32 master).
DTYPES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}


def paper_bytes(strategy: str, psi: int, n: int, param_b: int = 2, grad_b: int = 2, k: int = 12) -> dict:
    """Model-state bytes per rank from Rajbhandari et al. 2020 (mixed-precision Adam: 2, 2, K=12).

    DDP (2+2+K)Psi; ZeRO-1 2Psi+2Psi+KPsi/N; ZeRO-2 2Psi+(2+K)Psi/N; ZeRO-3 (2+2+K)Psi/N.
    Offload variants keep their stage's total and split it as ZeRO-Offload does: the fp32
    optimizer states and the gradient partition go to the host (and, with param offload, the
    parameter partition too); ``accelerator`` is what stays on the device.
    """
    if strategy not in STRATEGIES or n < 1 or psi < 0:
        raise ValueError(f"paper_bytes({strategy!r}, psi={psi}, n={n}): strategy must be one of "
                         f"{', '.join(STRATEGIES)}, n >= 1, psi >= 0")
    stage = STRATEGIES[strategy]["stage"]
    params = param_b * psi / (n if stage >= 3 else 1)
    grads = grad_b * psi / (n if stage >= 2 else 1)
    optim = k * psi / (n if stage >= 1 else 1)
    total = params + grads + optim
    offloaded = 0.0
    if STRATEGIES[strategy].get("offload_optimizer"):
        offloaded += optim + grads
    if STRATEGIES[strategy].get("offload_param"):
        offloaded += params
    return {"params": params, "grads": grads, "optimizer": optim, "total": total,
            "offloaded": offloaded, "accelerator": total - offloaded}


def layout_of(strategy: Any) -> tuple[str, int]:
    """(STRATEGIES key, ZeRO stage) of a live Lightning strategy (DeepSpeed ZeRO stage, else ddp)."""
    config = getattr(strategy, "config", None)
    if not hasattr(strategy, "deepspeed_engine") or not isinstance(config, dict):
        return "ddp", 0
    zero = config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0) or 0)
    name = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[stage]
    offload = lambda key: ((zero.get(key) or {}).get("device") or "none") != "none"  # noqa: E731
    if stage == 2 and offload("offload_optimizer"):
        name = "zero2_offload"
    elif stage == 3 and (offload("offload_optimizer") or offload("offload_param")):
        name = "zero3_offload"
    return name, stage


def bytes_per_param(strategy: Any, module: Any) -> tuple[int, int, int]:
    """(param, grad, K) bytes for the paper formula: bf16/fp16 mixed precision -> 2, 2, 12; fp32 -> 4, 4, 8."""
    config = getattr(strategy, "config", None)
    if hasattr(strategy, "deepspeed_engine") and isinstance(config, dict):
        half = any((config.get(key) or {}).get("enabled") for key in ("bf16", "fp16"))
        return DTYPES["bf16" if half else "fp32"]
    precision = str(getattr(getattr(strategy, "precision_plugin", None), "precision", "32-true"))
    # without DeepSpeed: *-mixed keeps fp32 weights (autocast); *-true half keeps Adam states in half too
    return (2, 2, 4) if precision in ("bf16-true", "16-true") else DTYPES["fp32"]


# ---- what a rank holds: a walk of the engine / optimizer / module -----------------------------

def storage_key(t: Any) -> int | None:
    if t is None or getattr(t, "is_meta", True):
        return None
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def structure_paths(roots: list[tuple[str, object]], max_depth: int = 8) -> dict[int, tuple[str, int]]:
    """storage -> (shortest attribute path from the roots, breadth first, indices stripped; nbytes)."""
    import torch

    walkable = ("deepspeed", "torch", "transformers", "dsdebug")  # not lightning: the Trainer reaches the data
    paths: dict[int, tuple[str, int]] = {}
    seen: set[int] = set()
    queue = collections.deque((obj, name, 0) for name, obj in roots)
    while queue:
        obj, path, depth = queue.popleft()
        if id(obj) in seen or depth > max_depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key = storage_key(obj)
            if key is not None and key not in paths:
                paths[key] = (re.sub(r"\[[^\]]*\]", "[]", path), obj.untyped_storage().nbytes())
            if obj.is_leaf and obj.grad is not None:
                queue.append((obj.grad, path + ".grad", depth + 1))
            children = vars(obj).items() if hasattr(obj, "__dict__") else ()
        elif isinstance(obj, dict):
            children = ((f"[{k}]" if isinstance(k, (str, int)) else "[]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set)):
            children = ((f"[{i}]", v) for i, v in enumerate(obj))
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in walkable:
            children = vars(obj).items()
        else:
            continue
        for name, child in children:
            sep = "" if str(name).startswith("[") else "."
            queue.append((child, f"{path}{sep}{name}", depth + 1))
    return paths


def held_bytes(strategy: Any, module: Any, optimizers: list) -> dict:
    """Bytes of every tensor storage this rank's model states hold (params, grads, optimizer states,
    DeepSpeed's partitions and buffers), each storage once. Local: no collective.

    Under DeepSpeed the roots are the engine, its ZeRO optimizer and the inner (basic) optimizer;
    otherwise the module and the optimizers (``optimizer.state``). Activations are not reached.
    ``total`` excludes communication buckets (``buckets``: e.g. ZeRO-3's reduce bucket, allocated up
    front at ``reduce_bucket_size`` elements, 800 MB at DeepSpeed's default in fp32)."""
    engine = getattr(strategy, "deepspeed_engine", None) if hasattr(strategy, "deepspeed_engine") else None
    roots: list[tuple[str, object]] = [("params", list(module.parameters()))]  # ZeRO-3: p.ds_tensor, via vars(p)
    if engine is not None:
        roots += [("optimizer", engine.optimizer), ("basic_optimizer", engine.basic_optimizer), ("engine", engine)]
    else:
        roots += [(f"optimizer{i}", opt) for i, opt in enumerate(optimizers)]
    paths = structure_paths(roots)
    by_root: dict[str, int] = {}
    buckets = 0
    for path, nbytes in paths.values():
        if "bucket" in path:  # communication buffers (reduce/all-gather buckets): sized by config, not by Psi
            buckets += nbytes
            continue
        root = path.split(".", 1)[0].split("[", 1)[0]
        by_root[root] = by_root.get(root, 0) + nbytes
    largest = sorted(((p, b) for p, b in paths.values()), key=lambda pb: -pb[1])[:5]
    return {"total": sum(by_root.values()), "buckets": buckets, "by_root": by_root, "largest": largest}
