"""MoE load-balancing auxiliary loss for HF DeepSeek V2/V3, which compute none themselves, and
the router capture that also gives every MoE family's expert load (``moe_balance.py`` decides
which loss a net trains with).

HF's ``DeepseekV{2,3}ForCausalLM`` return ``aux_loss=None``; ``output_router_logits=True``
only returns the raw router logits, not the experts actually chosen (V3 picks them with the
``e_score_correction_bias`` and group-limited top-k, so re-deriving them from logits would
duplicate HF's routing code). :class:`RouterCapture` instead hooks the router modules
(``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``, Mixtral/Qwen/OLMoE ``*TopKRouter``;
found generically: any module with ``top_k``, ``num_experts`` and a ``[num_experts, hidden]``
``weight``) and records, per MoE layer, the raw logits and the selected top-k indices of the
current forward.

Usage in a LightningModule (runs on every rank, no collectives; the loss is in ``moe_loss.py``)::

    self.router_capture = RouterCapture(self.net, enabled=aux_coef > 0).attach()
    ...
    out = self.net(input_ids=ids, labels=labels)
    if self.router_capture.enabled:
        records = self.router_capture.collect()          # takes the records, clears them
        aux = load_balancing_loss(records, self.router_capture.num_experts,
                                  self.router_capture.top_k)
        loss = out.loss + aux_coef * aux
        load = expert_load_fractions(records, self.router_capture.num_experts)  # [L, E]

Scale of the loss (``sum_i f_i * P_i``, averaged over MoE layers): exactly 1.0 for perfectly
uniform routing, rising towards ``num_experts / top_k`` when every token goes to the same
``top_k`` experts with all router probability on them. Typical coefficients: 1e-3..1e-2.

Off means zero cost: ``enabled=False`` registers no hooks at all. Records are cleared at the
start of every forward of the root model and by :meth:`RouterCapture.collect`; recomputation
during backward (activation checkpointing) is ignored, so no tensors outlive a step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dsdebug.errors import ConfigError

__all__ = ["RouterCapture", "RouterRecord", "find_routers", "normalised_probs"]


@dataclass
class RouterRecord:
    """One MoE layer's routing for one forward."""

    name: str  # module path, e.g. "model.layers.1.mlp.gate"
    layer_index: int | None  # decoder layer index parsed from the name
    logits: torch.Tensor  # [T, E] raw router logits, differentiable w.r.t. the router weight
    topk_indices: torch.Tensor  # [T, k] experts actually selected (detached)
    batch_shape: tuple[int, ...]  # leading dims of the router input, normally (B, S)
    score_func: str  # "softmax" (V2) or "sigmoid" (V3)

    def probs(self) -> torch.Tensor:
        """Router probabilities normalised to sum to 1 per token, [T, E]."""
        return normalised_probs(self.logits, self.score_func)


def normalised_probs(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """softmax for V2; for V3 the sigmoid scores divided by their per-token sum, as in
    DeepSeek-V3's complementary sequence-wise balance loss."""
    logits = logits.float()
    if score_func == "sigmoid":
        scores = logits.sigmoid()
        return scores / scores.sum(dim=-1, keepdim=True)
    return logits.softmax(dim=-1)


def find_routers(model: nn.Module) -> dict[str, nn.Module]:
    """Router (gate) modules under ``model``, by name, in layer order."""
    routers = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        num_experts = getattr(module, "num_experts", None)
        if not isinstance(weight, nn.Parameter) or not isinstance(num_experts, int):
            continue
        # ZeRO-3 partitions parameters to shape [0]; ds_shape keeps the real one
        shape = tuple(getattr(weight, "ds_shape", weight.shape))
        if isinstance(getattr(module, "top_k", None), int) and len(shape) == 2 and shape[0] == num_experts:
            routers[name] = module
    return routers


class RouterCapture:
    """Records router logits and top-k choices of every MoE layer during a forward.

    ``model`` may be the HF model, a LightningModule holding it, or a DeepSpeed/DDP engine
    wrapping either: hooks go on the inner modules, and recording is active only while the
    outermost ``PreTrainedModel`` (the "root") runs its forward. ``score_func`` overrides the
    auto-detection (routers with ``e_score_correction_bias`` are V3-style sigmoid).
    """

    def __init__(self, model: nn.Module, enabled: bool = True, score_func: str | None = None):
        self.model = model
        self.enabled = bool(enabled)
        self.score_func = score_func
        self.records: list[RouterRecord] = []
        self.routers: dict[str, nn.Module] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._active = False

    # -- lifecycle -------------------------------------------------------------------------

    def attach(self) -> RouterCapture:
        """Register the hooks (no-op when disabled or already attached). Returns self."""
        if not self.enabled or self._handles:
            return self
        root = _find_root(self.model)
        self.routers = find_routers(root)
        if not self.routers:
            raise ConfigError(
                f"MoE load-balance loss is enabled but {type(root).__name__} has no router "
                "modules (top_k, num_experts, weight); set its coefficient to 0"
            )
        self._handles.append(root.register_forward_pre_hook(self._on_root_start))
        self._handles.append(root.register_forward_hook(self._on_root_end, always_call=True))
        for name, router in self.routers.items():
            self._handles.append(
                router.register_forward_hook(self._make_router_hook(name, router), with_kwargs=True)
            )
        return self

    def remove(self) -> None:
        """Remove every hook and drop the records."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.records = []
        self._active = False

    def __enter__(self) -> RouterCapture:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    @property
    def num_hooks(self) -> int:
        """Hooks currently registered by this capture (0 when disabled)."""
        return len(self._handles)

    def clear(self) -> None:
        """Drop the records of the last forward."""
        self.records = []

    def collect(self) -> list[RouterRecord]:
        """Return the records of the last forward and clear them from this object."""
        records, self.records = self.records, []
        return records

    # -- router facts ----------------------------------------------------------------------

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (all routers must agree)."""
        return _single({r.num_experts for r in self._require_routers()}, "num_experts")

    @property
    def top_k(self) -> int:
        """Experts chosen per token (all routers must agree)."""
        return _single({r.top_k for r in self._require_routers()}, "top_k")

    def _require_routers(self) -> list[nn.Module]:
        if not self.routers:
            self.routers = find_routers(_find_root(self.model))
        return list(self.routers.values())

    # -- hooks -----------------------------------------------------------------------------

    def _on_root_start(self, module: nn.Module, args: Any) -> None:
        self.records = []
        self._active = True

    def _on_root_end(self, module: nn.Module, args: Any, output: Any) -> None:
        self._active = False

    def _make_router_hook(self, name: str, router: nn.Module) -> _RouterHook:
        score_func = self.score_func or (
            "sigmoid" if hasattr(router, "e_score_correction_bias") else "softmax"
        )
        return _RouterHook(self, name, score_func)


class _RouterHook:
    """Forward hook on one router (a class, not a closure, so a hooked model still pickles)."""

    def __init__(self, capture: RouterCapture, name: str, score_func: str):
        self.capture = capture
        self.name = name
        match = re.search(r"layers\.(\d+)\.", name)
        self.layer_index = int(match.group(1)) if match else None
        self.score_func = score_func

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.capture._active:  # e.g. activation-checkpoint recompute during backward
            return
        hidden = args[0] if args else next(iter(kwargs.values()))
        if isinstance(output, torch.Tensor):  # routers that return only logits
            logits = output
            indices = normalised_probs(logits, self.score_func).topk(module.top_k, dim=-1).indices
        else:  # HF DeepSeek: (router_logits, topk_weights, topk_indices)
            logits = output[0]
            indices = next(t for t in reversed(output) if not t.is_floating_point())
        self.capture.records.append(
            RouterRecord(
                name=self.name,
                layer_index=self.layer_index,
                logits=logits.reshape(-1, logits.shape[-1]),
                topk_indices=indices.detach().reshape(-1, indices.shape[-1]),
                batch_shape=tuple(hidden.shape[:-1]),
                score_func=self.score_func,
            )
        )


def _find_root(model: nn.Module) -> nn.Module:
    """Unwrap DeepSpeed/DDP/Lightning wrappers and return the outermost PreTrainedModel."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):  # Lightning's _LightningModuleWrapperBase
            inner = getattr(model, "_forward_module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    try:  # a core install has no transformers (the moe_router check imports this module), no HF model either
        from transformers import PreTrainedModel
    except ImportError:
        return model
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return model


def _single(values: set[int], what: str) -> int:
    if len(values) != 1:
        raise ValueError(f"routers disagree on {what}: {sorted(values)}")
    return values.pop()
