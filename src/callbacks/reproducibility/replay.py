"""Reproducibility's helpers: RNG state snapshot/restore/digest, module-output fingerprints and
their comparison (pure functions; the callback and its hooks: reproducibility.py)."""

from __future__ import annotations

import hashlib
import os
import platform
import random
from typing import Any

import numpy as np
import torch
from dsdebug.distributed import collectives

__all__ = ["first_difference", "ranks_differing", "rng_state", "seed_record", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _digest(state: dict[str, Any]) -> dict[str, str]:
    """Short sha1 per RNG state: equal digests = equal states (compare ranks and runs)."""
    raw = {
        "python": repr(state["python"]).encode(),
        "numpy": state["numpy"][1].tobytes() + repr(state["numpy"][2:]).encode(),
        "torch_cpu": state["torch_cpu"].numpy().tobytes(),
    }
    if "cuda" in state:
        raw["cuda"] = b"".join(t.cpu().numpy().tobytes() for t in state["cuda"])
    return {k: hashlib.sha1(v).hexdigest()[:16] for k, v in raw.items()}


def _tensors(out: Any) -> list[torch.Tensor]:
    """Tensors of a module output in a fixed order (tensor, tuple/list, dict, HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []


def _only(trainer: Any, ranks: list[int] | None) -> str:
    """A replay that differs on some ranks only is rank-local state, not an op: point at replica_parity."""
    if not ranks or trainer is None or len(ranks) >= trainer.world_size:
        return ""
    who = f"only rank {ranks[0]} differs" if len(ranks) == 1 else f"only ranks {ranks} differ"
    return f"; {who}: run +callbacks=replica_parity (replicas may have drifted)"


def first_difference(replay: list, real: list) -> tuple | None:
    """(record, call index, max abs diff or None, how) of the first differing module call."""
    same = lambda a, b: torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)  # noqa: E731
    for i, (a, b) in enumerate(zip(replay, real)):
        if a[0] != b[0] or len(a[1]) != len(b[1]):
            return b, i, None, f"the module call order changed (replay called `{a[0]}`)"
        for (shape_a, sum_a, s_a), (shape_b, sum_b, s_b) in zip(a[1], b[1]):
            if shape_a != shape_b:
                return b, i, None, f"output shape {shape_a} vs {shape_b}"
            if not (same(s_a, s_b) and same(sum_a, sum_b)):
                diff = float((s_a - s_b).abs().nan_to_num(float("inf")).max()) if s_a.numel() else 0.0
                return b, i, diff, f"output sum differs by {float(sum_a - sum_b):.3g}"
    if len(replay) != len(real):
        i = min(len(replay), len(real))
        rec = (real or replay)[min(i, len(real or replay) - 1)]
        return rec, i, None, f"{len(replay)} module calls in the replay vs {len(real)} in the real step"
    return None


def ranks_differing(trainer: Any, differs: bool) -> list[int]:
    """The ranks whose replay differed at this step (one tiny all_gather when world > 1)."""
    if trainer.world_size <= 1:
        return [trainer.global_rank] if differs else []
    flag = torch.tensor([1 if differs else 0], device=trainer.strategy.root_device)
    return [r for r, v in enumerate(collectives.all_gather(trainer, flag).reshape(-1).tolist()) if v]


def seed_record(trainer: Any, seed: int, seeded_here: bool, hash_seed_at_start: str | None,
                state: dict[str, Any]) -> dict[str, Any]:
    """``repro/rank<r>.json``: what seeded this rank, its env vars, flags, versions, RNG digests."""
    return {
        "rank": trainer.global_rank, "world_size": trainer.world_size, "seed": seed,
        "PL_GLOBAL_SEED": os.environ.get("PL_GLOBAL_SEED"), "PL_SEED_WORKERS": os.environ.get("PL_SEED_WORKERS"),
        "seeded_by": "reproducibility" if seeded_here else "seed_everything in the entry point",
        "env": {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")},
        "process_hash_seed": hash_seed_at_start,
        "flags": {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                  "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                  "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
                  "cudnn_deterministic": torch.backends.cudnn.deterministic,
                  "cudnn_benchmark": torch.backends.cudnn.benchmark},
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda},
        "rng_digest": _digest(state),
        "rng_state_file": f"rng_state_rank{trainer.global_rank}.pt",
    }
