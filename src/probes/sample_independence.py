"""Probe: sample independence. One sample's output and gradient must not depend on another sample
of the batch.

Breaks by normalising over the batch (BatchNorm, a batch mean), or by a reshape/view that mixes the
batch and sequence dims (``x.view(T, B, H)`` of a [B, T, H] tensor). The last sample's tokens are
replaced; every module's output for the other samples must stay the same (the first module that
moved is named); and the gradient of the other samples' loss with respect to the last sample's
input embeddings must be zero.

Usable on any net: ``sample_independence(net, batch)``. Local: no collective."""

from __future__ import annotations

import torch

from dsdebug.probes.batch import as_batch, lm_loss, other_tokens, rows_positions
from dsdebug.probes.result import ProbeResult
from dsdebug.probes.tracing import ModuleTrace, differs, first_divergence, logits_of, restored_mode

__all__ = ["sample_independence"]

NAME = "sample_independence"


def sample_independence(net: torch.nn.Module, batch: dict, train_mode: bool = True, seed: int = 0,
                        locate: bool = True, grads: bool = True) -> ProbeResult:
    """``train_mode``: probe in train mode (where BatchNorm uses the batch's statistics), with the
    net's stochastic layers seeded alike for both forwards. The first and the last sample are
    changed in turn (a mix-up can flow towards later or earlier samples only). ``locate=False``: no
    module trace (a failure names ``<net>``); ``grads=False``: outputs only, no backward."""
    batch = as_batch(batch)
    ids = batch["input_ids"]
    b, t = ids.shape[0], ids.shape[1]
    if b < 2:
        return ProbeResult(NAME, "skip", "batch of 1: give the probe at least 2 samples")
    g = torch.Generator().manual_seed(seed)
    details: dict = {"batch": b}
    with restored_mode(net):
        net.train(train_mode)
        with torch.no_grad():
            torch.manual_seed(seed)
            with ModuleTrace(net, enabled=locate) as base:
                logits = logits_of(net(input_ids=ids))
            failure: ProbeResult | None = None
            for j in (b - 1, 0):  # both forwards always: a rank-independent count (ZeRO-3 gathers in each)
                keep = torch.arange(b) != j
                changed = ids.clone()
                changed[j] = other_tokens(ids[j], logits.shape[-1], g)
                torch.manual_seed(seed)
                with ModuleTrace(net, enabled=locate and failure is None) as moved:
                    logits2 = logits_of(net(input_ids=changed))
                out_diff = differs(logits[keep], logits2[keep])
                if not out_diff or failure is not None:
                    continue

                def others(x: torch.Tensor, keep: torch.Tensor = keep) -> torch.Tensor | None:
                    rows = rows_positions(x, b, t)
                    return None if rows is None else rows[keep]

                found = first_divergence(base, moved, others)
                module, place = (found[0], found[2]) if found else ("<net>", "in the net")
                details.update(module=module, where=place, max_abs_diff=out_diff, changed_sample=j)
                failure = ProbeResult(
                    NAME, "fail", f"other samples change when only sample {j} changes: samples of a batch "
                    f"leak into each other, first {place}", module,
                    f"{module} must treat samples independently: no normalisation over the batch (BatchNorm -> "
                    "LayerNorm/RMSNorm), no reshape/view that mixes batch and sequence dims (transpose, then "
                    "reshape)", details)
            if failure is not None:
                return failure
        j = b - 1
        grad = _cross_grad(net, batch, j, seed) if grads else None
    if grad is not None and grad > 0:
        details.update(cross_grad=grad)
        return ProbeResult(
            NAME, "fail", f"the loss of samples 0..{j - 1} has a gradient ({grad:.3g}) through sample {j}'s "
            "input embeddings: samples are coupled in backward", "backward", "look for ops that mix the batch "
            "dim in backward only (a custom autograd Function, a batch-wide reduction detached in forward)", details)
    return ProbeResult(NAME, "pass", f"no sample of {b} depends on another (outputs when the first or last "
                       "changes; gradients)", details=details)


def _cross_grad(net: torch.nn.Module, batch: dict, j: int, seed: int) -> float | None:
    """|d loss(samples != j) / d embeddings(sample j)|_max, through a hook on the input embeddings;
    None when the net has no ``get_input_embeddings``."""
    emb = getattr(net, "get_input_embeddings", lambda: None)()
    if emb is None:
        return None
    held: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        output = output.detach().requires_grad_(True)
        held.append(output)
        return output

    handle = emb.register_forward_hook(keep)
    try:
        torch.manual_seed(seed)
        with torch.enable_grad():
            logits = logits_of(net(input_ids=batch["input_ids"]))
            rest = {k: v[:j] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            loss = lm_loss(logits[:j], rest)
            if not held or not loss.requires_grad:
                return None
            (grad,) = torch.autograd.grad(loss, held[0], allow_unused=True)
    finally:
        handle.remove()
    return 0.0 if grad is None else float(grad[j].abs().max())
