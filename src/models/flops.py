"""Training FLOPs per token and peak FLOP/s: the MFU arithmetic.

Shared by ``benchmarks/scaling.py`` and the ``throughput`` check (``src/callbacks/throughput.py``).
MFU = tokens/s x training FLOPs per token / peak FLOP/s. FLOPs per token = 6 x active
non-embedding parameters (a MoE token runs top-k routed + shared experts, not all experts)
+ 6 x seq x heads x (qk_dim + v_dim) per layer for attention (PaLM's convention, causal mask not
discounted). Peak: a GPU's spec-sheet dense bf16 number (``GPU_PEAK_TFLOPS``), measured on CPU.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["GPU_PEAK_TFLOPS", "active_params", "flops_per_token", "gpu_peak_flops", "measure_peak_flops"]

# Dense bf16/fp16 tensor-core peak, TFLOP/s (vendor spec sheets, no sparsity), matched on
# torch.cuda.get_device_name() substrings; the first match wins (most specific first).
GPU_PEAK_TFLOPS = (
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("A10G", 125.0), ("A10", 125.0), ("L40S", 362.0),
    ("L40", 181.0), ("L4", 121.0), ("V100", 125.0), ("T4", 65.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0),
    ("MI300X", 1307.0), ("MI250X", 383.0),
)


def active_params(net: Any) -> tuple[int, int]:
    """(total, active per token) parameters, input embedding excluded from both.

    A MoE layer's routed experts count with weight top_k / n_routed (DeepSeek's
    ``mlp.experts``); shared experts, the router and everything else count fully. A net without
    ``model.layers`` (a custom net) counts every non-embedding parameter as active.
    """
    cfg = getattr(net, "config", None)
    get_emb = getattr(net, "get_input_embeddings", None)
    embedding = _numel(get_emb().weight) if callable(get_emb) else 0
    total = sum(_numel(p) for p in net.parameters()) - embedding
    routed = 0
    for layer in getattr(getattr(net, "model", None), "layers", None) or ():
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None:
            routed += sum(_numel(p) for p in experts.parameters())
    k, e = getattr(cfg, "num_experts_per_tok", 0) or 0, getattr(cfg, "n_routed_experts", 0) or 0
    inactive = routed * (1 - k / e) if e else 0
    return total, int(total - inactive)


def _numel(p: Any) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 partitions params: p.numel() is 0 there


def flops_per_token(net: Any, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward); 6 x params for a net without a config."""
    _, active = active_params(net)
    cfg = getattr(net, "config", None)
    if cfg is None or not getattr(cfg, "num_attention_heads", None):
        return 6.0 * active
    heads = cfg.num_attention_heads
    qk = getattr(cfg, "qk_nope_head_dim", 0) + getattr(cfg, "qk_rope_head_dim", 0) or cfg.hidden_size // heads
    v = getattr(cfg, "v_head_dim", None) or cfg.hidden_size // heads
    attention = 6 * seq_len * heads * (qk + v) * cfg.num_hidden_layers
    return 6 * active + attention


def measure_peak_flops(seconds: float = 2.0, n: int = 2048, best: bool = False) -> float:
    """fp32 matmul FLOP/s on this machine with torch's intra-op threads: the mean rate over
    ``seconds``, or with ``best`` the fastest single matmul (robust to other processes sharing
    the cores: they can only slow a matmul down)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    done, start, fastest = 0, time.perf_counter(), float("inf")
    while (now := time.perf_counter()) - start < seconds:
        torch.mm(a, b)
        fastest = min(fastest, time.perf_counter() - now)
        done += 1
    flop = 2 * n ** 3
    return flop / fastest if best else done * flop / (time.perf_counter() - start)


def gpu_peak_flops(device_name: str) -> float | None:
    """Spec-sheet dense bf16 FLOP/s of a GPU by name; None when the table does not know it."""
    for key, tflops in GPU_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None
