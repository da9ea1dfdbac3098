"""Gradient (activation) checkpointing of a net's repeated blocks: ``model.gradient_checkpointing``.

Each decoder block's activations are dropped after its forward and recomputed in backward
(``torch.utils.checkpoint.checkpoint``): activation memory falls from all blocks' internals to
one input tensor per block, for about one more forward of compute. The maths is unchanged: with
the RNG state replayed (torch's default), loss and gradients equal the run without it.

Values of ``model.gradient_checkpointing``:

| value | meaning |
|---|---|
| ``false`` (default) | off: the net is left untouched |
| ``true`` / ``non_reentrant`` | torch's non-reentrant checkpoint (``use_reentrant=False``, torch's recommendation) |
| ``reentrant`` | the older reentrant checkpoint (``use_reentrant=True``): no gradient reaches a block whose tensor inputs do not require grad (frozen embeddings) -- the ``grad_checkpointing`` check reports it |

How: a Hugging Face model (``supports_gradient_checkpointing``; the DeepSeek nets are HF models)
through its own ``activation_checkpointing_enable`` (transformers 5; ``gradient_checkpointing_enable``
on older ones), which wraps each decoder layer's forward in ``checkpoint``. Any other net: the
blocks of its largest ``nn.ModuleList`` get the same wrapping (forward, not ``__call__``, so
module hooks -- DeepSpeed ZeRO-3's gathers, the checks' -- stay outside the recompute). Every
checkpointed block is marked (``CKPT_ATTR`` = the mode) for the check to find.

Runs on every rank; nothing here calls a collective.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsdebug.errors import ConfigError
from dsdebug.models.ckpt_mode import KEY, MODES, checkpointing_mode

__all__ = ["MODES", "CKPT_ATTR", "checkpointing_mode", "enable_gradient_checkpointing", "checkpointed_blocks",
           "checkpointing_suspended"]

#: attribute set on every checkpointed block: "reentrant" | "non_reentrant"
CKPT_ATTR = "dsdebug_checkpointing"
_PLAIN_FORWARD = "_dsdebug_plain_forward"  # the generic wrapper keeps the block's own forward here
_KEY = KEY


def enable_gradient_checkpointing(net: nn.Module, value: Any) -> list[str]:
    """Turn checkpointing on for ``net``'s blocks as ``value`` asks; returns the checkpointed blocks' names
    ([] when off). A net with neither HF support nor an ``nn.ModuleList`` of blocks is a ConfigError."""
    mode = checkpointing_mode(value)
    if mode is None:
        return []
    kwargs = {"use_reentrant": mode == "reentrant"}
    if getattr(net, "supports_gradient_checkpointing", False):
        enable = getattr(net, "activation_checkpointing_enable", None)  # transformers 5 (the old name warns)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        names = [n for n, m in net.named_modules() if _is_hf_layer(m) and m.gradient_checkpointing]
        for name in names:
            setattr(net.get_submodule(name), CKPT_ATTR, mode)
        return names
    prefix, blocks = _largest_block_list(net)
    if blocks is None:
        raise ConfigError(
            f"{_KEY}={value}: {type(net).__name__} has no Hugging Face gradient checkpointing and no nn.ModuleList of "
            "blocks to checkpoint; build the net's repeated blocks in an nn.ModuleList, or set "
            f"{_KEY}=false")
    names = []
    for i, block in enumerate(blocks):
        # the block's own forward, picklable (a spawned process gets the net): not a bound method of the block
        plain = block.__dict__.get("forward") or functools.partial(type(block).forward, block)
        setattr(block, _PLAIN_FORWARD, plain)
        block.forward = functools.partial(_checkpointed_forward, block, plain, kwargs["use_reentrant"])
        setattr(block, CKPT_ATTR, mode)
        names.append(f"{prefix}.{i}" if prefix else str(i))
    return names


def checkpointed_blocks(net: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """name -> (block, mode) of every block ``enable_gradient_checkpointing`` turned on, in order."""
    return {n: (m, getattr(m, CKPT_ATTR)) for n, m in net.named_modules() if getattr(m, CKPT_ATTR, None)}


@contextlib.contextmanager
def checkpointing_suspended(block: nn.Module) -> Iterator[Callable[..., Any]]:
    """Yield a callable running ``block``'s forward WITHOUT checkpointing (its activations kept), for
    measuring what checkpointing saves. No module hooks run (the block's own already ran)."""
    plain = getattr(block, _PLAIN_FORWARD, None)
    if plain is not None:
        yield plain
        return
    was = block.gradient_checkpointing
    block.gradient_checkpointing = False
    try:
        yield block.forward
    finally:
        block.gradient_checkpointing = was


# --------------------------------------------------------------------------------------------

def _checkpointed_forward(block: nn.Module, plain: Callable[..., Any], use_reentrant: bool, *args: Any,
                          **kwargs: Any) -> Any:
    if not (block.training and torch.is_grad_enabled()):  # eval / no_grad: nothing to save, nothing to recompute
        return plain(*args, **kwargs)
    # keyword arguments go through a partial: the reentrant checkpoint takes positional tensors only
    return checkpoint(functools.partial(plain, **kwargs), *args, use_reentrant=use_reentrant)


def _is_hf_layer(module: nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: any module carrying the flag
        return hasattr(module, "gradient_checkpointing") and not hasattr(module, "config")
    return isinstance(module, GradientCheckpointingLayer)


def _largest_block_list(net: nn.Module) -> tuple[str, nn.ModuleList | None]:
    """The ``nn.ModuleList`` holding the most parameters (the decoder blocks), with its name."""
    best, best_name, best_size = None, "", 0
    for name, module in net.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
            if size > best_size:
                best, best_name, best_size = module, name, size
    return best_name, best
