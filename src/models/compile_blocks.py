"""``model.compile=true``: ``torch.compile`` of each decoder block's forward, as torchtitan compiles per block.

Why per block: the blocks repeat, so one compiled graph serves every block of the same kind (DeepSeek: the dense
first layers and the MoE layers, two graphs), compilation stays short, and what runs between the blocks (the
embedding, the LM head, the loss, the checks) stays eager. Inductor fuses what eager runs as separate kernels:
RMSNorm's fp32 upcast/variance/scale, RoPE, SiLU x up, the router's sigmoid/top-k arithmetic, the residual adds.
The maths is unchanged (``tests/models/test_fast_paths.py``: outputs and gradients of compiled blocks equal the
eager ones within float rounding).

How: each block's ``forward`` (not ``__call__``) is replaced by a compiled one, so the block's own module hooks
(DeepSpeed's, the checks') stay outside the compiled code, as in ``grad_ckpt.py``; hooks on modules inside a block
(the MoE router capture of ``moe_aux.py``) are traced into it. Gradient checkpointing applied before (HF's
wrapper of the layer's forward, or ``grad_ckpt``'s) is compiled with the block: torch traces non-reentrant
checkpointing as one region. Blocks: a Hugging Face model's decoder layers (``GradientCheckpointingLayer``),
else the blocks of the net's largest ``nn.ModuleList``; every compiled block is marked (``COMPILED_ATTR``).

Cost: the first training step (and each new input shape) compiles, minutes with a cold inductor cache on a small
CPU, seconds with a warm one (``/tmp/torchinductor_<user>``; docs/benchmarks.md, "Costs the code refers to").
Default off.

Off means zero cost: ``model.compile=false`` (the default) leaves the net untouched; torch is imported only then.
Runs on every rank; nothing here calls a collective.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from dsdebug.models.kernel_options import COMPILE_KEY, compile_setting

if TYPE_CHECKING:
    from torch import nn

__all__ = ["COMPILED_ATTR", "compile_blocks", "compiled_blocks"]

#: attribute set on every compiled block
COMPILED_ATTR = "dsdebug_compiled"


def compile_blocks(net: nn.Module, value: Any, backend: str = "inductor") -> list[str]:
    """Compile each block's forward when ``value`` (``model.compile``) is true; returns the compiled blocks'
    names ([] when off). A net without blocks to compile is a ConfigError naming the key."""
    if not compile_setting(value):
        return []
    from dsdebug.errors import ConfigError
    from dsdebug.models.grad_ckpt import _is_hf_layer, _largest_block_list

    blocks = [(n, m) for n, m in net.named_modules() if _is_hf_layer(m)]
    if not blocks:
        prefix, found = _largest_block_list(net)
        blocks = [(f"{prefix}.{i}" if prefix else str(i), b) for i, b in enumerate(found or [])]
    if not blocks:
        raise ConfigError(f"{COMPILE_KEY}=true: {type(net).__name__} has no decoder layers and no nn.ModuleList of "
                          f"blocks to compile; build its repeated blocks in an nn.ModuleList, or set {COMPILE_KEY}=false")
    for _, block in blocks:
        # the block's own forward, picklable: an instance attribute set before (grad_ckpt), else the class's
        plain = block.__dict__.get("forward") or functools.partial(type(block).forward, block)
        block.forward = CompiledForward(plain, backend)
        setattr(block, COMPILED_ATTR, True)
    return [name for name, _ in blocks]


def compiled_blocks(net: nn.Module) -> list[str]:
    """Names of the blocks ``compile_blocks`` compiled, in order."""
    return [n for n, m in net.named_modules() if getattr(m, COMPILED_ATTR, False)]


class CompiledForward:
    """``torch.compile(plain)``, made at the first call; pickles as the plain forward (a spawned process
    compiles its own)."""

    def __init__(self, plain: Callable[..., Any], backend: str) -> None:
        self.plain, self.backend = plain, backend
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            import torch

            self._compiled = torch.compile(self.plain, backend=self.backend)
        return self._compiled(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"plain": self.plain, "backend": self.backend, "_compiled": None}
