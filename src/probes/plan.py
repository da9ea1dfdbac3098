"""Probe: the run's plan, computed up front. Each part names the config key to change:

- the LR schedule over the whole run (``lr_curve``): the step the peak is reached (warmup vs
  ``trainer.max_steps``), the peak, the final LR; a schedule that never reaches ``optim.lr`` fails;
- the clip threshold against the gradient norm measured at step 0: clipping that shrinks every
  update by orders of magnitude (``optim.grad_clip``);
- distinct samples the run will see vs samples it trains on: many epochs over a tiny dataset
  (memorisation, not learning: ``data.max_tokens`` / more data / fewer ``trainer.max_steps``);
- the fraction of tokens that count in the loss (labels != -100);
- values the framework or Lightning adjusted from what the user asked (``adjustments``): each is a
  warning naming the key.

``run_plan(...)`` is pure arithmetic on what the caller measured. Local: no collective."""

from __future__ import annotations

import math
from typing import Any, Callable

from dsdebug.probes.result import ProbeResult

__all__ = ["run_plan", "lr_curve", "plan_of_run"]

NAME = "plan"


def lr_curve(make_scheduler: Callable[[Any], Any] | None, lr: float, total_steps: int, cap: int = 200_000) -> list[float]:
    """The LR of every optimizer step of the run (``cap`` steps at most), from the run's scheduler
    factory applied to a throwaway optimizer; a constant ``lr`` without one."""
    import torch

    if make_scheduler is None:
        return [lr] * min(total_steps, cap)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make_scheduler(opt)
    out = []
    for _ in range(min(total_steps, cap)):
        out.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return out


def run_plan(lrs: list[float], lr: float, total_steps: int, clip: float | None, grad_norm: float | None,
             dataset_samples: int | None, samples_per_step: int, loss_token_fraction: float | None,
             adjustments: list[tuple[str, str]] = (), epochs_warn: float = 4.0, epochs_fail: float = 50.0,
             shrink_warn: float = 10.0, shrink_fail: float = 100.0,
             warmup_key: str = "optim.scheduler.warmup_ratio") -> ProbeResult:
    """``warmup_key``: the key the run's warmup comes from (the one the user set: warmup_steps wins over the
    ratio), named when the warmup is too long."""
    fails: list[tuple[str, str, str]] = []  # (culprit key, message, advice)
    warns: list[tuple[str, str, str]] = []
    facts: list[str] = []
    details: dict[str, Any] = {"total_steps": total_steps, "lr": lr}
    if lrs:
        peak = max(lrs)
        peak_step = lrs.index(peak)
        details.update(peak_lr=peak, peak_step=peak_step, final_lr=lrs[-1], first_lr=lrs[0])
        facts.append(f"LR {lrs[0]:.2g} -> peak {peak:.2g} at step {peak_step} of {total_steps} -> final {lrs[-1]:.2g}")
        if peak <= 0:
            fails.append(("optim.lr", "the LR is 0 over the whole run: nothing trains", "set optim.lr > 0"))
        elif peak < 0.95 * lr:
            fails.append((warmup_key,
                          f"the schedule never reaches optim.lr={lr:.2g} (peak {peak:.2g} at step {peak_step}): the "
                          f"warmup is longer than the run ({total_steps} steps)",
                          "shorten the warmup (optim.scheduler.warmup_ratio / warmup_steps) or raise trainer.max_steps"))
        elif peak_step > 0.5 * total_steps:
            warns.append((warmup_key, f"the LR peaks only at step {peak_step} of {total_steps}",
                          f"shorten the warmup ({warmup_key})"))
    if clip and grad_norm:
        shrink = grad_norm / clip
        details.update(clip=clip, grad_norm=grad_norm, clip_shrink=shrink)
        facts.append(f"grad norm {grad_norm:.3g} vs clip {clip:g}")
        if shrink >= shrink_fail:
            fails.append(("optim.grad_clip", f"the gradient norm at step 0 ({grad_norm:.3g}) is {shrink:.0f}x the clip "
                          f"threshold ({clip:g}): every update is shrunk by orders of magnitude",
                          f"raise optim.grad_clip (to ~{grad_norm:.2g}) or find why the gradients are so large"))
        elif shrink >= shrink_warn:
            warns.append(("optim.grad_clip", f"the gradient norm at step 0 ({grad_norm:.3g}) is {shrink:.0f}x the clip "
                          f"threshold ({clip:g})", "raise optim.grad_clip if it stays so"))
    if dataset_samples:
        trained = total_steps * samples_per_step
        epochs = trained / dataset_samples
        details.update(dataset_samples=dataset_samples, trained_samples=trained, epochs=round(epochs, 2))
        facts.append(f"{trained} samples trained over {dataset_samples} distinct ({epochs:.1f} epochs)")
        what = (f"the run trains on {trained} samples but the dataset has {dataset_samples} distinct ones: "
                f"{epochs:.0f} epochs over the same sequences (memorisation, not learning)")
        advice = "use more data (data.max_tokens, another corpus) or fewer trainer.max_steps"
        if epochs >= epochs_fail:
            fails.append(("data.max_tokens", what, advice))
        elif epochs >= epochs_warn:
            warns.append(("data.max_tokens", what, advice))
    if loss_token_fraction is not None:
        details["loss_token_fraction"] = round(loss_token_fraction, 4)
        facts.append(f"{loss_token_fraction:.0%} of tokens count in the loss")
        if loss_token_fraction == 0:
            fails.append(("data: labels", "no token counts in the loss (every label is -100)",
                          "check the labels the data module builds"))
        elif loss_token_fraction < 0.1:
            warns.append(("data: labels", f"only {loss_token_fraction:.1%} of tokens count in the loss",
                          "check the label masking (-100) of the data module"))
    for key, text in adjustments:
        warns.append((key, text, f"set {key} to the value you want explicitly, or accept it"))
    details["fails"] = [f[1] for f in fails]
    details["warnings"] = [w[1] for w in warns]
    summary = "; ".join(facts)
    if fails:
        key, text, advice = fails[0]
        more = f" (+{len(fails) - 1} more)" if len(fails) > 1 else ""
        return ProbeResult(NAME, "fail", f"{text}{more}; plan: {summary}", key, advice, details)
    if warns:
        key, text, advice = warns[0]
        more = f" (+{len(warns) - 1} more: " + "; ".join(w[1] for w in warns[1:]) + ")" if len(warns) > 1 else ""
        return ProbeResult(NAME, "warn", f"{text}{more}; plan: {summary}", key, advice, details)
    return ProbeResult(NAME, "pass", summary, details=details)


def epochs_of(total_steps: int, samples_per_step: int, dataset_samples: int) -> float:
    return total_steps * samples_per_step / dataset_samples if dataset_samples else math.inf


def plan_of_run(trainer: Any, pl_module: Any, batch: dict, loader: Any = None, clip: float | None = None,
                grad_norm: float | None = None, adjustments: list[tuple[str, str]] = ()) -> ProbeResult:
    """``run_plan`` with what a Lightning run holds: the LR of its first optimizer, its scheduler factory
    (``pl_module.scheduler_factory(opt, total_steps=)``), the optimizer steps it will take, the dataset
    behind ``loader`` (default: the train loader Lightning holds) and ``batch`` (a train batch of this
    rank: its size, the fraction of labels that count). Local: no collective."""
    group = trainer.optimizers[0].param_groups[0]
    lr = float(group.get("initial_lr", group["lr"]))
    total = trainer.estimated_stepping_batches
    total = int(total) if total != float("inf") else int(trainer.max_steps if trainer.max_steps > 0 else 1000)
    factory = getattr(pl_module, "scheduler_factory", None)
    make = (lambda o: factory(o, total_steps=total)) if factory is not None else None
    lrs = lr_curve(make, lr, total)
    if loader is None:
        loader = getattr(trainer, "train_dataloader", None)
    dataset = getattr(loader, "dataset", None)
    size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
    ids = batch["input_ids"]
    per_step = int(ids.shape[0]) * int(trainer.accumulate_grad_batches) * int(trainer.world_size)
    labels = batch.get("labels", ids)[:, 1:]
    fraction = float((labels != -100).float().mean()) if labels.numel() else None
    keywords = getattr(factory, "keywords", None) or {}
    key = "optim.scheduler.warmup_steps" if keywords.get("warmup_steps") is not None else "optim.scheduler.warmup_ratio"
    return run_plan(lrs, lr, total, clip, grad_norm, size, per_step, fraction, list(adjustments), warmup_key=key)

