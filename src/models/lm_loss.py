"""The next-token cross-entropy of ``CausalLMModule`` (``model.cross_entropy``), from the logits the net returns.

``full`` (the reference and the default): ``logits[:, :-1]`` reshaped (a copy: the slice is
not contiguous), ``.float()`` (an fp32 copy of the whole logits), ``F.cross_entropy``, which keeps the fp32
log-probabilities for its backward; backward makes another fp32 tensor of the logits' size and casts it back. For
the GPU kit's model (8 x 2048 tokens, vocabulary 32768) each fp32 tensor is 2 GiB.

``chunked`` (opt-in until a GPU measures it, docs/gpu.md): the labels are shifted instead of the logits (the last position gets ``-100``, so no copy of
the logits), and :class:`ChunkedCrossEntropy` walks the tokens in chunks of ``CHUNK_ELEMENTS`` logits: per chunk,
fp32 log-sum-exp, the loss, and the gradient ``softmax - onehot`` (fp32), stored in the logits' dtype. Backward is
that stored gradient times the incoming scalar. Nothing of the logits' size is ever fp32; the extra memory is one
tensor of the logits' size and dtype, where ``full`` keeps an fp32 one (2x) plus transient fp32 copies. The
gradient is computed in the forward only when the logits require grad and grad is enabled (validation and
``no_grad`` forwards compute the loss alone).

Same maths: in fp32 the two agree to rounding (loss ~1e-7 relative, summed in another order); with bf16/fp16
logits the gradient is rounded to the logits' dtype once before the scale and once after (``full`` rounds once,
after): within one unit in the last place of that dtype. ``tests/models/test_fast_paths.py`` holds both to it,
with ``ignore_index`` rows, ragged chunks and the ``sum`` reduction the document-row loss uses.

The logits themselves are untouched (``out.logits`` is still what the net returned, for the checks and probes
that read it). Runs on every rank; no collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dsdebug.models.kernel_options import cross_entropy_mode

__all__ = ["CHUNK_ELEMENTS", "IGNORE_INDEX", "ChunkedCrossEntropy", "next_token_loss"]

IGNORE_INDEX = -100
#: logits per chunk: 2**25 fp32 = 128 MiB per temporary (1024 tokens at vocabulary 32768)
CHUNK_ELEMENTS = 2 ** 25


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, mode: str = "full", reduction: str = "mean",
                    chunk_rows: int | None = None) -> torch.Tensor:
    """Cross-entropy of position t's logits against token t+1 of ``labels`` ([B, T, V] and [B, T]), ``-100``
    ignored; ``reduction`` "mean" (over the counted tokens) or "sum". ``mode``: "chunked" or "full"."""
    mode = cross_entropy_mode(mode)
    vocab = logits.size(-1)
    if mode == "full":
        flat, targets = logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1)
        return F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)  # shift the labels, not the logits
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // vocab)
    total = ChunkedCrossEntropy.apply(logits.reshape(-1, vocab), targets, rows)
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r}; valid: 'mean', 'sum'")
    return total / (targets != IGNORE_INDEX).sum()


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``logits`` [N, V] against ``targets`` [N] (``IGNORE_INDEX`` rows count 0), in fp32
    per chunk of ``chunk_rows`` rows; the gradient is made in the forward, in the logits' dtype."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        keep_grad = ctx.needs_input_grad[0]
        # fp16 would flush small probabilities to zero before the loss scale lifts them: kept in fp32 there
        stored = torch.float32 if logits.dtype == torch.float16 else logits.dtype
        grad = torch.empty_like(logits, dtype=stored) if keep_grad else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.size(0), chunk_rows):
            x = logits[start:start + chunk_rows].float()
            t = targets[start:start + chunk_rows]
            valid = t != IGNORE_INDEX
            safe = torch.where(valid, t, 0).unsqueeze(1)
            lse = torch.logsumexp(x, dim=1, keepdim=True)
            # an ignored row adds 0 even when its logits are not finite (as F.cross_entropy's ignore_index)
            total += torch.where(valid, (lse - x.gather(1, safe)).squeeze(1), 0.0).sum()
            if keep_grad:
                d = (x - lse).exp_()  # softmax
                d.scatter_add_(1, safe, torch.full_like(lse, -1.0))  # - onehot(target)
                grad[start:start + chunk_rows] = d.mul_(valid.unsqueeze(1))
        ctx.save_for_backward(grad)
        ctx.chunk_rows, ctx.dtype = chunk_rows, logits.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (grad,) = ctx.saved_tensors
        if grad.dtype == torch.float32 and ctx.dtype == torch.float32:
            return grad * grad_total, None, None
        # the scale multiplies in fp32 (a bf16 copy of it would be off by up to 2**-8), chunk by chunk
        out = torch.empty_like(grad, dtype=ctx.dtype)
        for start in range(0, grad.size(0), ctx.chunk_rows):
            out[start:start + ctx.chunk_rows] = grad[start:start + ctx.chunk_rows].float() * grad_total
        return out, None, None
