"""Probe: causality. The output at position t must not depend on inputs after t.

Two ways it breaks, both checked:
- the net: attention without a causal mask, a look-ahead (a roll/shift the wrong way, a
  non-causal conv or pooling over the sequence). The inputs from position ``cut`` on are replaced
  by other tokens; every module's output at positions < ``cut`` must stay the same. The first
  module (in the order modules finish their forward) whose early positions moved is named.
- the data: the target of position t is among its inputs (labels not shifted, or shifted the
  wrong way, so the model predicts a token it sees). The batch's targets are compared with the
  inputs at the same and earlier positions.

Usable on any net: ``causality(net, batch)``. Local: no collective."""

from __future__ import annotations

import torch

from dsdebug.probes.batch import as_batch, other_tokens, rows_positions, vocab_of
from dsdebug.probes.result import ProbeResult
from dsdebug.probes.tracing import ModuleTrace, differs, first_divergence, logits_of, restored_mode

__all__ = ["causality", "label_leak"]

NAME = "causality"


@torch.no_grad()
def causality(net: torch.nn.Module, batch: dict, cut: int | None = None, shifts_labels: bool = True,
              seed: int = 0, locate: bool = True) -> ProbeResult:
    """``locate=False``: compare the net's outputs only, no module trace (a failure names ``<net>``;
    run again with ``locate=True`` to name the module)."""
    batch = as_batch(batch)
    ids = batch["input_ids"]
    b, t = ids.shape[0], ids.shape[1]
    if t < 2:
        return ProbeResult(NAME, "skip", f"sequence length {t}: nothing to check")
    cut = t // 2 if cut is None else cut
    leak = label_leak(batch) if shifts_labels else None
    changed = ids.clone()
    g = torch.Generator().manual_seed(seed)
    with restored_mode(net):
        net.eval()
        vocab = vocab_of(net) if hasattr(net, "get_input_embeddings") else None
        with ModuleTrace(net, enabled=locate) as base:
            logits = logits_of(net(input_ids=ids))
        vocab = vocab or logits.shape[-1]
        changed[:, cut:] = other_tokens(ids[:, cut:], vocab, g)
        with ModuleTrace(net, enabled=locate) as moved:
            logits2 = logits_of(net(input_ids=changed))
    details = {"cut": cut, "seq_len": t}
    out_diff = differs(logits[:, :cut], logits2[:, :cut])

    def early(x: torch.Tensor) -> torch.Tensor | None:
        rows = rows_positions(x, b, t)
        return None if rows is None else rows[:, :cut]

    if out_diff:
        found = first_divergence(base, moved, early)
        module, place = (found[0], found[2]) if found else ("<net>", "in the net")
        first_pos = _first_position(logits, logits2, cut)
        details.update(module=module, where=place, max_abs_diff=out_diff, first_position=first_pos)
        return ProbeResult(
            NAME, "fail", f"the output at position {first_pos} changes when only tokens at positions >= {cut} "
            f"change: the model sees the future; the dependence first appears {place}", module,
            f"make {'the forward of the net itself' if module == '<net>' else module} causal: a causal attention mask (is_causal=True / a lower-triangular mask), "
            "no look-ahead along the sequence (roll/shift/conv/pooling over positions > t)", details)
    if leak is not None:
        k, rate = leak
        details.update(label_offset=k, match_rate=round(rate, 3))
        where = "its own input token" if k == 0 else f"the input token {k} positions before it"
        return ProbeResult(
            NAME, "fail", f"the data leaks the answer: the target of position t is {where} in {rate:.0%} of "
            "positions (the model is trained to predict a token it sees)", "data: labels",
            "labels must equal input_ids (the module shifts them: position t predicts labels[t+1]); "
            "do not shift them in the dataset too, or shift the other way", details)
    return ProbeResult(NAME, "pass", f"outputs at positions < {cut} do not depend on tokens at >= {cut}; "
                       "targets are not among their inputs", details=details)


def _first_position(a: torch.Tensor, b: torch.Tensor, cut: int) -> int:
    d = (a[:, :cut].float() - b[:, :cut].float()).abs().amax(dim=tuple(i for i in range(a.dim()) if i != 1))
    hits = torch.nonzero(d > 1e-5 + 1e-4 * float(a.abs().max())).flatten()
    return int(hits[0]) if hits.numel() else 0


def label_leak(batch: dict, max_offset: int = 4, threshold: float = 0.5) -> tuple[int, float] | None:
    """(k, rate) when the target of position t (labels[t+1], the module's shift) equals the input at
    t-k for more than ``threshold`` of the counted positions, for some k in [0, max_offset); natural
    text repeats a token far less often."""
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    targets = labels[:, 1:]
    mask = targets != -100
    for k in range(max_offset):
        if ids.shape[1] - 1 - k <= 0:
            break
        inp = ids[:, : ids.shape[1] - 1 - k]
        tgt, m = targets[:, k:], mask[:, k:]
        n = int(m.sum())
        if n == 0:
            continue
        rate = float(((inp == tgt) & m).sum()) / n
        if rate > threshold:
            return k, rate
    return None
