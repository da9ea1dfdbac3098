"""`MoEBalance`: which load-balancing loss an MoE net trains with, at what coefficient, and its
expert-load metrics. ``CausalLMModule`` holds one per net; it runs on every rank, no collectives.

| net | aux loss (``train/aux_loss``) | ``moe_aux_loss_coef: auto`` | hooks |
|---|---|---|---|
| HF MoE with its own loss: config has ``router_aux_loss_coef`` and the modeling module defines ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) | the model's: forward with ``output_router_logits=True``, ``out.aux_loss`` (Switch loss pooled over MoE layers; ``top_k`` when balanced) | the config's ``router_aux_loss_coef`` | one per router |
| MoE without one (HF DeepSeek V2/V3) | the project's ``moe_loss.load_balancing_loss`` over the hooked router logits (1.0 when balanced) | ``0.01`` | one per router + 2 on the root |
| dense (no routers, no own loss) | none | - | none |

Never both: the back-propagated total is ``CE + coef * aux`` with exactly one aux term, and the
module passes no ``labels`` to the net, so HF does not add its own ``router_aux_loss_coef * aux``
on top. A number for ``moe_aux_loss_coef`` replaces the coefficient (of whichever loss applies);
0 turns balancing off. Routers are "modules with ``top_k``, ``num_experts`` and a
``[num_experts, hidden]`` weight" (``moe_aux.find_routers``); in transformers 5.23 the
Mixtral/Qwen2-MoE/Qwen3-MoE/OLMoE ``*TopKRouter`` and DeepSeek's ``*TopkRouter`` all return
``(router_logits, top_k_weights, top_k_indices)``.

Metrics (``moe_metrics: true``, the default) are on whenever routers are found, even with the
coefficient at 0: the aux loss is then measured without gradient, and the expert load comes
from the top-k indices the routers actually chose (detached counts, no logits kept beyond the
step). Layer ``i`` in ``moe/load/L<i>/E<e>`` is the decoder layer index (Qwen2-MoE's
``mlp_only_layers``/``decoder_sparse_step`` and DeepSeek's dense first layers are skipped, not
renumbered). Off means zero cost: coefficient 0 and ``moe_metrics: false`` add no hooks and no
``output_router_logits``.

A debug check taps the routing with :meth:`MoEBalance.observe` (``callbacks/moe_router.py``):
its listener gets every training forward's router records and aux loss; with no listener (the
default) nothing extra runs.
"""

from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from dsdebug.errors import ConfigError
from dsdebug.models.moe_aux import RouterCapture, find_routers
from dsdebug.models.moe_loss import expert_load_fractions, load_balancing_loss

__all__ = ["MoEBalance", "MoEStep", "PROJECT_AUX_COEF", "own_aux_loss_coef", "resolve_coef"]

log = logging.getLogger(__name__)

#: the project's coefficient for its own loss (DeepSeek-V3 paper's balance factors are 1e-4..1e-2)
PROJECT_AUX_COEF = 0.01


@dataclass
class MoEStep:
    """One training forward's MoE measurements."""

    aux: torch.Tensor | None  # scalar; carries gradient only when the coefficient is > 0
    load: torch.Tensor | None = None  # [moe layers, experts] share of routed token-slots (rows sum to 1)
    layers: list[int] = field(default_factory=list)  # decoder layer index of each load row

    @property
    def imbalance(self) -> torch.Tensor | None:
        """Busiest expert's share x num_experts (max over layers): 1 = balanced, E/k = collapsed."""
        return None if self.load is None else self.load.max() * self.load.shape[-1]


def own_aux_loss_coef(net: nn.Module) -> float | None:
    """``router_aux_loss_coef`` of an HF model that computes its own balance loss, else None."""
    coef = getattr(getattr(net, "config", None), "router_aux_loss_coef", None)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool):
        return None
    module = importlib.import_module(type(net).__module__)
    return float(coef) if callable(getattr(module, "load_balancing_loss_func", None)) else None


def resolve_coef(value: Any, own: float | None) -> float:
    """``auto`` -> the model's own coefficient, else ``PROJECT_AUX_COEF``; a number >= 0 as given."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return own if own is not None else PROJECT_AUX_COEF
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or number < 0:
        raise ConfigError(f"model.moe_aux_loss_coef={value!r} is invalid; valid: auto, or a number >= 0 (0 = off)")
    return float(number)


class MoEBalance:
    """The MoE side of one net: forward kwargs, aux loss and expert load per training forward."""

    def __init__(self, net: nn.Module, coef: Any = "auto", metrics: bool = True) -> None:
        own = own_aux_loss_coef(net)
        routers = find_routers(net)
        self.source = "model" if own is not None else ("project" if routers else None)
        self.coef = resolve_coef(coef, own)
        self.metrics = bool(metrics)
        self.net_name = type(net).__name__
        self._warned = False
        self._net = net
        self.listeners: list[Callable[[list, torch.Tensor | None], None]] = []
        hooks = bool(routers) and (self.metrics or (self.source == "project" and self.coef > 0))
        self.capture = RouterCapture(net).attach() if hooks else None
        self.layers = [_layer_index(name, i) for i, name in enumerate(routers)]
        self.num_experts = self.capture.num_experts if self.capture else None
        self.top_k = self.capture.top_k if self.capture else None
        if self.source is None and not (isinstance(coef, str) and coef.strip().lower() == "auto") and self.coef > 0:
            log.info("moe_aux_loss_coef=%s ignored: %s has no MoE routers", coef, self.net_name)
        elif self.source is not None:
            log.info("MoE: %s, %d router(s) found; aux loss: %s x %g; metrics %s", self.net_name, len(routers),
                     "the model's own" if self.source == "model" else "the project's", self.coef,
                     "on" if self.metrics and routers else "off")

    @property
    def _measures_aux(self) -> bool:
        return self.source is not None and (self.coef > 0 or self.metrics)

    def forward_kwargs(self, training: bool) -> dict[str, Any]:
        """Extra kwargs for ``net(input_ids=...)``: ask an HF MoE for its router logits/aux loss."""
        if training and self.source == "model" and self._measures_aux:
            return {"output_router_logits": True}
        return {}

    def measure(self, out: Any, training: bool) -> MoEStep | None:
        """After the net's forward: the aux loss and expert load of this forward (None in eval or
        for a dense net). Always takes the hooked records, so none outlive the step."""
        records = self.capture.collect() if self.capture is not None else []
        if not training or not self._measures_aux:
            self._notify(training, records, None)
            return None
        aux = None
        if self.source == "model":
            aux = getattr(out, "aux_loss", None)
            if not isinstance(aux, torch.Tensor):
                aux = None
                if not self._warned:
                    self._warned = True
                    log.warning("%s returned no aux_loss with output_router_logits=True: no balance loss", self.net_name)
        elif records:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.coef > 0):
                aux = load_balancing_loss(records, self.num_experts, self.top_k)
        if aux is not None and self.coef <= 0:
            aux = aux.detach()
        step = MoEStep(aux=aux)
        if records and self.metrics:
            step.load = expert_load_fractions(records, self.num_experts)
            step.layers = [_layer_index(r.name, i) if r.layer_index is None else r.layer_index
                           for i, r in enumerate(records)]
        self._notify(training, records, aux)
        return step

    def observe(self, listener: Callable[[list, torch.Tensor | None], None]) -> bool:
        """Call ``listener(records, aux)`` after every training forward (records: this forward's
        ``RouterRecord`` per MoE layer; aux: the aux loss or None). Attaches the router hooks if
        metrics and the loss left them off. False (nothing registered) for a net without routers."""
        if not self.layers:
            return False
        if self.capture is None:
            self.capture = RouterCapture(self._net).attach()
            self.num_experts, self.top_k = self.capture.num_experts, self.capture.top_k
        self.listeners.append(listener)
        return True

    def unobserve(self, listener: Callable[[list, torch.Tensor | None], None]) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def _notify(self, training: bool, records: list, aux: torch.Tensor | None) -> None:
        if training and records and self.listeners:
            for listener in self.listeners:
                listener(records, aux)

    def summary(self) -> dict[str, Any]:
        """What metrics.json records (the report reads it to say why no MoE figure was drawn)."""
        return {"aux_source": self.source, "aux_coef": self.coef if self.source else None,
                "metrics": bool(self.metrics and self.capture is not None), "layers": self.layers,
                "experts": self.num_experts, "top_k": self.top_k}

    def remove(self) -> None:
        if self.capture is not None:
            self.capture.remove()


def _layer_index(name: str, ordinal: int) -> int:
    parts = name.split(".")
    for before, part in zip(parts, parts[1:]):
        if before == "layers" and part.isdigit():
            return int(part)
    return ordinal
