"""Post-training int8 quantization of the exported net (``export.int8=true``), with its price measured.

Dynamic int8 quantization of every ``nn.Linear`` (weights stored as int8 with a per-tensor scale,
activations quantized on the fly; CPU inference) through ``torch.ao.quantization.quantize_dynamic``,
which ships with torch (torchao's ``quantize_`` is its successor; not a dependency here). Embeddings
and the fused MoE expert tensors of the DeepSeek nets are not ``nn.Linear`` and stay fp32.

The price is measured, not assumed: the size of the int8 state dict against the fp32 one (both as
``torch.save`` writes them) and the validation perplexity of both nets on the same batches.

| finding | severity | meaning |
|---|---|---|
| ``export/int8_quantized`` | info | sizes (bytes, ratio), validation perplexity fp32 -> int8 and the change |
| ``export/int8_ppl_change`` | warning | the int8 net's validation perplexity is more than ``MAX_PPL_CHANGE`` away from fp32's (either way: int8 is not the model that was validated) |

Rank 0 only, after fit, on CPU; no collective.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from dsdebug.findings import Finding, get_channel

__all__ = ["quantize_int8", "state_bytes", "val_perplexity", "val_batches", "export_int8", "MAX_PPL_CHANGE"]

log = logging.getLogger(__name__)

MAX_PPL_CHANGE = 0.05  # relative: int8 perplexity off fp32's by more than 5 % is a warning


def quantize_int8(net: nn.Module) -> nn.Module:
    """A copy of ``net`` with every ``nn.Linear`` dynamically quantized to int8 (``net`` is left as is)."""
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notice: torchao is its successor
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(net).float().eval().cpu(), {nn.Linear},
                                                      dtype=torch.qint8)


def state_bytes(net: nn.Module) -> int:
    """Bytes of ``torch.save(net.state_dict())``: what the export file weighs."""
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    return buffer.tell()


@torch.no_grad()
def val_perplexity(net: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> float:
    """exp(mean next-token cross-entropy) over ``batches``, as the module's ``val/ppl`` computes it."""
    net.eval()
    losses = []
    for batch in batches:
        ids = batch["input_ids"].cpu()
        labels = batch.get("labels", ids).cpu()
        out = net(input_ids=ids)
        logits = out.logits if hasattr(out, "logits") else out
        losses.append(float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                            labels[:, 1:].reshape(-1), ignore_index=-100)))
    if not losses:
        return float("nan")
    return math.exp(min(sum(losses) / len(losses), 20.0))


def val_batches(datamodule: Any, limit: Any = None) -> list[dict[str, torch.Tensor]]:
    """The validation batches the fit validated on: ``limit`` as ``trainer.limit_val_batches`` reads
    (an int = that many batches, a float = that fraction, None = all)."""
    loader = datamodule.val_dataloader()
    total = len(loader)
    if isinstance(limit, bool) or limit is None:
        count = total
    elif isinstance(limit, int):
        count = min(limit, total)
    else:
        count = max(1, round(float(limit) * total)) if float(limit) > 0 else 0
    batches = []
    for i, batch in enumerate(loader):
        if i >= count:
            break
        batches.append(batch)
    return batches


def export_int8(net: nn.Module, out_path: Path, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Quantize ``net`` (fp32 weights loaded), write its state dict to ``out_path``, and measure size
    and validation perplexity against ``net``. Returns the facts (also a finding)."""
    net = net.float().eval().cpu()
    quantized = quantize_int8(net)
    torch.save(quantized.state_dict(), out_path)
    fp32_bytes, int8_bytes = state_bytes(net), out_path.stat().st_size
    ppl_fp32, ppl_int8 = val_perplexity(net, batches), val_perplexity(quantized, batches)
    change = ppl_int8 / ppl_fp32 - 1 if ppl_fp32 > 0 and math.isfinite(ppl_fp32) else float("nan")
    linear = sum(isinstance(m, nn.Linear) for m in net.modules())
    facts = {"path": str(out_path), "fp32_bytes": fp32_bytes, "int8_bytes": int8_bytes,
             "size_ratio": round(int8_bytes / fp32_bytes, 4), "val_ppl_fp32": round(ppl_fp32, 4),
             "val_ppl_int8": round(ppl_int8, 4), "val_ppl_change": round(change, 5),
             "val_batches": len(batches), "quantized_linear": linear}
    summary = (f"int8 export {out_path.name}: {int8_bytes / 1e6:.3g} MB vs fp32 {fp32_bytes / 1e6:.3g} MB "
               f"(x{int8_bytes / fp32_bytes:.2f}, {linear} Linear layers int8); validation perplexity "
               f"{ppl_fp32:.4g} -> {ppl_int8:.4g} ({100 * change:+.2f}%) on {len(batches)} batches")
    channel = get_channel()
    channel.report(Finding("export", "info", "int8_quantized", summary, details=facts))
    if not abs(change) <= MAX_PPL_CHANGE:  # NaN included: no perplexity to compare is not a pass
        channel.report(Finding(
            "export", "warning", "int8_ppl_change",
            f"the int8 export's validation perplexity is {100 * change:+.2f}% against fp32 "
            f"({ppl_fp32:.4g} -> {ppl_int8:.4g}; more than {100 * MAX_PPL_CHANGE:.0f}% off)",
            advice="keep the fp32/bf16 export for this model (outlier weights make int8's per-tensor scale "
                   "coarse), quantize fewer layers, or try torchao's weight-only int8", details=facts))
    return facts
