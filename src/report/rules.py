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
| ``loss_diverging`` | after warmup the loss ends > 50% above its minimum, or becomes NaN/inf | min, end, first bad step; with the LR in its usual range the advice points at the checks' own findings first |
| ``lr_too_high`` | the configured peak LR is >= 10x the top of the usual range for its optimizer family and model size (``lr_range.py``: GPT-3 Table 2.1 / Pythia for Adam, Goyal et al. for SGD), AND after the first update the loss diverged: non-finite, >= 1.5x the loss before any update (train/loss at step 0, else val/loss before training), or up >= 1.5x from its minimum, each rise also by >= 0.1 ln(vocab) (a wiggle near zero is none) | ``optim.lr`` as set, the usual range and its basis, the ratio, the loss numbers and steps, the LR at the onset, the gradient norm; a value to try; the root of the divergence incident (``details.explains``) |
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

from dsdebug.findings.incidents import cause_of
from dsdebug.report.load import RunData
from dsdebug.report.lr_range import UsualLR, lr_text, suggestion, usual_lr

__all__ = ["CHECK", "LR_FAR_ABOVE", "RULES", "checkpoint_restore_failed", "evaluate", "loss_diverging",
           "loss_implausibly_low", "loss_not_falling", "loss_oscillating", "lr_too_high", "mixed_precision_unstable",
           "nccl_timeout", "out_of_memory", "too_slow", "val_loss_rising", "warmup_steps"]

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
    start = _start_loss(run)
    if start is not None and start > 0 and tail >= 1.5 * start:
        return None  # it went up, far above where it started: loss_diverging's (its causes are not "too small")
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
    """Where the loss started: the mean of the first 3 logged values, leaving out those that had already
    blown up (>= 1.5x the first: an LR far too high makes step 1 worse than step 0 by orders of magnitude,
    and a start read from them would call any later loss "implausibly low")."""
    _, values = run.series("train/loss")
    head = [v for v in values[:3] if math.isfinite(v)]
    head = [v for v in head if v <= 1.5 * head[0]] if head and head[0] > 0 else head
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
    lower = ("lower the peak learning rate (optim.lr), keep gradient clipping on (optim.grad_clip=1.0), and run "
             "debug=grads to see which layer's gradients blow up first")
    lr = _peak_lr(run)
    if lr is not None and lr.usual is not None and lr.ratio < LR_FAR_ABOVE:
        # the LR is not the evidence here: what the checks named (a batch, a module, a scaled loss) comes first
        advice = (f"the peak LR ({lr.key}={lr_text(lr.typed)}) is under {LR_FAR_ABOVE:g}x the top of its usual range "
                  f"({lr.usual.text()}): look first at the cause the checks named (the first non-finite module: "
                  "nan_triage; the spiking batch: loss_spike, debug=data; a layer's gradients: debug=grads); then "
                  "a longer warm-up (optim.scheduler.warmup_ratio) or a lower optim.lr")
    else:
        advice = lower
    return _finding("loss_diverging", "error", f"{message}; {_lr_text(run)}", advice, step=bad[0] if bad else None)


# ---- the learning rate as the cause: far above its usual range AND the loss diverged ---------------------
LR_FAR_ABOVE = 10.0  # x the top of the usual range: an order of magnitude, not a tuning choice
_RISE = 1.5  # a loss this many times the untrained model's (or its own minimum) after updates: diverged
# findings that a too-high LR produces: they join the LR's incident as its evidence (by their cause)
_LR_SYMPTOMS = {
    "loss_spike": ("loss_spike", "loss_spike_skipped", "loss_spike_rollback", "loss_spike_persistent"),
    "grad_monitor": ("grad_exploding", "grad_spike", "nonfinite_grad"),
    "layer_health": ("layer_grad_exploding",),
    "nan_triage": ("nan_reproducible", "nan_step", "nan_transient"),
    "mixed_precision": ("overflow_streak", "loss_scale_min", "frequent_overflow"),
}
_ADVISOR_SYMPTOMS = ("advisor/loss_diverging", "advisor/loss_oscillating", "advisor/loss_not_falling")


class _PeakLR:
    """The run's peak LR as configured: the key a user sets, the value typed, the optimizer's (after LR
    scaling), and the usual range for its optimizer family and model size."""

    def __init__(self, key: str, typed: float, built: float, usual: UsualLR | None) -> None:
        self.key, self.typed, self.built, self.usual = key, typed, built, usual
        self.ratio = built / usual.top if usual is not None else 0.0


def _number(value: Any) -> float | None:
    """A config or details value as a float (a NaN string too); None for anything else."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _model_params(run: RunData) -> float | None:
    """Total parameters, from what a check recorded (memory's model_states: Psi); None when none did."""
    for f in run.findings:
        details = f.get("details") if isinstance(f.get("details"), dict) else {}
        if f.get("check") == "memory" and f.get("code") in ("model_states", "model_states_unexpected"):
            psi = _number(details.get("psi"))
            if psi:
                return psi
    return None


def _global_batch(run: RunData) -> int | None:
    batch = _number(run.cfg("data.global_batch_size"))
    if batch:
        return int(batch)
    micro = _number(run.cfg("data.batch_size"))
    if not micro:
        return None
    accumulate = _number(run.cfg("trainer.accumulate_grad_batches")) or 1
    world = _number(run.metrics.get("world_size")) or 1
    return int(micro * accumulate * world)


def _peak_lr(run: RunData) -> _PeakLR | None:
    """From the resolved config (``optim.lr``; ``optim.optimizer.lr`` is what the optimizer got after LR scaling;
    the family from ``optim.optimizer._target_``); a run without that config (a plain Lightning project): the
    logged LR curve's peak and its optimizer's name (``lr-AdamW``)."""
    lr_keys = run.keys("lr-")  # LearningRateMonitor: lr-<optimizer class>[/pg<i>]
    logged_name = lr_keys[0][len("lr-"):].split("/")[0] if lr_keys else None
    target = run.cfg("optim.optimizer._target_")
    optimizer = target if isinstance(target, str) else logged_name
    typed, built = _number(run.cfg("optim.lr")), _number(run.cfg("optim.optimizer.lr"))
    if typed is not None and typed > 0:
        built = built if built is not None and built > 0 else typed
        return _PeakLR("optim.lr", typed, built, usual_lr(optimizer, _model_params(run), _global_batch(run)))
    values = [v for key in lr_keys for v in run.series(key)[1] if math.isfinite(v)]
    if not values or max(values) <= 0:
        return None
    return _PeakLR(f"the optimizer's peak LR ({lr_keys[0]})", max(values), max(values),
                   usual_lr(optimizer, _model_params(run), _global_batch(run)))


def _loss_points(run: RunData) -> dict[int, float]:
    """step -> training loss: the logged curve, and the losses loss_spike recorded at the steps it judged (the
    curve may be logged every 10 steps; a spike finding keeps the step's own loss)."""
    points = {s: v for s, v in zip(*run.series("train/loss")) if s >= 0}
    for f in run.findings:
        details = f.get("details") if isinstance(f.get("details"), dict) else {}
        loss = _number(details.get("loss"))
        if (f.get("code") in _LR_SYMPTOMS["loss_spike"] and f.get("check") == "loss_spike" and isinstance(f.get("step"), int)
                and loss is not None):
            points.setdefault(f["step"], loss)
    return dict(sorted(points.items()))


def _untrained_loss(run: RunData, points: dict[int, float]) -> tuple[float, str] | None:
    """The loss before any update: train/loss at step 0, else the validation before training."""
    if 0 in points and math.isfinite(points[0]) and points[0] > 0:
        return points[0], "train/loss at step 0"
    before = _number(run.metrics.get("val/loss_at_start"))
    if before is None:
        steps, values = run.series("val/loss")
        before = values[0] if steps and steps[0] == 0 else None
    if before is not None and math.isfinite(before) and before > 0:
        return before, "val/loss before training"
    return None


def _loss_scale(run: RunData, start: float | None) -> float | None:
    """What a large change of the loss is measured against: an untrained causal LM's loss, ln(vocab) (the
    model's or the data's vocab_size), else the loss before any update."""
    vocab = _number(run.cfg("model.net.vocab_size")) or _number(run.cfg("data.vocab_size"))
    return math.log(vocab) if vocab and vocab >= 2 else start


def _divergence(run: RunData) -> dict[str, Any] | None:
    """Evidence that updates made the loss diverge (steps >= 1: step 0's loss is before any update): non-finite;
    >= 1.5x the loss before any update; or up >= 1.5x from its minimum -- each rise also by >= 0.1 ln(vocab)
    (0.83 nats at vocab 4096: a wiggle near zero, of a model that sees its answer or memorised a batch, is no
    evidence; ln(vocab) is an untrained causal LM's loss, the scale the early priors use). None when there is
    none."""
    points = _loss_points(run)
    after = [(s, v) for s, v in points.items() if s >= 1]
    if not after:
        return None
    start = _untrained_loss(run, points)
    out: dict[str, Any] = {"start": start[0] if start else None, "start_from": start[1] if start else None}
    onsets = []
    bad = next((s for s, v in after if not math.isfinite(v)), None)
    if bad is not None and math.isfinite(points.get(0, 0.0)):  # non-finite before any update: not the LR's
        out["nonfinite_step"] = bad
        onsets.append(bad)
    finite = [(s, v) for s, v in after if math.isfinite(v)]
    margin = 0.1 * (_loss_scale(run, start[0] if start else None) or (finite[0][1] if finite else 0.0))
    if start is not None:
        worse = next(((s, v) for s, v in finite if v >= _RISE * start[0] and v - start[0] >= margin), None)
        if worse is not None:
            out["worse"] = worse
            onsets.append(worse[0])
    if finite:
        low_step, low = min(finite, key=lambda p: p[1])
        rise = next(((s, v) for s, v in finite if s > low_step and v >= _RISE * low and v - low >= margin), None)
        if rise is not None:
            out["rise"] = (low_step, low, *rise)
            onsets.append(rise[0])
        out["peak"] = max(finite, key=lambda p: p[1])
    if not onsets:
        return None
    out["onset"] = min(onsets)
    return out


def _times(ratio: float) -> str:
    """3.75x, 98x, 3000x, 1e6x."""
    return f"{ratio:.3g}x" if ratio < 100 else f"{ratio:.0f}x" if ratio < 1e5 else f"{lr_text(ratio)}x"


def _divergence_text(div: dict[str, Any]) -> str:
    parts = []
    start = div.get("start")
    if start is not None:
        parts.append(f"{start:.4g} before any update ({div['start_from']})")
    if "worse" in div:
        s, v = div["worse"]
        parts.append(f"{v:.4g} at step {s} ({_times(v / start)})")
    elif "rise" in div:
        low_step, low, s, v = div["rise"]
        parts.append(f"down to {low:.4g} at step {low_step}, then {v:.4g} at step {s}")
    peak = div.get("peak")
    shown = {div["worse"][0]} if "worse" in div else {div["rise"][2]} if "rise" in div else set()
    if peak is not None and peak[0] not in shown and (start is None or peak[1] > start):
        parts.append(f"up to {peak[1]:.4g} at step {peak[0]}")
    if "nonfinite_step" in div:
        parts.append(f"non-finite from step {div['nonfinite_step']}")
    return ", ".join(parts)


def _grad_evidence(run: RunData, onset: int) -> str | None:
    """The first gradient finding of a too-high LR from the onset on (grad_monitor names the norm), else the
    logged global norm's rise."""
    for f in run.findings:
        step = f.get("step")
        details = f.get("details") if isinstance(f.get("details"), dict) else {}
        if (f.get("check") == "grad_monitor" and f.get("code") in ("grad_exploding", "grad_spike")
                and isinstance(step, int) and step >= onset - 1 and _number(details.get("norm")) is not None):
            return f"gradient norm {float(details['norm']):.4g} at step {step} (grad_monitor/{f['code']})"
    steps, norms = run.series("grad/norm/global")
    pairs = [(s, v) for s, v in zip(steps, norms) if math.isfinite(v)]
    if len(pairs) >= 2:
        top = max(pairs, key=lambda p: p[1])
        if top[1] >= 10 * pairs[0][1] > 0:
            return f"global gradient norm {pairs[0][1]:.3g} at step {pairs[0][0]} -> {top[1]:.4g} at step {top[0]}"
    return None


def _lr_at(run: RunData, step: int) -> float | None:
    values = [dict(zip(*run.series(key))).get(step) for key in run.keys("lr-")]
    values = [v for v in values if v is not None and math.isfinite(v)]
    return max(values) if values else None


def _explained_causes(run: RunData, div: dict[str, Any]) -> list[str]:
    """The incidents this finding accounts for (``incidents.group`` roots them here): the causes
    (``incidents.cause_of``) of the symptom findings whose first one is at or after the onset (a spike or a
    NaN before the first update is not the LR's), and the advisor's own curve rules."""
    onset = div["onset"]
    first: dict[str, int] = {}
    for f in run.findings:
        if f.get("code") not in _LR_SYMPTOMS.get(str(f.get("check")), ()) or f.get("severity") not in ("error", "warning"):
            continue
        step = f["step"] if isinstance(f.get("step"), int) else onset
        cause = cause_of(f)
        first[cause] = min(first.get(cause, step), step)
    causes = [c for c, s in first.items() if s >= onset]
    if div.get("nonfinite_step") is not None and first.get("nonfinite", onset) >= onset and "nonfinite" not in causes:
        causes.append("nonfinite")  # the advisor's loss_diverging on a non-finite curve is filed there
    return causes + [c for c in _ADVISOR_SYMPTOMS if c not in causes]


def lr_too_high(run: RunData) -> dict | None:
    lr = _peak_lr(run)
    if lr is None or lr.usual is None or lr.ratio < LR_FAR_ABOVE:
        return None
    div = _divergence(run)
    if div is None:
        return None  # an LR far above the range but a loss that did not diverge: no evidence, no advice
    onset, usual = div["onset"], lr.usual
    scaled = abs(lr.built - lr.typed) > 1e-12 * lr.typed
    set_text = f"{lr.key}={lr_text(lr.typed)}" + (f" (the optimizer's {lr_text(lr.built)} after LR scaling, "
                                                  "optim.scale_lr_base_batch_size)" if scaled else "")
    evidence = [_divergence_text(div)]
    at_onset = _lr_at(run, onset)
    if at_onset is not None:
        evidence.append(f"the LR at step {onset}: {lr_text(at_onset)}")
    grads = _grad_evidence(run, onset)
    if grads:
        evidence.append(grads)
    try_lr = suggestion(usual, lr.typed / lr.built)  # in the units of the key the user sets
    why = ("Adam-family steps are ~lr per weight whatever the gradient's size, so clipping cannot shrink them; "
           if usual.family in ("adam", "lion") else "")
    key = lr.key if lr.key == "optim.lr" else "the optimizer's lr"
    advice = (f"set {key}={lr_text(try_lr)} (the top of the usual range) and, if the loss still spikes, go down "
              f"by 3x ({lr_text(try_lr / 3)}); {why}keep the warm-up (optim.scheduler.warmup_ratio) and clipping "
              "(optim.grad_clip=1.0). This is advice: the run's settings were not changed")
    return _finding(
        "lr_too_high", "error",
        f"the learning rate is the likely cause: {set_text} is {_times(lr.ratio)} the top of the usual peak LR, "
        f"{usual.text()}; the loss diverged from step {onset} on: " + "; ".join(evidence),
        advice, step=onset, lr=lr.typed, peak_lr=lr.built, ratio=lr.ratio, family=usual.family,
        usual_low=usual.low, usual_top=usual.top, basis=usual.basis, params=_model_params(run),
        try_lr=try_lr, onset=onset, loss_start=div.get("start"), nonfinite_step=div.get("nonfinite_step"),
        explains=_explained_causes(run, div),
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
    loss_not_falling, loss_oscillating, loss_implausibly_low, loss_diverging, lr_too_high, val_loss_rising, out_of_memory,
    too_slow,
    nccl_timeout, mixed_precision_unstable, checkpoint_restore_failed,
]


def evaluate(run: RunData) -> list[dict[str, Any]]:
    """Every rule that fires, in table order."""
    return [f for f in (rule(run) for rule in RULES) if f is not None]
