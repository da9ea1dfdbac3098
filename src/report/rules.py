"""The classic LLM-training troubleshooting table ("loss not falling / oscillating, OOM, too slow ->
what to check") and the usual problem list (NCCL timeout, unstable mixed precision, failed
checkpoint restore) as rules over what a run recorded.

Each rule reads a ``RunData`` (history.jsonl, metrics.json, findings, crash.json, config) and
returns at most one finding (``check="advisor"``) whose message carries the evidence (numbers
and steps) and whose advice is the table's row, in this framework's config keys.

| code | fires when | evidence |
|---|---|---|
| ``loss_not_falling`` | train/loss after warmup falls < 1% from its first to its last quarter | both means, steps, LR; then the causes the run recorded, strongest first: parameters that do not train (freeze_verify), an LR that is tiny or never reaches its peak, clipping by orders of magnitude |
| ``loss_oscillating`` | after warmup, train/loss swings around its trend by > 5% of its level, AND the loss is not implausibly low and the swing does not repeat with the epoch (then it is the data's, not the LR's) | swing, trend level |
| ``loss_implausibly_low`` | after warmup the loss sits below 10% of where it started (an untrained LM starts at ~ln(vocab)) | level, start, epochs: memorisation (many epochs over few samples) or leakage |
| ``loss_diverging`` | after warmup the loss ends > 50% above its minimum, or becomes NaN/inf | min, end, first bad step |
| ``val_loss_rising`` | val/loss rose > 5% above its best (>= 3 evaluations) | best step and value, last |
| ``out_of_memory`` | the run died of OOM (CUDA OOM, or a rank SIGKILLed) or memory > 95% of the device | error / peak |
| ``too_slow`` | collectives > 50% of the step, data loading > 30% of the step, or fp32 on a GPU | the shares / precision |
| ``nccl_timeout`` | the run died of a collective timeout or the hang watchdog (exit 124) | the error line |
| ``mixed_precision_unstable`` | fp16 and steps skipped on overflow / non-finite gradients | count of such findings |
| ``checkpoint_restore_failed`` | the run stopped on a missing, partial or corrupted checkpoint | the error line |
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from statistics import mean, pstdev
from typing import Any

from dsdebug.report.load import RunData

CHECK = "advisor"


def _finding(code: str, severity: str, message: str, advice: str, **details: Any) -> dict[str, Any]:
    return {"check": CHECK, "severity": severity, "code": code, "message": message, "advice": advice,
            "step": details.pop("step", None), "rank": None, "details": details}


def warmup_steps(run: RunData) -> int:
    sched = run.cfg("optim.scheduler") or {}
    if not isinstance(sched, dict) or not sched:
        return 0
    if sched.get("warmup_steps") is not None:
        return int(sched["warmup_steps"])
    max_steps = run.cfg("trainer.max_steps") or run.metrics.get("global_step") or 0
    return int(round(float(sched.get("warmup_ratio", 0.0) or 0.0) * max(int(max_steps), 0)))


def _after_warmup(run: RunData, key: str) -> tuple[list[int], list[float]]:
    steps, values = run.series(key)
    w = warmup_steps(run)
    pairs = [(s, v) for s, v in zip(steps, values) if s >= w]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _lr_text(run: RunData) -> str:
    lr_keys = run.keys("lr")
    if lr_keys:
        _, values = run.series(lr_keys[0])
        if values:
            return f"LR peaked at {max(values):.2e}"
    lr = run.cfg("optim.lr")
    return f"optim.lr={lr}" if lr is not None else "LR unknown"


def loss_not_falling(run: RunData) -> dict | None:
    steps, loss = _after_warmup(run, "train/loss")
    loss = [v for v in loss if math.isfinite(v)]
    if len(loss) < 8:
        return None
    q = max(2, len(loss) // 4)
    head, tail = mean(loss[:q]), mean(loss[-q:])
    drop = (head - tail) / abs(head) if head else 0.0
    if drop >= 0.01:
        return None
    causes = _not_falling_causes(run)
    generic = ("check the learning rate is not too small (optim.lr; lr=0 in a param group is caught by "
               "freeze_verify), the data format (debug=data prints the first batch: labels must be the inputs "
               "shifted by one), and the tokenizer (data.vocab_size, special tokens, chat template)")
    return _finding(
        "loss_not_falling", "warning",
        f"train/loss went {head:.4f} -> {tail:.4f} ({-drop:+.1%}) over steps {steps[0]}-{steps[-1]} after warmup; "
        f"{_lr_text(run)}" + (f"; evidence, strongest first: {'; '.join(c for c, _ in causes)}" if causes else ""),
        "; ".join(a for _, a in causes) + ("; else " if causes else "") + generic,
        head=head, tail=tail, first_step=steps[0], last_step=steps[-1], causes=[c for c, _ in causes],
    )


_FROZEN_CODES = ("not_updated", "unused_param", "detached_param", "zero_grad_param", "lr_zero_param",
                 "not_in_optimizer", "frozen_outside_config")


def _not_falling_causes(run: RunData) -> list[tuple[str, str]]:
    """Why the loss does not fall, from what the run recorded, strongest evidence first: parameters that
    do not train (freeze_verify's findings), an LR that is tiny or never reaches its configured peak,
    gradients clipped by orders of magnitude (the logged global norm vs optim.grad_clip)."""
    causes: list[tuple[str, str]] = []
    frozen = [f for f in run.findings if f.get("code") in _FROZEN_CODES]
    if frozen:
        causes.append((f"{len(frozen)} freeze_verify finding(s), first: {frozen[0].get('message', '')[:120]}",
                       "make those parameters train (wire them into forward, remove the detach, add them to the "
                       "optimizer's param groups)"))
    lr_keys = run.keys("lr")
    # the LR the optimizer was built with: prepare writes the batch-scaled LR to optim.optimizer.lr
    peak_cfg = run.cfg("optim.optimizer.lr")
    peak_cfg = peak_cfg if isinstance(peak_cfg, (int, float)) else run.cfg("optim.lr")
    if lr_keys:
        values = [v for key in lr_keys for v in run.series(key)[1]]  # every param group: the largest counts
        peak = max(values) if values else None
        if peak is not None and peak < 1e-6:
            causes.append((f"the LR never exceeded {peak:.1e}", "raise optim.lr (typical AdamW LRs: 1e-4..3e-3)"))
        elif peak is not None and isinstance(peak_cfg, (int, float)) and peak_cfg > 0 and peak < 0.5 * peak_cfg:
            causes.append((f"the LR peaked at {peak:.2e}, {peak / peak_cfg:.0%} of optim.lr={peak_cfg:g}: the schedule "
                           "never reaches its peak", "shorten the warmup (optim.scheduler.warmup_ratio / warmup_steps) "
                           "or run more steps (trainer.max_steps)"))
    clip = run.cfg("optim.grad_clip")
    _, norms = run.series("grad/norm/global")
    norms = sorted(v for v in norms if math.isfinite(v))
    if isinstance(clip, (int, float)) and clip > 0 and norms and norms[len(norms) // 2] > 10 * clip:
        med = norms[len(norms) // 2]
        causes.append((f"gradients are clipped {med / clip:.0f}x (median global norm {med:.3g} vs "
                       f"optim.grad_clip={clip:g}): clipping dominates every update",
                       "raise optim.grad_clip or find why the gradient norm is that large (debug=grads)"))
    return causes


def _trend(values: list[float], window: int = 5) -> list[float]:
    half = window // 2
    return [mean(values[max(0, i - half): i + half + 1]) for i in range(len(values))]


def _start_loss(run: RunData) -> float | None:
    _, values = run.series("train/loss")
    head = [v for v in values[:3] if math.isfinite(v)]
    return mean(head) if head else None


def _implausibly_low(run: RunData, level: float) -> bool:
    """The loss sits below 10% of where it started: no LM on real text gets there in one run (natural
    text keeps >= ~1-2 nats/token against a start of ~ln(vocab)); a model that sees its answer or has
    memorised a few samples does."""
    start = _start_loss(run)
    return start is not None and start > 0 and level < 0.1 * start


def _epochs(run: RunData) -> tuple[int, int | None]:
    """(passes over the training data, optimizer steps per pass) from the logged ``epoch``."""
    steps, epochs = run.series("epoch")
    if not epochs:
        return 1, None
    first_next = next((s for s, e in zip(steps, epochs) if e >= 1), None)
    return int(max(epochs)) + 1, first_next


def _repeats_with_epoch(run: RunData, steps: list[int], resid: list[float]) -> bool:
    """The swing comes back with the data: residuals one epoch apart correlate (few samples, many
    epochs: each batch has its own loss, the LR is not the cause)."""
    passes, period = _epochs(run)
    if passes < 3 or not period or period < 2:
        return False
    at = dict(zip(steps, resid))
    pairs = [(at[s], at[s + period]) for s in steps if s + period in at]
    if len(pairs) < 2 * period or len(pairs) < 6:
        return False
    xs, ys = [a for a, _ in pairs], [b for _, b in pairs]
    sx, sy = pstdev(xs), pstdev(ys)
    if sx == 0 or sy == 0:
        return False
    mx, my = mean(xs), mean(ys)
    return mean((a - mx) * (b - my) for a, b in pairs) / (sx * sy) >= 0.5


def loss_oscillating(run: RunData) -> dict | None:
    steps, loss = _after_warmup(run, "train/loss")
    if len(loss) < 8 or not all(math.isfinite(v) for v in loss):
        return None
    trend = _trend(loss)
    resid = [v - t for v, t in zip(loss, trend)]
    level = mean(abs(v) for v in loss)
    swing = pstdev(resid)
    if level == 0 or swing / level <= 0.05:
        return None
    # "lower the LR" only on its own evidence: a loss near zero swings by a large share of a tiny level
    # (leakage, memorisation: loss_implausibly_low says so), and a swing that repeats every epoch is
    # the few samples' own losses coming round again
    if _implausibly_low(run, level) or _repeats_with_epoch(run, steps, resid):
        return None
    return _finding(
        "loss_oscillating", "warning",
        f"after warmup train/loss swings ±{2 * swing:.3f} around its trend ({swing / level:.0%} of its level "
        f"{level:.3f}) over steps {steps[0]}-{steps[-1]}; {_lr_text(run)}",
        "lower the learning rate (optim.lr), lengthen warmup (optim.scheduler.warmup_ratio), or use a larger batch "
        "(trainer.accumulate_grad_batches, data.global_batch_size)",
        swing=swing, level=level,
    )


def loss_implausibly_low(run: RunData) -> dict | None:
    steps, loss = _after_warmup(run, "train/loss")
    loss = [v for v in loss if math.isfinite(v)]
    if len(loss) < 8:
        return None
    q = max(2, len(loss) // 4)
    level, start = mean(loss[-q:]), _start_loss(run)
    if not _implausibly_low(run, level):
        return None
    passes, period = _epochs(run)
    if passes >= 3:
        why = (f"the run made {passes} passes over its training data ({period} steps each): it memorised "
               "a few samples")
        advice = ("give the run more distinct data (data.max_tokens, a bigger corpus) or fewer steps; a val/loss "
                  "that rises meanwhile confirms memorisation, a val/loss as low as train points at leakage")
    else:
        why = "in under 3 passes over the data: the model likely sees what it predicts (leakage)"
        advice = ("check causality (attention mask, position t must not see t+1), that labels are not in the "
                  "inputs, and that train and val do not overlap (debug=data); lowering the LR will not help")
    return _finding(
        "loss_implausibly_low", "warning",
        f"train/loss fell from {start:.4f} to {level:.4f} (last quarter after warmup, steps "
        f"{steps[-q]}-{steps[-1]}), below 10% of where it started: {why}",
        advice, level=level, start=start, passes=passes, steps_per_pass=period,
    )


def loss_diverging(run: RunData) -> dict | None:
    steps, loss = _after_warmup(run, "train/loss")
    if len(loss) < 4:
        return None
    bad = [s for s, v in zip(steps, loss) if not math.isfinite(v)]
    finite = [v for v in loss if math.isfinite(v)]
    if bad:
        message = f"train/loss became non-finite at step {bad[0]} ({len(bad)} of {len(loss)} logged steps)"
    else:
        low, end = min(finite), mean(finite[-3:])
        if end <= 1.5 * low:
            return None
        message = f"train/loss fell to {low:.4f} then rose to {end:.4f} by step {steps[-1]}"
    return _finding(
        "loss_diverging", "error", f"{message}; {_lr_text(run)}",
        "lower the peak learning rate (optim.lr), keep gradient clipping on (optim.grad_clip=1.0), and run "
        "debug=grads to see which layer's gradients blow up first",
        step=bad[0] if bad else None,
    )


def val_loss_rising(run: RunData) -> dict | None:
    steps, val = run.series("val/loss")
    pairs = [(s, v) for s, v in zip(steps, val) if math.isfinite(v)]
    if len(pairs) < 3:
        return None
    best_step, best = min(pairs, key=lambda p: p[1])
    last_step, last = pairs[-1]
    if last_step == best_step or last <= 1.05 * best:
        return None
    return _finding(
        "val_loss_rising", "warning",
        f"val/loss was best at step {best_step} ({best:.4f}) and is {last:.4f} at step {last_step} "
        f"({last / best - 1:+.1%})",
        f"overfitting: keep the checkpoint nearest step {best_step}, stop earlier, or add data / regularization "
        "(optim.optimizer.weight_decay)",
        best_step=best_step, best=best, last=last,
    )


_OOM = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|std::bad_alloc|Cannot allocate memory",
                  re.IGNORECASE)


def out_of_memory(run: RunData) -> dict | None:
    text = _crash_text(run)
    evidence = None
    if _OOM.search(text):
        evidence = f"the run died: {_first_line(text)}"
    else:
        killed = [f for f in run.findings if f.get("code") == "rank_died" and "SIGKILL" in f.get("message", "")]
        if killed:
            evidence = f"{killed[0]['message']} (the kernel OOM killer sends SIGKILL)"
    frac_keys = [k for k in run.history if k.endswith("mem_frac_max")]
    if evidence is None and frac_keys:
        _, values = run.series(frac_keys[0])
        if values and max(values) > 0.95:
            evidence = f"peak memory {max(values):.0%} of the device"
    if evidence is None:
        return None
    return _finding(
        "out_of_memory", "error", evidence,
        "use a smaller data.batch_size (keep the global batch with trainer.accumulate_grad_batches), a shorter "
        "data.seq_len, activation checkpointing, a higher ZeRO stage (strategy=zero3) or CPU offload "
        "(strategy=zero3_offload)",
    )


def too_slow(run: RunData) -> dict | None:
    reasons = []
    _, comm = run.series("comm/share")
    if len(comm) >= 3 and mean(comm) > 0.5:
        reasons.append(f"collectives take {mean(comm):.0%} of the step")
    _, data = run.series("time/data_fraction")
    if data and max(data) > 0.3:
        reasons.append(f"data loading takes {max(data):.0%} of the step")
    precision = str(run.metrics.get("precision") or run.cfg("trainer.precision") or "")
    accelerator = str(run.cfg("trainer.accelerator") or "")
    if accelerator in ("gpu", "cuda") and precision.startswith("32"):
        reasons.append(f"trainer.precision={precision} on a GPU")
    if not reasons:
        return None
    return _finding(
        "too_slow", "warning", "; ".join(reasons),
        "train in bf16 (trainer.precision=bf16-mixed), pack sequences (the default data module packs), use a "
        "larger micro-batch per rank; for communication: overlap_comm, larger reduce_bucket_size, bf16 "
        "communication (see docs/debugging.md); for data: data.num_workers>0, pin_memory",
        reasons=reasons,
    )


_TIMEOUT = re.compile(r"timed? ?out|Watchdog caught collective|NCCL.*timeout|hang watchdog|DistBackendError",
                      re.IGNORECASE)


def nccl_timeout(run: RunData) -> dict | None:
    text = _crash_text(run)
    exit_code = (run.crash or {}).get("exit_code")
    hung = [f for f in run.findings if f.get("code") in ("hang", "hang_detected", "collective_timeout")]
    if not (_TIMEOUT.search(text) or exit_code == 124 or hung):
        return None
    evidence = _first_line(text) or (hung[0]["message"] if hung else f"exit code {exit_code}")
    return _finding(
        "nccl_timeout", "error", f"a collective timed out or hung: {evidence}",
        "rerun with debug=comm and NCCL_DEBUG=INFO, TORCH_NCCL_BLOCKING_WAIT=1 (NCCL_BLOCKING_WAIT=1 on older "
        "torch), TORCH_NCCL_ASYNC_ERROR_HANDLING=1; the flight-recorder dump names the collective each rank was in",
    )


def mixed_precision_unstable(run: RunData) -> dict | None:
    precision = str(run.metrics.get("precision") or run.cfg("trainer.precision") or "")
    if not precision.startswith("16"):
        return None
    bad = [f for f in run.findings if f.get("code") in ("nonfinite_grad", "nonfinite_loss", "overflow_skip")]
    if not bad:
        return None
    return _finding(
        "mixed_precision_unstable", "warning",
        f"{len(bad)} non-finite loss/gradient finding(s) under trainer.precision={precision}, first at step "
        f"{bad[0].get('step')}",
        "prefer bf16-mixed where the hardware has it; with fp16 keep dynamic loss scaling "
        "(loss_scale_window=1000 in ds_config), Adam eps=1e-8, and gradient accumulation",
        count=len(bad),
    )


_CKPT = re.compile(r"checkpoint", re.IGNORECASE)


def checkpoint_restore_failed(run: RunData) -> dict | None:
    text = _crash_text(run)
    if not (run.cfg("ckpt_path") or run.cfg("resume")) or not _CKPT.search(text):
        return None
    return _finding(
        "checkpoint_restore_failed", "error", f"resuming failed: {_first_line(text)}",
        "keep checkpoints on shared storage (NFS/Ceph) rather than a node's local disk, keep a second copy, and "
        "use resume=latest_valid to fall back to the newest checkpoint that verifies",
    )


def _crash_text(run: RunData) -> str:
    if run.crash is None:
        return ""
    return " ".join(str(run.crash.get(k) or "") for k in ("error", "exception"))


def _first_line(text: str) -> str:
    return " ".join(text.split())[:300]


RULES: list[Callable[[RunData], dict | None]] = [
    loss_not_falling, loss_oscillating, loss_implausibly_low, loss_diverging, val_loss_rising, out_of_memory, too_slow,
    nccl_timeout, mixed_precision_unstable, checkpoint_restore_failed,
]


def evaluate(run: RunData) -> list[dict[str, Any]]:
    """Every rule that fires, in table order."""
    return [f for f in (rule(run) for rule in RULES) if f is not None]
