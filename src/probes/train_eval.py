"""Probe: train/eval consistency. The eval-mode forward is finite and equals the train-mode forward
once stochastic layers are off (dropout p=0).

Breaks by a layer whose eval path differs from its train path beyond randomness: BatchNorm's
running statistics against the batch's, a hand-written dropout that rescales in eval, a branch on
``self.training`` that changes the math, an eval-only path that divides by an untrained statistic
(non-finite). The first module (forward order) whose outputs part is named.

Dropout is what the probe switches off, wherever it is: ``nn.Dropout*`` modules, float attributes named
``*dropout*``, and torch's functional dropout (``F.dropout``, SDPA's ``dropout_p``) whatever rate the
model passes. A train mode that is still random after that (a hand-written DropPath, noise) is legitimate:
it is compared in expectation (the mean of several train forwards against eval, beyond the randomness).

Works on a copy of the net (its dropout is zeroed). Usable on any net:
``train_eval(net, batch)``. Local: no collective."""

from __future__ import annotations

import copy
import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from dsdebug.probes.batch import as_batch
from dsdebug.probes.result import ProbeResult
from dsdebug.probes.tracing import ModuleTrace, differs, first_divergence, logits_of

__all__ = ["train_eval", "without_dropout", "dropout_off", "functional_dropout_off"]

NAME = "train_eval"


def without_dropout(net: nn.Module) -> nn.Module:
    """``net`` (in place) with every dropout off: ``nn.Dropout*`` p=0 and float attributes named
    ``*dropout*`` (HF attention reads ``self.attention_dropout`` in train mode) set to 0."""
    for module in net.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr, value in list(vars(module).items()):
            if "dropout" in attr.lower() and isinstance(value, float) and 0.0 < value < 1.0:
                setattr(module, attr, 0.0)
    return net


@contextmanager
def dropout_off(net: nn.Module) -> Iterator[nn.Module]:
    """``without_dropout`` for the duration of the block, every value and train/eval flag put back
    after (for probes on the run's own net)."""
    saved = [(m, "p", m.p) for m in net.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    saved += [(m, attr, value) for m in net.modules() for attr, value in list(vars(m).items())
              if "dropout" in attr.lower() and isinstance(value, float) and 0.0 < value < 1.0]
    modes = {m: m.training for m in net.modules()}
    try:
        yield without_dropout(net)
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
        for module, training in modes.items():
            module.training = training


@contextmanager
def functional_dropout_off() -> Iterator[None]:
    """torch's functional dropout at p=0 for the duration of the block: ``F.dropout`` and its 1d/2d/3d/alpha
    kinds, ``torch.dropout`` and ``F.scaled_dot_product_attention``'s ``dropout_p`` -- the dropout of nanoGPT's
    attention (``dropout_p=self.dropout if self.training else 0``) and of HF attention classes, whose rate
    lives wherever the author kept it (a config, a constant), not in a module the probe can zero. Looked up at
    call time through the module attribute, as those models call them."""
    import torch.nn.functional as F

    def at_zero(fn: Callable[..., Any], name: str, index: int) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) > index:
                args = (*args[:index], 0.0, *args[index + 1:])
            else:
                kwargs[name] = 0.0
            return fn(*args, **kwargs)
        return call

    targets = [(F, n, "p", 1) for n in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                                        "feature_alpha_dropout") if hasattr(F, n)]
    targets += [(torch, n, "p", 1) for n in ("dropout", "alpha_dropout", "feature_alpha_dropout") if hasattr(torch, n)]
    targets.append((F, "scaled_dot_product_attention", "dropout_p", 4))
    saved = [(owner, n, getattr(owner, n)) for owner, n, _, _ in targets]
    try:
        for owner, n, name, index in targets:
            setattr(owner, n, at_zero(getattr(owner, n), name, index))
        yield
    finally:
        for owner, n, fn in saved:
            setattr(owner, n, fn)


@torch.no_grad()
def train_eval(net: nn.Module, batch: dict, copy_net: bool = True, seed: int = 0, locate: bool = True,
               agree: Callable[[bool], bool] | None = None) -> ProbeResult:
    """``copy_net=False``: on ``net`` itself, its dropout and modes put back after. ``locate=False``: no
    module trace (a failure names ``<net>``; run again to name the module). ``agree``: ranks that run the net's
    forwards together (ZeRO-3) decide alike whether it is stochastic (``any_rank``): the number of forwards
    depends on it."""
    with dropout_off(copy.deepcopy(net) if copy_net else net) as probe, functional_dropout_off():
        return _train_eval(probe, as_batch(batch), seed, locate, agree)


# A train mode that stays random with every dropout off (a hand-written DropPath, noise injection) is compared
# in expectation: the mean of SAMPLES train forwards against the eval forward. Beyond randomness = the gap is
# more than REL_GAP of the eval output's size and more than NOISE_SIGMAS x the standard error of the mean (norms over
# the whole tensor; pure noise gives a gap about that standard error). Measured on the planted nets (16 samples, two
# batches): healthy stochastic depth gap/noise 0.4-0.7, gap 5 % of the size; an eval scaled by (1 - rate) 1.9-2.1 and
# 26-29 %. Healthy inverted randomness leaves a small gap (variance through the nonlinearities after
# it); an eval path scaled wrong leaves one of the order of the rate (tests/doctor/test_probes.py).
SAMPLES, REL_GAP, NOISE_SIGMAS = 16, 0.15, 1.5


def _train_eval(probe: nn.Module, batch: dict, seed: int, locate: bool,
                agree: Callable[[bool], bool] | None) -> ProbeResult:
    ids = batch["input_ids"]

    def forward(train: bool, s: int, trace: ModuleTrace | None = None) -> torch.Tensor:
        torch.manual_seed(s)
        probe.train(train)
        if trace is None:
            return logits_of(probe(input_ids=ids))
        with trace:
            return logits_of(probe(input_ids=ids))

    train_trace, eval_trace = ModuleTrace(probe, enabled=locate), ModuleTrace(probe, enabled=locate)
    train_out = forward(True, seed, train_trace)
    stochastic = bool(differs(train_out, forward(True, seed + 1), rtol=1e-3, atol=1e-4))
    if agree is not None:
        stochastic = agree(stochastic)
    eval_out = forward(False, seed, eval_trace)
    details: dict = {"stochastic": stochastic}
    if not torch.isfinite(eval_out).all():
        module = next((name for (name, _), t in eval_trace.records if not torch.isfinite(t).all()), "<net>")
        details["module"] = module
        return ProbeResult(NAME, "fail", f"the eval-mode forward is not finite; first non-finite output: {module}",
                           module, f"look at {module}'s eval path (running statistics, a division by an "
                           "untrained value, a branch on self.training)", details)
    if stochastic:
        return _in_expectation(probe, forward, train_out, eval_out, seed, locate, details)
    diff = differs(train_out, eval_out, rtol=1e-3, atol=1e-4)
    if diff:
        found = first_divergence(train_trace, eval_trace, lambda x: x, rtol=1e-3, atol=1e-4)
        module = found[0] if found else "<net>"
        details.update(module=module, where=found[2] if found else "in the net", max_abs_diff=diff)
        kind = type(dict(probe.named_modules()).get(module, probe)).__name__
        return ProbeResult(
            NAME, "fail", f"train and eval forwards differ (max |diff| {diff:.3g}) with dropout off; they part "
            f"at {module} ({kind})", module,
            f"make {module} compute the same in eval as in train (BatchNorm -> LayerNorm for sequences; a custom "
            "dropout must be identity in eval and rescale by 1/(1-p) in train; no other branch on self.training)",
            details)
    return ProbeResult(NAME, "pass", "train and eval forwards agree with dropout off; eval is finite", details=details)


def _gap(total: torch.Tensor, squares: torch.Tensor, n: int, eval_out: torch.Tensor) -> tuple[float, float, bool]:
    """(gap / size of eval, noise / size, beyond randomness) of the mean of ``n`` samples (their sum and sum of
    squares) against the eval output."""
    mean = total / n
    std = (squares / n - mean * mean).clamp_min(0).sqrt()
    gap, noise = float((mean - eval_out).norm()), float(std.norm()) / n ** 0.5
    size = max(float(eval_out.norm()), 1e-12)
    return gap / size, noise / size, gap > REL_GAP * size and gap > NOISE_SIGMAS * noise


def _in_expectation(probe: nn.Module, forward: Callable[..., torch.Tensor], first: torch.Tensor,
                    eval_out: torch.Tensor, seed: int, locate: bool, details: dict) -> ProbeResult:
    total, squares = first.double(), first.double() ** 2
    for k in range(1, SAMPLES):
        out = forward(True, seed + k).double()
        total, squares = total + out, squares + out * out
    rel, noise, beyond = _gap(total, squares, SAMPLES, eval_out.double())
    details.update(rel_gap=round(rel, 4), rel_noise=round(noise, 4), samples=SAMPLES)
    if not beyond:
        return ProbeResult(NAME, "pass", f"train mode stays random with dropout off; the mean of {SAMPLES} train "
                           f"forwards agrees with eval (gap {rel:.1%} of its size); eval is finite", details=details)
    module, where = ("<net>", "in the net") if not locate else _first_beyond(probe, forward, seed)
    details.update(module=module, where=where)
    kind = type(dict(probe.named_modules()).get(module, probe)).__name__
    return ProbeResult(
        NAME, "fail", f"the eval forward differs from the mean of {SAMPLES} train forwards by {rel:.0%} of its size "
        f"(beyond the train mode's randomness, {noise:.1%}); they part at {module} ({kind})", module,
        f"make {module} compute in eval what it computes on average in train (random layers: identity in eval, "
        "rescale by 1/(1-p) in train; BatchNorm -> LayerNorm for sequences)", details)


def _first_beyond(probe: nn.Module, forward: Callable[..., torch.Tensor], seed: int) -> tuple[str, str]:
    """The first module (completion order) whose mean train output is beyond randomness from its eval output."""
    sums: dict = {}
    for k in range(SAMPLES):
        trace = ModuleTrace(probe)
        forward(True, seed + k, trace)
        for key, t in trace.records:
            t = t.double()
            if key in sums and sums[key][0].shape == t.shape:
                sums[key] = (sums[key][0] + t, sums[key][1] + t * t)
            elif k == 0:
                sums[key] = (t, t * t)
    eval_trace = ModuleTrace(probe)
    forward(False, seed, eval_trace)
    for key, e in eval_trace.records:
        if key in sums and sums[key][0].shape == e.shape and _gap(*sums[key], SAMPLES, e.double())[2]:
            return key[0], f"in {key[0]}"
    return "<net>", "in the net"
