"""``attn_implementation="sdpa_pad_v"``: PyTorch's fused attention kernels for MLA's unequal head sizes.

DeepSeek's MLA gives queries and keys a head size of ``qk_nope_head_dim + qk_rope_head_dim`` (128 in the
GPU kit's model, 48 in the tiny one) and values a smaller one (``v_head_dim``: 64 / 32). The flash kernels of
``torch.nn.functional.scaled_dot_product_attention`` need one head size for all three, so with HF's plain
``"sdpa"`` SDPA picks another backend: on CPU the unfused math kernel (it builds the whole
``[batch, heads, seq, seq]`` score matrix), on CUDA cuDNN attention where torch prefers it (the 2026-11-28 H100
trace ran ``aten::_cudnn_attention_backward``), else the memory-efficient kernel.

``sdpa_pad_v`` pads V with zeros to the query/key head size, calls transformers' own SDPA function (same mask,
causal and GQA handling as ``"sdpa"``) and slices the output back: ``softmax(QK^T) [V | 0] = [softmax(QK^T) V | 0]``,
so the result is the same maths; the flash kernels now apply (CPU: ``_scaled_dot_product_flash_attention_for_cpu``;
CUDA: flash or cuDNN, whichever SDPA ranks first). This is what transformers' own ``flash_attention_2`` path
does for MLA (``integrations/flash_attention.py``) and what torchtitan does for DeepSeek-V3. The cost: the
attention-times-V product runs at the padded width (for 128/64: +1/3 of the attention FLOPs, which are ~10 % of
the kit model's). Where the head sizes are equal it is exactly ``"sdpa"``.

Opt-in (``model.net.attn_implementation=sdpa_pad_v``; the default ``sdpa`` is the plain one, ``eager`` HF's
reference; docs/gpu.md says why); equality with both: ``tests/models/test_fast_paths.py``. It is registered with
transformers' ``AttentionInterface`` (and the SDPA mask with ``AttentionMaskInterface``) when this module is
imported (``dsdebug.models.deepseek`` imports it). Runs on every rank; no collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["SDPA_PAD_V", "sdpa_pad_v_attention_forward"]

SDPA_PAD_V = "sdpa_pad_v"


def sdpa_pad_v_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` with V zero-padded to the query/key head size; returns
    ``[batch, seq, heads, v_head_dim]`` as the unpadded call does."""
    v_dim, qk_dim = value.shape[-1], query.shape[-1]
    if v_dim >= qk_dim:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = sdpa_attention_forward(module, query, key, F.pad(value, [0, qk_dim - v_dim]), attention_mask,
                                          **kwargs)
    return out[..., :v_dim], weights


AttentionInterface.register(SDPA_PAD_V, sdpa_pad_v_attention_forward)
AttentionMaskInterface.register(SDPA_PAD_V, sdpa_mask)
