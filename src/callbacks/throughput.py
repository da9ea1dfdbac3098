"""`Throughput`: tokens/s, samples/s, step time, MFU, and why a run is slower than it should be.

The config example and the table of metrics and findings: the class docstring (`Throughput`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from typing import Any, ClassVar

import torch

from dsdebug.config.args import Rule, integer, number, optional
from dsdebug.callbacks.base import DebugCallback
from dsdebug.data.loader_facts import describe_train_loader
from dsdebug.models.flops import flops_per_token, gpu_peak_flops, measure_peak_flops

__all__ = ["Throughput"]

log = logging.getLogger(__name__)
_CPU_PEAK: float | None = None  # measured once per process


class Throughput(DebugCallback):
    """`Throughput`: tokens/s, samples/s, step time, MFU, and why a run is slower than it should be.

    Catches (the usual bottleneck thresholds: GPU utilisation >= 85%, gradient sync < 20% of forward time):
    an input pipeline that starves the model (``input_bound``), gradient synchronisation heavier
    than the forward pass (``comm_heavy``), an idle GPU (``low_gpu_util``), and a run that became
    slower than it was (``throughput_drop``: a throttled or shared node, swapping, a slow disk).

    How it measures, per step, with ``time.perf_counter`` only (no device sync, no collective):
    - step time = previous ``on_train_batch_end`` -> this one (data loading and every hook
      included; validation and checkpoint saves left out);
    - data wait = previous batch end -> this ``on_train_batch_start``: fetching the next batch
      (Lightning prefetches one batch ahead, so the fetch happens in this gap) plus logging;
    - tokens = ``input_ids.numel()`` (padding included), samples = its first dimension;
    - MFU = tokens/s x training FLOPs per token (``dsdebug.models.flops``: 6 x active params +
      attention) / peak: on GPU the dense bf16 spec number by device name
      (``dsdebug.models.flops.GPU_PEAK_TFLOPS``), on CPU the fastest fp32 ``torch.mm`` of a 0.3 s burst at setup
      (cached per process; a shared core only slows a matmul, so the fastest is the peak); ``peak_tflops`` overrides both;
    - comm: the seconds with a collective in flight between ``on_before_backward`` and the batch end
      (the gradient sync and ZeRO's gathers), read from comm_debug's ``CommTracker``. It exists
      only when ``comm_debug`` runs with ``measure_comm: true`` (or its hang watchdog); without it
      ``comm_heavy`` is not judged. Forward time = batch start -> ``on_before_backward``.
    - GPU utilisation: ``torch.cuda.utilization()`` (needs pynvml) every ``util_every_n_steps``;
      on CPU ``low_gpu_util`` is skipped and the summary says so.
    On GPU, host-side timings of queued kernels settle over a window (the loop syncs on the loss
    and the optimizer step); phase times (forward) are host-side and only a guide there.

    Rank awareness: every rank judges its own clock and reports its own findings (local info, no
    collective); rank 0 logs the metrics. A straggler slows every rank (they wait for it in the
    gradient sync): ``log_sync`` names which rank it is.

    Example::

        python train.py +callbacks=[throughput,comm_debug] callbacks.comm_debug.measure_comm=true \\
            callbacks.throughput.data_wait_threshold=0.2

    | metric key (every ``trainer.log_every_n_steps``, rank 0) | meaning |
    |---|---|
    | ``throughput/tokens_per_s`` / ``throughput/samples_per_s`` | this rank, over the last step |
    | ``throughput/step_ms`` | wall time of the last step |
    | ``throughput/mfu`` | model FLOPs utilisation of this rank's device |
    | ``throughput/data_wait_share`` | share of the step spent waiting for the next batch |
    | ``throughput/comm_forward_ratio`` | gradient-sync seconds / forward seconds (with comm_debug) |
    | ``throughput/gpu_util`` | GPU utilisation in [0, 1] (GPU with pynvml) |

    | finding code | severity | when |
    |---|---|---|
    | ``input_bound`` | warning | median data-wait share over ``window`` steps > ``data_wait_threshold`` |
    | ``comm_heavy`` | warning | median sync/forward over ``window`` steps > ``comm_forward_ratio`` (needs comm measurement) |
    | ``low_gpu_util`` | warning | mean GPU utilisation over ``window`` samples < ``gpu_util_threshold`` (GPU only) |
    | ``throughput_drop`` | warning | ``drop_patience`` steps in a row slower than ``drop_factor`` x the median step |
    | ``throughput_summary`` | info | at the end: median tokens/s, step ms, MFU, data-wait share, peak used |

    Resume: nothing is carried over (``state_attrs`` is empty): every window and the reference step
    time are this rank's own clock, and a resumed run may sit on other nodes.
    """
    name = "throughput"
    state_attrs = ()  # per-rank clocks (step times, data waits, utilisation), judged and counted per rank

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "warmup_steps": integer(0),
        "window": integer(3),
        "data_wait_threshold": number(0, 1, open_low=True, open_high=True),
        "comm_forward_ratio": optional(number(0, open_low=True), "0.2 on CUDA, not judged on CPU"),
        "gpu_util_threshold": number(0, 1),
        "util_every_n_steps": integer(0, note="0 = off"),
        "drop_factor": number(1, open_low=True),
        "drop_patience": integer(1),
        "peak_tflops": optional(number(0, open_low=True), "table on GPU, measured on CPU"),
        "max_findings_per_code": integer(1),
    }

    def __init__(self, warmup_steps: int = 10, window: int = 20, data_wait_threshold: float = 0.3,
                 comm_forward_ratio: float | None = None, gpu_util_threshold: float = 0.85, util_every_n_steps: int = 10,
                 drop_factor: float = 2.0, drop_patience: int = 5, peak_tflops: float | None = None,
                 max_findings_per_code: int = 3, on_error: str = "warn") -> None:
        super().__init__(on_error)
        self.check_declared(warmup_steps=warmup_steps, window=window, data_wait_threshold=data_wait_threshold,
                            comm_forward_ratio=comm_forward_ratio, gpu_util_threshold=gpu_util_threshold,
                            util_every_n_steps=util_every_n_steps, drop_factor=drop_factor,
                            drop_patience=drop_patience, peak_tflops=peak_tflops,
                            max_findings_per_code=max_findings_per_code)
        self.warmup_steps, self.window = warmup_steps, window
        self.data_wait_threshold, self.comm_forward_ratio = float(data_wait_threshold), (
            None if comm_forward_ratio is None else float(comm_forward_ratio))
        self.gpu_util_threshold, self.util_every_n_steps = float(gpu_util_threshold), util_every_n_steps
        self.drop_factor, self.drop_patience = float(drop_factor), drop_patience
        self.peak_tflops, self.max_findings_per_code = peak_tflops, max_findings_per_code
        self._shares: deque[float] = deque(maxlen=window)
        self._ratios: deque[float] = deque(maxlen=window)
        self._utils: deque[float] = deque(maxlen=window)
        self._reference: deque[float] = deque(maxlen=200)  # healthy step times: what "normal" is
        self._all: dict[str, list[float]] = {"tokens_per_s": [], "step_ms": [], "mfu": [], "data_wait_share": []}
        self._counts: dict[str, int] = {}
        self._slow: list[tuple[int, float]] = []
        self._prev_end: float | None = None
        self._start = self._fwd_end = self._val_start = None
        self._val_s = 0.0  # validation time since the last batch end
        self._fpt: dict[int, float] = {}
        self._cuda = False
        self._peak: float | None = None
        self._peak_source = ""

    # ---- setup: every rank, local -------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        global _CPU_PEAK
        self._cuda = trainer.strategy.root_device.type == "cuda"
        if self.peak_tflops:
            self._peak, self._peak_source = self.peak_tflops * 1e12, "given (peak_tflops)"
        elif self._cuda:
            name = torch.cuda.get_device_name(trainer.strategy.root_device)
            self._peak = gpu_peak_flops(name)
            self._peak_source = f"{name} dense bf16 spec" if self._peak else f"{name}: not in the table (set peak_tflops)"
        else:
            if _CPU_PEAK is None:
                _CPU_PEAK = measure_peak_flops(seconds=0.3, n=512, best=True)
            self._peak, self._peak_source = _CPU_PEAK, (f"measured: fastest fp32 torch.mm on this process's "
                                                         f"{torch.get_num_threads()} thread(s)")

    # ---- per step: every rank, local clocks only ----------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()
        self._fwd_end = None

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._fwd_end is None:
            self._fwd_end = time.perf_counter()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._val_start is not None:  # the next step's gap holds validation: not a data wait
            self._val_s += time.perf_counter() - self._val_start
            self._val_start = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        end, start, prev, val_s = time.perf_counter(), self._start, self._prev_end, self._val_s
        self._prev_end, self._val_s = end, 0.0
        if start is None:
            return
        from dsdebug.checkpoint.integrity import SAVE_WINDOWS

        interrupted = prev is None  # the first step: its gap is the fit's start-up
        gap = 0.0 if interrupted else start - prev - val_s  # validation and checkpoint saves are not data waits
        gap -= sum(e - s for s, e in SAVE_WINDOWS if prev is not None and s >= prev and e <= start)
        gap = max(gap, 0.0)
        step_s = (end - start) + gap
        step = trainer.global_step
        tokens, samples = _batch_size(batch)
        tps = tokens / step_s if step_s > 0 else 0.0
        seq = _seq_len(batch)
        if seq not in self._fpt:
            self._fpt[seq] = flops_per_token(getattr(pl_module, "net", pl_module), seq)
        mfu = tps * self._fpt[seq] / self._peak if self._peak else float("nan")
        share = gap / step_s if step_s > 0 else 0.0
        metrics = {"throughput/tokens_per_s": tps, "throughput/samples_per_s": samples / step_s if step_s else 0.0,
                   "throughput/step_ms": step_s * 1e3, "throughput/mfu": mfu, "throughput/data_wait_share": share}
        ratio = self._comm_ratio(start, end)
        if ratio is not None:
            metrics["throughput/comm_forward_ratio"] = ratio
        util = self._gpu_util(step)
        if util is not None:
            metrics["throughput/gpu_util"] = util
        if trainer.global_rank == 0 and self.due(step, max(trainer.log_every_n_steps, 1)):
            for lg in trainer.loggers:
                lg.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)
        if step <= self.warmup_steps or interrupted:
            return
        for key, value in (("tokens_per_s", tps), ("step_ms", step_s * 1e3), ("mfu", mfu), ("data_wait_share", share)):
            self._all[key].append(value)
        self._shares.append(share)
        if ratio is not None:
            self._ratios.append(ratio)
        if util is not None:
            self._utils.append(util)
        self._judge(trainer, step, step_s)

    def _comm_ratio(self, start: float, end: float) -> float | None:
        from dsdebug.distributed.timing import CommTracker

        tracker = CommTracker._instance  # comm_debug's, when it measures; we never install it
        if tracker is None or self._fwd_end is None or self._fwd_end <= start:
            return None
        return tracker.busy_s(self._fwd_end, end) / (self._fwd_end - start)

    def _gpu_util(self, step: int) -> float | None:
        if not self._cuda or not self.due(step, self.util_every_n_steps):
            return None
        try:
            return torch.cuda.utilization() / 100.0  # NVML query, no sync
        except Exception:  # noqa: BLE001 - no pynvml / no NVML: not judged
            self.util_every_n_steps = 0
            return None

    # ---- findings (this rank's own numbers) ---------------------------------------------------
    def _judge(self, trainer: Any, step: int, step_s: float) -> None:
        rank = trainer.global_rank
        if len(self._shares) == self.window and statistics.median(self._shares) > self.data_wait_threshold:
            share = statistics.median(self._shares)
            self._emit(trainer, "input_bound",
                       f"rank {rank} waits for its next batch {share:.0%} of each step (median over the last "
                       f"{self.window} steps, up to step {step}; threshold {self.data_wait_threshold:.0%}): the input "
                       f"pipeline is the bottleneck: {describe_train_loader(trainer)}",
                       "raise data.num_workers (persistent workers), data.pin_memory=true on GPU, pre-tokenise "
                       "(no tokenisation/augmentation in __getitem__/collate); +callbacks=profiler shows the wait",
                       {"median_share": share, "window": list(self._shares)})
        limit = self.comm_forward_ratio
        if limit is None:  # null: the 0.2 rule of thumb is an NCCL-on-GPU figure; gloo on CPU is not judged
            limit = 0.2 if trainer.strategy.root_device.type == "cuda" else None
        if limit is not None and len(self._ratios) == self.window and statistics.median(self._ratios) > limit:
            ratio = statistics.median(self._ratios)
            self._emit(trainer, "comm_heavy",
                       f"rank {rank}'s gradient sync takes {ratio:.0%} of its forward time (median over {self.window} "
                       f"steps, up to step {step}; keep it under {limit:.0%})",
                       "overlap communication (ZeRO overlap_comm, larger reduce_bucket_size), a lower ZeRO stage if "
                       "memory allows, larger micro-batches or gradient accumulation (fewer syncs per token), a "
                       "faster interconnect",
                       {"median_ratio": ratio})
        if len(self._utils) == self.window and statistics.fmean(self._utils) < self.gpu_util_threshold:
            util = statistics.fmean(self._utils)
            self._emit(trainer, "low_gpu_util",
                       f"rank {rank}'s GPU is busy {util:.0%} of the time (mean of {self.window} samples, up to step "
                       f"{step}; healthy: >= {self.gpu_util_threshold:.0%})",
                       "find the idle time: input_bound / comm_heavy findings, +callbacks=profiler; raise the "
                       "micro-batch size if memory allows", {"mean_util": util})
        self._judge_drop(trainer, step, step_s)

    def _judge_drop(self, trainer: Any, step: int, step_s: float) -> None:
        if len(self._reference) < self.window:
            self._reference.append(step_s)
            return
        normal = statistics.median(self._reference)
        if step_s <= self.drop_factor * normal:
            self._slow = []
            self._reference.append(step_s)
            return
        self._slow.append((step, step_s))
        if len(self._slow) == self.drop_patience:
            onset, mean = self._slow[0][0], statistics.fmean(s for _, s in self._slow)
            self._emit(trainer, "throughput_drop",
                       f"rank {trainer.global_rank}'s steps slowed from a median {normal * 1e3:.0f} ms to "
                       f"{mean * 1e3:.0f} ms ({mean / normal:.1f}x) since step {onset} ({self.drop_patience} steps "
                       f"in a row above {self.drop_factor:g}x)",
                       "look at the node: thermal/power throttling (nvidia-smi -q -d PERFORMANCE), other jobs on "
                       "it, swapping, a slow filesystem; log_sync names a straggler rank",
                       {"onset_step": onset, "normal_ms": normal * 1e3, "slow_ms": [s * 1e3 for _, s in self._slow]})

    def _emit(self, trainer: Any, code: str, message: str, advice: str, details: dict) -> None:
        n = self._counts[code] = self._counts.get(code, 0) + 1
        if code != "throughput_drop":
            (self._shares if code == "input_bound" else self._ratios if code == "comm_heavy" else self._utils).clear()
        if n <= self.max_findings_per_code:
            if n == self.max_findings_per_code:
                message += f" (further {code} findings are only counted)"
            self.report(trainer, "warning", code, message, advice, details)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != 0 or not self._all["step_ms"]:
            return
        med = {k: statistics.median(v) for k, v in self._all.items() if v}
        gpu = "GPU utilisation judged" if self._cuda and self.util_every_n_steps else \
            "GPU utilisation not judged (" + ("CPU run" if not self._cuda else "no pynvml") + ")"
        counts = ", ".join(f"{c} x{n}" for c, n in sorted(self._counts.items())) or "none"
        self.report(trainer, "info", "throughput_summary",
                    f"rank 0, {len(self._all['step_ms'])} steps after warm-up: median {med['tokens_per_s']:.0f} "
                    f"tokens/s, {med['step_ms']:.0f} ms/step, MFU {med['mfu']:.1%} of {self._peak / 1e12:.3g} "
                    f"TFLOP/s ({self._peak_source}), data wait {med['data_wait_share']:.0%}; {gpu}; findings: {counts}",
                    details={"median": med, "peak_flops": self._peak, "peak_source": self._peak_source,
                             "flops_per_token": self._fpt, "counts": dict(self._counts)}, rank=None)


# -- batch and loader facts: tokens and samples of a batch, its sequence length, and a one-line
# description of the train loader (for the data-wait finding)
def _batch_size(batch: Any) -> tuple[int, int]:
    t = batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (list, tuple)) else batch
    return (int(t.numel()), int(t.shape[0])) if isinstance(t, torch.Tensor) and t.dim() else (0, 0)


def _seq_len(batch: Any) -> int:
    t = batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(t.shape[-1]) if isinstance(t, torch.Tensor) and t.dim() else 0

