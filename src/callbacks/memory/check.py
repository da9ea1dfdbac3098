"""`MemoryMonitor`: per-rank peak memory, model-state bytes vs the ZeRO formula, leaks, and OOMs.

The config example and the table of metrics and findings: the class docstring (`MemoryMonitor`).
"""

from __future__ import annotations

import logging
import math
import resource
from collections import deque
from typing import Any, ClassVar

import torch

from dsdebug.distributed import collectives
from dsdebug.config.args import Rule, either, integer, number
from dsdebug.callbacks.base import DebugCallback
from dsdebug.errors import is_out_of_memory
from dsdebug.models.model_states import bytes_per_param, held_bytes, layout_of
from dsdebug.callbacks.grad_access import _at_accumulation_boundary
from dsdebug.callbacks.memory.footprint import (GB, MB, expected_state_bytes, growth, oom_advice, rss_bytes,
                                                zero2_grad_elements, zero2_grad_groups)

__all__ = ["MemoryMonitor", "expected_state_bytes", "growth", "oom_advice", "rss_bytes"]

log = logging.getLogger(__name__)


class MemoryMonitor(DebugCallback):
    """`MemoryMonitor`: per-rank peak memory, model-state bytes vs the ZeRO formula, leaks, and OOMs.

    Catches (out of memory): a run that leaks memory step over step (e.g. a list that keeps
    loss tensors with their graphs), a ZeRO stage that does not partition what it should (each rank
    holds more model-state bytes than the paper's formula for the active stage), and an out-of-memory
    crash, which becomes an ``oom`` finding with the seed-003 remedies ordered for the active config.

    - Memory is read locally, without syncs: on GPU ``torch.cuda.memory_allocated`` /
      ``max_memory_allocated`` / ``max_memory_reserved``; on CPU the current RSS
      (``/proc/self/statm``) and the peak RSS (``getrusage`` ``ru_maxrss``).
    - Model states: once, at ``check_states_at_step`` (after backward, before the update: params,
      grads and Adam states all live), every rank sums the tensor storages its engine/optimizer/params
      hold (``dsdebug.models.model_states.held_bytes``, the walk ``benchmarks/zero_memory.py`` measures
      with) and compares with ``paper_bytes`` for the active layout (DDP, ZeRO-1/2/3, offload), plus
      the terms the paper does not count but DeepSpeed documents: ZeRO-3 persistent params (small
      params below ``stage3_param_persistence_threshold`` stay whole on every rank), in fp32, the
      separate fp32 master partition of ZeRO-1/2/3, and ZeRO-2's real gradient partition: each rank
      keeps WHOLE the gradient of every parameter that overlaps its flat partition
      (``zero2_grad_elements``, modelled on DeepSpeed's ``stage_1_and_2``), so a net of a few big
      tensors holds more than Psi/N gradients. Each rank computes its own expectation.
    - Growth: the per-step RSS (CPU) or allocated bytes (GPU) after ``warmup_steps``; a least-squares
      slope over the last ``growth_window`` samples above ``growth_mb_per_step``, with most steps
      growing, is a leak. Each rank judges its own memory and names itself.
    - OOM: Lightning calls ``on_exception``; ``torch.OutOfMemoryError`` (CUDA) or CPU allocator
      failures become an ``oom`` error naming the phase (forward/backward/optimizer/validation), the
      peak, and what to change, activation remedies first for forward/backward, state remedies first
      for the optimizer step.

    Rank awareness: sampling and growth are local (a rank reports its own leak). The model-state
    check runs ONE all-reduce (a world-size vector of held bytes) on every rank at the same step;
    rank 0 reports. The summary at the end runs one all-reduce of per-rank peaks on every rank.

    Example::

        python train.py +callbacks=memory callbacks.memory.growth_mb_per_step=2 strategy=zero3 trainer=ddp_sim

    | metric key (every ``trainer.log_every_n_steps``, rank 0's values) | meaning |
    |---|---|
    | ``memory/rss_gb`` | current resident memory of the process (CPU) |
    | ``memory/peak_gb`` | peak: ``ru_maxrss`` on CPU, ``max_memory_allocated`` on GPU |
    | ``memory/allocated_gb`` / ``memory/reserved_gb`` | GPU only: allocated now / peak reserved by the caching allocator |
    | ``memory/model_states_gb`` / ``memory/model_states_expected_gb`` | once: held model-state bytes vs the formula |

    | finding code | severity | when |
    |---|---|---|
    | ``model_states_unexpected`` | warning | a rank holds > (1 + ``states_tolerance``) x the formula for the active stage |
    | ``memory_growth`` | warning | memory grows > ``growth_mb_per_step`` MB/step over ``growth_window`` steps (a leak) |
    | ``oom`` | error | out of memory: phase, peak, remedies ordered for this config |
    | ``model_states`` | info | held vs expected bytes per rank (at ``check_states_at_step``) |
    | ``memory_summary`` | info | at the end: per-rank peak memory |

    Resume: nothing is carried over (``state_attrs`` is empty): the samples and the leak flag are each
    rank's own memory, and the model states are measured again in the resumed processes.
    """
    name = "memory"
    state_attrs = ()  # per-rank memory (RSS/allocated samples, leak flag) and this process's model states

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(0, note="0 = no sampling"),
        "warmup_steps": integer(0),
        "growth_window": integer(3),
        "growth_mb_per_step": number(0, open_low=True),
        "growth_min_share": number(0, 1),
        "check_states_at_step": either(integer(1), integer(-1, -1),
                                       valid="an int >= 1, or -1 = off (Adam states exist after the first update)"),
        "states_tolerance": number(0),
    }

    def __init__(self, every_n_steps: int = 1, warmup_steps: int = 20, growth_window: int = 50,
                 growth_mb_per_step: float = 1.0, growth_min_share: float = 0.5, check_states_at_step: int = 1,
                 states_tolerance: float = 0.1, on_error: str = "warn") -> None:
        super().__init__(on_error)
        self.check_declared(every_n_steps=every_n_steps, warmup_steps=warmup_steps, growth_window=growth_window,
                            growth_mb_per_step=growth_mb_per_step, growth_min_share=growth_min_share,
                            check_states_at_step=check_states_at_step, states_tolerance=states_tolerance)
        self.every_n_steps, self.warmup_steps, self.growth_window = every_n_steps, warmup_steps, growth_window
        self.growth_mb_per_step, self.growth_min_share = float(growth_mb_per_step), float(growth_min_share)
        self.check_states_at_step, self.states_tolerance = check_states_at_step, float(states_tolerance)
        self._samples: deque[tuple[int, int]] = deque(maxlen=growth_window)
        self._phase = "setup"
        self._cuda = False
        self._leak_reported = False
        self._states: dict | None = None

    # ---- local sampling (every rank, no collective, no sync) ---------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._cuda = trainer.strategy.root_device.type == "cuda"

    def _now(self) -> dict[str, float]:
        if self._cuda:
            dev = torch.device("cuda", torch.cuda.current_device())
            return {"allocated": torch.cuda.memory_allocated(dev), "peak": torch.cuda.max_memory_allocated(dev),
                    "reserved": torch.cuda.max_memory_reserved(dev)}
        return {"rss": rss_bytes(), "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._phase = "forward"

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._phase = "backward"

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._phase = "optimizer"

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._phase = "validation"

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._phase = "between steps (logging, checkpointing, data loading)"
        step = trainer.global_step
        if not self.due(step):
            return
        now = self._now()
        if trainer.global_rank == 0 and self.due(step, max(trainer.log_every_n_steps, 1)):
            metrics = {f"memory/{'rss' if k == 'rss' else k}_gb": v / GB for k, v in now.items()}
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=step)
        if step < self.warmup_steps or self._leak_reported:
            return
        self._samples.append((step, int(now["allocated" if self._cuda else "rss"])))
        if len(self._samples) < self.growth_window or not self.due(step, max(1, self.growth_window // 10)):
            return  # the fit every window/10 steps: ~free per step
        slope, share = growth(list(self._samples))
        if slope > self.growth_mb_per_step and share >= self.growth_min_share:
            self._leak_reported = True  # once per run: a leak keeps leaking
            first, last = self._samples[0], self._samples[-1]
            what = "allocated GPU memory" if self._cuda else "resident memory (RSS)"
            self.report(trainer, "warning", "memory_growth",
                        f"rank {trainer.global_rank}'s {what} grows {slope:.1f} MB/step over steps {first[0]}-"
                        f"{last[0]} ({first[1] / MB:.0f} -> {last[1] / MB:.0f} MB, {share:.0%} of steps grew): "
                        "something keeps tensors alive across steps",
                        advice="look for lists/dicts that keep per-step tensors (append loss.detach() or "
                               "loss.item(), not loss), caches keyed by step, hooks that store activations; "
                               "torch.cuda.memory_snapshot() / tracemalloc show who allocates",
                        details={"mb_per_step": slope, "share_growing": share, "window": list(self._samples)})

    # ---- model states: EVERY rank, same step, one all-reduce ---------------------------------
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if (self._states is not None or self.check_states_at_step < 0
                or trainer.global_step < self.check_states_at_step or not _at_accumulation_boundary(trainer)):
            return
        layout, stage = layout_of(trainer.strategy)
        params = list(pl_module.parameters())
        psi = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
        persistent = sum(int(p.ds_numel) for p in params if getattr(p, "ds_persist", False))
        held = held_bytes(trainer.strategy, pl_module, trainer.optimizers)
        per_param = bytes_per_param(trainer.strategy, pl_module)
        n, rank = trainer.world_size, trainer.global_rank
        engine = getattr(trainer.strategy, "deepspeed_engine", None) if stage == 2 else None
        groups = zero2_grad_groups(engine.optimizer) if engine is not None else None
        # each rank's own expectation: under ZeRO-2 a tensor across a partition boundary is held whole
        exp = expected_state_bytes(layout, psi, n, per_param, persistent,
                                   zero2_grad_elements(groups, n, rank) if groups else None)
        vec = torch.zeros(3 * n, dtype=torch.float64)
        vec[rank], vec[n + rank], vec[2 * n + rank] = held["total"], held["buckets"], exp["expected"]
        if n > 1:  # COLLECTIVE, every rank, once
            vec = collectives.reduce(trainer, vec, "sum").cpu()
        per_rank, held["buckets_per_rank"] = vec[:n].tolist(), vec[n:2 * n].tolist()
        exp["expected_per_rank"] = vec[2 * n:].tolist()
        self._states = {"layout": layout, "psi": psi, "per_rank": per_rank, **exp}
        if rank == 0:
            for lg in trainer.loggers:
                lg.log_metrics({"memory/model_states_gb": per_rank[0] / GB,
                                "memory/model_states_expected_gb": exp["expected"] / GB}, step=trainer.global_step)
        if rank != 0:
            return
        self._report_states(trainer, layout, psi, per_rank, exp, per_param, held)

    def _report_states(self, trainer: Any, layout: str, psi: int, per_rank: list[float], exp: dict,
                       per_param: tuple, held: dict) -> None:
        expected = exp["expected_per_rank"]
        over = [r for r, b in enumerate(per_rank) if b > expected[r] * (1 + self.states_tolerance)]
        n = len(per_rank)
        straddle = (f", of which {exp['straddle'] / MB:.1f} MiB: ZeRO-2 keeps whole the gradients of parameters "
                    "across a partition boundary") if exp["straddle"] else ""
        terms = (f"params {exp['params'] / MB:.1f} + grads {exp['grads'] / MB:.1f} + optimizer "
                 f"{exp['optimizer'] / MB:.1f} + extra {exp['extra'] / MB:.1f} MiB{straddle}")
        details = {"layout": layout, "psi": psi, "ranks": n, "bytes_per_param": per_param, "per_rank": per_rank,
                   "expected": exp["expected"], "expected_per_rank": expected, "formula": exp["total"],
                   "extra": exp["extra"], "straddle": exp["straddle"],
                   "rank0_by_root": held["by_root"], "rank0_largest": held["largest"]}
        held_txt = ", ".join(f"rank {r} {b / MB:.1f}" for r, b in enumerate(per_rank))
        buckets = max(held["buckets_per_rank"])
        details["buckets_per_rank"] = held["buckets_per_rank"]
        bucket_txt = (f"; besides, communication buckets hold {buckets / MB:.1f} MiB per rank "
                      "(reduce/allgather_bucket_size)") if buckets else ""
        if over:
            ratio = max(b / e if e else math.inf for b, e in zip(per_rank, expected))
            self.report(trainer, "warning", "model_states_unexpected",
                        f"rank(s) {over} hold {ratio:.2f}x the model-state bytes {layout} should hold on {n} "
                        f"rank(s) ({held_txt} MiB vs expected {_per_rank_mib(expected)} MiB; rank 0: {terms}; "
                        f"Psi={psi}): states are not partitioned as configured{bucket_txt}",
                        advice="check the ZeRO stage really in effect (ds_config / strategy), "
                               "stage3_param_persistence_threshold, and tensors kept beside the optimizer; "
                               "details.rank0_largest names the biggest holders",
                        details=details, rank=over[0] if len(over) == 1 else None)
        else:
            self.report(trainer, "info", "model_states",
                        f"{layout} on {n} rank(s), Psi={psi}: held {held_txt} MiB vs expected "
                        f"{_per_rank_mib(expected)} MiB (rank 0: {terms}){bucket_txt}", details=details, rank=None)

    # ---- OOM (the rank that ran out) ---------------------------------------------------------
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not is_out_of_memory(exception):
            return
        layout, _ = layout_of(trainer.strategy)
        net = getattr(pl_module, "net", pl_module)
        checkpointing = bool(getattr(net, "is_gradient_checkpointing", False))
        dm = getattr(trainer, "datamodule", None)
        batch_size, seq_len = getattr(dm, "batch_size", None), getattr(dm, "seq_len", None)
        advice = oom_advice(self._phase, layout, checkpointing, batch_size, seq_len)
        peak = self._now()["peak"]
        first = " ".join(str(exception).split())[:200]
        self.report(trainer, "error", "oom",
                    f"out of memory on rank {trainer.global_rank} in {self._phase} at step {trainer.global_step} "
                    f"(peak {peak / GB:.2f} GB, {layout}, batch {batch_size} x seq {seq_len}, gradient "
                    f"checkpointing {'on' if checkpointing else 'off'}): {first}",
                    advice="; ".join(f"{i + 1}) {a}" for i, a in enumerate(advice)),
                    details={"phase": self._phase, "peak_bytes": peak, "layout": layout, "remedies": advice})

    # ---- summary: EVERY rank, one all-reduce --------------------------------------------------
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.every_n_steps:
            return
        n = trainer.world_size
        vec = torch.zeros(n, dtype=torch.float64)
        vec[trainer.global_rank] = self._now()["peak"]
        if n > 1:  # COLLECTIVE, every rank
            vec = collectives.reduce(trainer, vec, "sum").cpu()
        if trainer.global_rank == 0:
            peaks = vec.tolist()
            kind = "max_memory_allocated" if self._cuda else "peak RSS"
            self.report(trainer, "info", "memory_summary",
                        f"{kind} per rank: " + ", ".join(f"rank {r} {b / GB:.2f} GB" for r, b in enumerate(peaks)),
                        details={"peak_bytes": peaks, "states": self._states}, rank=None)


def _per_rank_mib(values: list[float]) -> str:
    """One number when every rank expects the same, else one per rank."""
    if max(values) - min(values) < 0.05 * MB:
        return f"{values[0] / MB:.1f}"
    return ", ".join(f"rank {r} {v / MB:.1f}" for r, v in enumerate(values))
