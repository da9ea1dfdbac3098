"""`LayerHealth`: layers that vanish, stall or explode RELATIVE to the rest of the net.

The config example and the table of metrics and findings: the class docstring (`LayerHealth`).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Any, ClassVar, Union

import torch

from dsdebug.distributed import collectives
from dsdebug.config.args import Rule, either, integer, number
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import (_at_accumulation_boundary, display_name, grad_source, layer_of,
                                            local_grad, local_param, on_device, sumsq_per_tensor,
                                            unpadded)
from dsdebug.callbacks.layer_health.expected import ExpectedStep, explain, lost_cause
from dsdebug.callbacks.loss_scale import read_scaler

__all__ = ["LayerHealth"]

log = logging.getLogger(__name__)
Values = Union[torch.Tensor, list]  # per-layer values: a tensor (tests, callers) or a list (the queue, read once)


class LayerHealth(DebugCallback):
    """`LayerHealth`: layers that vanish, stall or explode RELATIVE to the rest of the net.

    grad_monitor's checks are absolute (a layer's norm < 1e-8, the global norm > max_norm); this
    one compares layers with each other and with their own history:
    - a layer whose gradient per element (RMS: ``sqrt(sum g^2 / numel)``, so a 4096 x 256
      embedding and a 256-element norm weigh alike) is < ``vanish_ratio`` x the median layer's;
    - from the first step, before ``warmup_steps`` gradient checks (the prior of a healthy init, no
      history needed): a layer whose gradient RMS over its non-zero elements is < ``early_ratio`` x the
      largest layer's. At a healthy init layers sit within ~1e-2 of each other (measured on DeepSeek,
      GPT-2, Llama, Mixtral and small custom nets: >= 7e-3 even counting unseen embedding rows, which
      the non-zero count leaves out); a residual branch scaled by 1e-4 sits at ~1e-5. This also names
      every block when ALL are scaled down (the median criterion then sees nothing);
    - a layer whose update ratio ``|W_after - W_before| / |W_before|`` (measured around the optimizer
      step) is < ``ratio_floor`` x the median layer's: AdamW normalises gradient scale, so a tiny
      per-group LR shows only here;
    - a layer whose gradient norm jumped > ``explode_factor`` x its own history (geometric EMA,
      after ``warmup_steps`` checks) while the median layer did not (a global jump is grad_monitor's).
    And one absolute judgement, against the optimizer (``expected``): a layer whose update RMS is below
    ``lost_ratio`` x the step its optimizer should give (adaptive: ~lr per element with a gradient; SGD: lr x the
    gradient), with the cause read from host facts (eps, clip, 16-bit weights with no fp32 master copy). The update
    is measured at each of the first ``first_update_steps`` steps too (judged at the last of them), so a config that
    loses every step is named in the first steps.
    Layers are blocks (``model.layers.3``, grad_monitor's ``layer_of``): MoE experts that got no
    tokens are part of their block, so they do not look dead. Embedding rows of unseen tokens get
    no gradient: this dilutes its RMS by ~sqrt(seen rows / vocab), orders above ``vanish_ratio``.

    Strategies: gradients are read as grad_monitor reads them (``param.grad``; ZeRO-1/2 fp32
    fragments; ZeRO-3 local partitions); weights from ``param.data`` (ZeRO-1/2: the lp weights
    the all-gather refreshes after the step) or ZeRO-3's local partition ``ds_tensor`` (padding
    cut off). Host reads (a device sync each on a GPU): each checked step's per-layer sums of squares (and,
    early, non-zero counts) are computed where the gradients live and queued; every ``read_every_n_steps``
    steps (default 10) the queue is all-reduced once (``[N x 4 layers]``, on every rank, in
    ``on_train_batch_end``) and read once, and each step is judged in order at its own step; every decision
    uses the reduced values, rank 0 writes. Under bf16 the update ratio is that of the bf16 weights the forward uses.
    The weight snapshot (this rank's weights, taken only at ``every_n_steps`` and at each of the first
    ``first_update_steps`` steps) is freed after use.
    fp16 (``dsdebug.callbacks.loss_scale``): gradient norms are the unscaled ones (DeepSpeed's gradients still
    carry the loss scale in the hook; divided on the device), so a scale change moves no layer's history; an
    overflowed step's non-finite norms are left out (grad_monitor's and the loss scaler's business).

    Example::

        python train.py +callbacks=layer_health callbacks.layer_health.every_n_steps=5 strategy=zero3 trainer=ddp_sim

    | metric key (every ``every_n_steps``, and the first ``first_update_steps`` steps) | meaning |
    |---|---|
    | ``layers/update_ratio/<layer>`` | ``|dW| / |W|`` of the layer's trainable weights over one optimizer step |
    | ``layers/grad_rel/<layer>`` | the layer's gradient RMS / the median layer's gradient RMS |
    | ``layers/update_vs_optimizer/<layer>`` | the layer's update RMS / the step its optimizer should give |

    | finding code | severity | when |
    |---|---|---|
    | ``layer_grad_vanishing_relative`` | warning | grad RMS < ``vanish_ratio`` x median layer's (early: non-zero RMS < ``early_ratio`` x the largest layer's), ``patience`` in a row |
    | ``layer_update_negligible`` | warning | update ratio < ``ratio_floor`` x median layer's, ``patience`` in a row |
    | ``layer_grad_exploding`` | warning | grad norm > ``explode_factor`` x its EMA and x the median layer's jump |
    | ``layer_update_lost`` | warning | update RMS < ``lost_ratio`` x the optimizer's step, ``patience`` in a row |
    | ``layer_summary`` | info | at the end: per-layer median update ratio and grad_rel, the closest calls |

    Resume (``state_attrs``, from all-reduced sums, alike on every rank): per layer the low-gradient and
    low-update streaks, the checks seen (warm-up) and the log-norm EMA, the layers flagged as exploding,
    the lost-update streaks and the causes already reported, the closest calls and the finding counts. The summary's
    ratio history is not kept.
    """
    name = "layer_health"
    state_attrs = ("_low_grad", "_low_update", "_seen", "_log_ema", "_exploding", "_closest", "_counts",
                   "_grad_checks", "_lost", "_lost_causes")

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(0, note="0 = no update ratios/metrics"),
        "grad_every_n_steps": integer(1),
        "vanish_ratio": number(0, 1, open_high=True, note="0 = off"),
        "ratio_floor": number(0, 1, open_high=True, note="0 = off"),
        "patience": integer(1),
        "explode_factor": either(number(1, open_low=True), number(0, 0), valid="a number > 1 (0 = off)"),
        "ema_beta": number(0, 1, open_low=True, open_high=True),
        "warmup_steps": integer(1),
        "max_findings_per_code": integer(1),
        "read_every_n_steps": integer(1),
        "early_ratio": number(0, 1, open_high=True, note="0 = off"),
        "lost_ratio": number(0, 1, open_high=True, note="0 = off"),
        "first_update_steps": integer(0),
    }

    def __init__(self, every_n_steps: int = 10, grad_every_n_steps: int = 1, vanish_ratio: float = 1.0e-4,
                 ratio_floor: float = 1.0e-3, patience: int = 3, explode_factor: float = 10.0,
                 ema_beta: float = 0.9, warmup_steps: int = 50, max_findings_per_code: int = 5,
                 early_ratio: float = 3.0e-4, read_every_n_steps: int = 10, lost_ratio: float = 1.0e-2,
                 first_update_steps: int = 5) -> None:
        super().__init__()
        self.read_every = read_every_n_steps
        # (step's [4 x layers], step, update?, nnz?, the layers' sum(numel x lr^2) when the update was measured)
        self._queue: list[tuple[torch.Tensor, int, bool, bool, list[float] | None]] = []
        self.check_declared(every_n_steps=every_n_steps, grad_every_n_steps=grad_every_n_steps,
                            vanish_ratio=vanish_ratio, ratio_floor=ratio_floor, patience=patience,
                            explode_factor=explode_factor, ema_beta=ema_beta, warmup_steps=warmup_steps,
                            max_findings_per_code=max_findings_per_code, read_every_n_steps=read_every_n_steps,
                            early_ratio=early_ratio, lost_ratio=lost_ratio, first_update_steps=first_update_steps)
        self.lost_ratio, self.first_update_steps = float(lost_ratio), int(first_update_steps)
        self._expect = ExpectedStep()
        self._mapped = False
        self.early_ratio = float(early_ratio)
        self.every_n_steps, self.grad_every_n_steps = every_n_steps, grad_every_n_steps
        self.vanish_ratio, self.ratio_floor, self.patience = float(vanish_ratio), float(ratio_floor), patience
        self.explode_factor, self.ema_beta, self.warmup_steps = float(explode_factor), float(ema_beta), warmup_steps
        self.max_findings_per_code = max_findings_per_code
        self._params: list[torch.Tensor] = []
        self._pending: tuple | None = None
        self._counts: dict[str, int] = {}
        self._restored: dict[str, Any] | None = None  # a resume's state, until the layer table exists
        self._scaler = None  # fp16: the run's loss scaler
        self.set_layers([], [])

    # ---- setup: every rank --------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        named = [(display_name(n), p) for n, p in pl_module.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._source = grad_source(trainer.strategy)
        self._scaler = read_scaler(trainer)  # fp16: DeepSpeed's gradients are loss-scaled in the hook
        self._mapped = False  # the optimizer's groups: mapped at this fit's first optimizer step
        numel = [float(getattr(p, "ds_numel", p.numel())) for p in self._params]
        self.set_layers([layer_of(n) for n, _ in named], numel)
        if self._restored is not None:  # DDP: Lightning restored it before this hook rebuilt the per-layer state
            self._apply_restored()
        log.info("layer_health: %d layers, gradients from %s", len(self._layers), self._source)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._restored = None  # applied: Lightning restores before on_fit_start (DDP) or after it (DeepSpeed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict
        self._apply_restored()

    def _apply_restored(self) -> None:
        saved = len(self._restored.get("_seen", ()))
        if self._layers and saved != len(self._layers):
            log.warning("layer_health: the checkpoint's state is for %d layers, this net has %d: starting afresh",
                        saved, len(self._layers))
            self._counts = {}  # set_layers reset the rest
            return
        defaults = dict(self._closest)
        super().load_state_dict(self._restored)
        self._closest = {**defaults, **self._closest}  # a checkpoint of an older version lacks the newer keys

    def set_layers(self, param_layers: list[str], param_numel: list[float]) -> None:
        """Per-parameter layer names and sizes -> the layer table and fresh detection state."""
        self._layers = list(dict.fromkeys(param_layers))
        index = {layer: i for i, layer in enumerate(self._layers)}
        self._layer_idx = tuple(index[n] for n in param_layers)  # on a device: grad_access.on_device
        self._numel = self.per_layer(torch.tensor(param_numel, dtype=torch.float64))
        self._numel_list = self._numel.tolist()
        n = len(self._layers)
        self._grad_checks = 0  # gradient checks judged: the early prior holds for the first warmup_steps
        self._low_grad, self._low_update, self._seen = [0] * n, [0] * n, [0] * n
        self._log_ema, self._exploding = [0.0] * n, set()
        self._lost = [0] * n  # checks in a row whose update was < lost_ratio x the optimizer's step
        self._lost_ratios: list[float | None] = [None] * n  # the last check's, for the metrics
        self._lost_causes: dict[str, list[str]] = {}  # cause -> the layers named with it (one finding per cause)
        self._rel_hist: deque = deque(maxlen=1000)
        self._upd_hist: deque = deque(maxlen=1000)
        self._closest = {"min_grad_rel": math.inf, "min_update_rel": math.inf, "max_explode_ratio": 0.0,
                         "min_early_rel": math.inf, "min_update_vs_optimizer": math.inf}

    def per_layer(self, per_param: torch.Tensor) -> torch.Tensor:
        """Per-parameter values summed per layer, where they live."""
        out = torch.zeros(len(self._layers), dtype=torch.float64, device=per_param.device)
        return out.index_add_(0, on_device(self._layer_idx, per_param.device), per_param.double())

    # ---- measure: local, every rank (no collective) ---------------------------------------
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._params or not _at_accumulation_boundary(trainer):
            return
        step = trainer.global_step
        if not self._mapped:
            self._expect.map(trainer, self._params, self._layer_idx, len(self._layers))
            self._mapped = True
        update = self.due(step) or (bool(self.every_n_steps) and step < self.first_update_steps)
        if not update and not self.due(step, self.grad_every_n_steps):
            return
        grads = [unpadded(local_grad(p, self._source), p) for p in self._params]
        snapshot = w_sq = None
        if update:  # this rank's weights before the update (ZeRO-3: its partition only)
            weights = [unpadded(local_param(p), p) for p in self._params]
            w_sq = _sumsq(weights)
            snapshot = [w.detach().clone() for w in weights]
        nnz = None
        if self._early() or update:  # non-zero gradient elements per layer (unseen embedding rows, idle experts: 0)
            present = [g for g in grads if g is not None]
            device = present[0].device if present else torch.device("cpu")
            nnz = self.per_layer(torch.stack([_nonzero(g) if g is not None else torch.zeros((), device=device,
                                                                                                  dtype=torch.long)
                                              for g in grads]).double())
        factor = self._scaler.grad_factor(optimizer) if self._scaler is not None else 1.0  # fp16: unscale
        lr_sq = self._expect.lr_sq() if update else None  # host floats: the lr this step is taken with
        self._pending = (step, self.per_layer(_sumsq(grads, factor)), snapshot, w_sq, nnz, lr_sq)

    def _early(self) -> bool:
        return self.early_ratio > 0 and self._grad_checks < self.warmup_steps

    # ---- reduce + judge: EVERY rank (same step, same decision inputs) -----------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._pending is None:
            return
        step, g_sq, snapshot, w_sq, nnz, lr_sq = self._pending
        self._pending = None
        dw_sq = None
        if snapshot is not None:  # after the step (ZeRO-1/2: after the all-gather of lp weights)
            after = [unpadded(local_param(p), p) for p in self._params]
            torch._foreach_sub_(snapshot, [a.detach() for a in after])
            dw_sq, w_sq = self.per_layer(_sumsq(snapshot)), self.per_layer(w_sq)
            del snapshot, after  # free the copy now
        # one row per step, [grads | update | weights | non-zeros] x layers, each part divided by the world size
        # where every rank holds all of it (replicated gradients; ZeRO-1/2's and DDP's weights): the sum over
        # ranks then gives each part once
        world = trainer.world_size
        grads_whole = world if self._source == "replicated" else 1
        weights_whole = 1 if self._source == "zero3" else world
        zeros = torch.zeros_like(g_sq)
        row = torch.cat([g_sq / grads_whole,
                         dw_sq.to(g_sq.device) / weights_whole if dw_sq is not None else zeros,
                         w_sq.to(g_sq.device) / weights_whole if dw_sq is not None else zeros,
                         nnz.to(g_sq.device) / grads_whole if nnz is not None else zeros])
        self._queue.append((row, step, dw_sq is not None, nnz is not None, lr_sq))
        if len(self._queue) >= self.read_every or step == self.first_update_steps - 1 or \
                0 < (getattr(trainer, "max_steps", 0) or -1) <= trainer.global_step:  # the first steps: judged early
            self._read(trainer)

    def read_queued(self, trainer: Any) -> None:
        self._read(trainer)  # before a checkpoint takes the per-layer state (base.py)

    def _read(self, trainer: Any) -> None:
        """Judge the queued steps in order. COLLECTIVE (world > 1): one all-reduce of [N x 4 layers] and one host
        read, EVERY rank at the same step (the queue fills alike everywhere)."""
        queue, self._queue = self._queue, []
        if not queue:
            return
        n = len(self._layers)
        rows = collectives.reduce(trainer, torch.stack([r for r, *_ in queue]), "sum").cpu().tolist()
        for row, (_, step, update, counted, lr_sq) in zip(rows, queue):
            self.check(trainer, step, row[:n], row[n:2 * n] if update else None, row[2 * n:3 * n] if update else None,
                       row[3 * n:] if counted else None, lr_sq, relative=self.due(step))

    def check(self, trainer: Any, step: int, g_sq: Values, dw_sq: Values | None = None,
              w_sq: Values | None = None, nnz: Values | None = None,
              lr_sq: list[float] | None = None, relative: bool = True) -> list[tuple[str, str]]:
        """Judge one step from per-layer (all-reduced) sums of squares (and, early, non-zero counts; with the update,
        each layer's ``sum(numel x lr^2)`` of its groups); returns [(code, layer)] reported. ``relative``: the update
        ratios are compared across layers too (steps on the every_n_steps cadence; the first steps' extra
        measurements are judged against the optimizer only)."""
        found = self.judge_grads(g_sq, nnz)
        ratios, self._lost_ratios = None, [None] * len(self._layers)
        if dw_sq is not None:
            ratios = [math.sqrt(d / w) if w > 0 else None for d, w in zip(_values(dw_sq), _values(w_sq))]
            if relative:
                found += self.judge_updates(ratios)
            if lr_sq is not None and self.lost_ratio > 0:
                found += self.judge_lost(_values(g_sq), _values(dw_sq), _values(w_sq), lr_sq,
                                         _values(nnz) if nnz is not None else None)
        if ratios is not None and trainer is not None and trainer.global_rank == 0:
            metrics = {f"layers/grad_rel/{k}": v for k, v in zip(self._layers, self._rel_hist[-1]) if v is not None}
            metrics.update({f"layers/update_ratio/{k}": v for k, v in zip(self._layers, ratios) if v is not None})
            metrics.update({f"layers/update_vs_optimizer/{k}": v for k, v in zip(self._layers, self._lost_ratios)
                            if v is not None})
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=step)
        for code, i, message, advice, details in found:
            self._emit(trainer, step, code, message, advice, {"layer": self._layers[i], **details})
        return [(code, self._layers[i]) for code, i, *_ in found]

    def judge_grads(self, g_sq: Values, nnz: Values | None = None) -> list[tuple]:
        sq = [v if math.isfinite(v) else math.nan for v in _values(g_sq)]  # NaN/Inf: grad_monitor's job
        rms = [math.sqrt(s / n) if n > 0 and s == s else math.nan for s, n in zip(sq, self._numel_list)]
        finite = [r for r in rms if r == r]
        med = statistics.median(finite) if finite else 0.0
        rel = [r / med if med > 0 and r == r else None for r in rms]
        self._rel_hist.append(rel)
        early = self._early_rel(sq, nnz) if nnz is not None and self._early() else [None] * len(sq)
        self._grad_checks += 1
        found = []
        if (self.vanish_ratio > 0 and med > 0) or any(e is not None for e in early):
            for i, r in enumerate(rel):
                low_early = early[i] is not None and early[i] < self.early_ratio
                low = (r is not None and med > 0 and self.vanish_ratio > 0 and r < self.vanish_ratio) or low_early
                self._low_grad[i] = self._low_grad[i] + 1 if low else 0
                if r is not None:
                    self._closest["min_grad_rel"] = min(self._closest["min_grad_rel"], r)
                if self._low_grad[i] == self.patience and low_early:
                    top = max((j for j in range(len(early)) if early[j] is not None), key=lambda j: early[j])
                    found.append(("layer_grad_vanishing_relative", i,
                                  f"layer {self._layers[i]}'s gradient is {early[i]:.2g} x the largest layer's "
                                  f"({self._layers[top]}) per non-zero element from the first steps "
                                  f"({self.patience} checks in a row, below early_ratio={self.early_ratio:g}; at a "
                                  "healthy init layers sit within ~1e-2 of each other)",
                                  "this block barely takes part from initialisation: a residual branch, gate or "
                                  "output scaled towards 0 (init std, a depth scale, a zero-init gate), a saturated "
                                  "activation or a detached input",
                                  {"grad_rel_largest": early[i], "largest_layer": self._layers[top], "early": True,
                                   "norm": math.sqrt(sq[i]) if sq[i] == sq[i] else None}))
                elif self._low_grad[i] == self.patience:
                    found.append(("layer_grad_vanishing_relative", i,
                                  f"layer {self._layers[i]}'s gradient is {r:.2g} x the median layer's per element "
                                  f"(RMS {rms[i]:.3g} vs {med:.3g}, norm {math.sqrt(sq[i]):.3g}) for {self.patience} "
                                  f"checks in a row, below vanish_ratio={self.vanish_ratio:g}",
                                  "this block barely takes part: look for an output scaled towards 0 (residual or "
                                  "gate scale, init), a saturated activation or a detached input; AdamW hides it in "
                                  "the update until eps dominates",
                                  {"grad_rel": r, "rms": rms[i], "median_rms": med, "norm": math.sqrt(sq[i])}))
        return found + (self.judge_explosion([math.sqrt(s) for s in sq]) if self.explode_factor > 0 else [])

    def _early_rel(self, sq: list[float], nnz: Values) -> list[float | None]:
        """Each layer's gradient RMS over its non-zero elements / the largest layer's (None: no gradient)."""
        rms = [math.sqrt(s / c) if c > 0 and s == s and s > 0 else None for s, c in zip(sq, _values(nnz))]
        top = max((r for r in rms if r is not None), default=0.0)
        rel = [r / top if r is not None and top > 0 else None for r in rms]
        known = [r for r in rel if r is not None]
        if known:
            self._closest["min_early_rel"] = min(self._closest["min_early_rel"], min(known))
        return rel

    def judge_explosion(self, norms: list[float]) -> list[tuple]:
        ratios = {i: n / math.exp(self._log_ema[i]) for i, n in enumerate(norms)
                  if n == n and n > 0 and self._seen[i] >= self.warmup_steps}
        med = max(1.0, statistics.median(ratios.values())) if ratios else 1.0
        flagged = {i for i, r in ratios.items() if r > self.explode_factor * med}
        found = []
        for i in sorted(flagged - self._exploding):
            found.append(("layer_grad_exploding", i,
                          f"layer {self._layers[i]}'s gradient norm {norms[i]:.4g} is {ratios[i]:.3g} x its own "
                          f"history (EMA {math.exp(self._log_ema[i]):.4g}) while the median layer is at {med:.3g} x, "
                          f"above explode_factor={self.explode_factor:g}",
                          "a local blow-up: a hook or custom op scaling that block's gradient, attention logits or "
                          "a router growing, a bad init; grad_monitor's global norm may not show it yet",
                          {"norm": norms[i], "ema": math.exp(self._log_ema[i]), "ratio": ratios[i],
                           "median_ratio": med}))
        for i, r in ratios.items():
            if i not in flagged:
                self._closest["max_explode_ratio"] = max(self._closest["max_explode_ratio"], r / med)
        self._exploding = flagged  # a layer is reported again only after it calmed down
        for i, n in enumerate(norms):
            if n == n and n > 0 and i not in flagged:  # flagged values stay out of the history
                x = math.log(n)
                self._log_ema[i] = x if self._seen[i] == 0 else self._log_ema[i] + (1 - self.ema_beta) * (
                    x - self._log_ema[i])
                self._seen[i] += 1
        return found

    def judge_updates(self, ratios: list[float | None]) -> list[tuple]:
        self._upd_hist.append(ratios)
        known = [r for r in ratios if r is not None and math.isfinite(r)]
        med = statistics.median(known) if known else 0.0
        if med <= 0 or self.ratio_floor <= 0:  # a skipped step (no update anywhere): nothing to compare
            return []
        found = []
        for i, r in enumerate(ratios):
            low = r is not None and r < self.ratio_floor * med
            self._low_update[i] = self._low_update[i] + 1 if low else 0
            if r is not None:
                self._closest["min_update_rel"] = min(self._closest["min_update_rel"], r / med)
            if self._low_update[i] == self.patience:
                found.append(("layer_update_negligible", i,
                              f"layer {self._layers[i]} barely moves: update |dW|/|W| = {r:.3g} is {r / med:.2g} x "
                              f"the median layer's ({med:.3g}) for {self.patience} update checks in a row, below "
                              f"ratio_floor={self.ratio_floor:g}",
                              "check the optimizer's param groups and per-layer LR (a group with a tiny lr, layer-wise "
                              "LR decay gone wrong), weights that grew huge, or a layer the optimizer does not step",
                              {"update_ratio": r, "median_ratio": med, "relative": r / med}))
        return found

    def judge_lost(self, g_sq: list[float], dw_sq: list[float], w_sq: list[float], lr_sq: list[float],
                   nnz: list[float] | None = None) -> list[tuple]:
        """Each layer's update RMS against the step its optimizer should give (adaptive: ~lr per element that has a
        gradient -- ``nnz`` of them: unseen embedding rows have none; SGD: lr x the gradient); layers whose update
        is below ``lost_ratio`` x that (16-bit weights the optimizer writes directly, where the step is below half
        their spacing: 0.5 x) for ``patience`` checks are named, grouped by cause
        (one finding per cause, the layers listed). A step with no update anywhere is a skipped step (fp16 overflow,
        a skip policy): not judged, unless the weights are 16-bit with no fp32 master (the step may have rounded
        away everywhere)."""
        exp, n = self._expect, len(self._layers)
        if not any(v > 0 for v in dw_sq) and not (exp.direct and any(b is not None for b in exp.bits)):
            return []
        finite = [v for v in g_sq if math.isfinite(v)]
        gnorm = math.sqrt(sum(finite)) if len(finite) == len(g_sq) else math.nan
        coef = min(1.0, exp.clip / gnorm) if exp.clip and gnorm > 0 else 1.0
        named: dict[str, list[tuple[int, dict]]] = {}
        for i in range(n):
            numel, kind = self._numel_list[i], exp.kind[i]
            if kind is None or numel <= 0 or lr_sq[i] <= 0 or not (0 < g_sq[i] < math.inf):
                self._lost[i] = 0  # not judged: no optimizer mapping, lr 0 (warm-up's first step), no gradient
                continue
            lr, grms, wrms = (math.sqrt(lr_sq[i] / numel), math.sqrt(g_sq[i] / numel), math.sqrt(w_sq[i] / numel))
            moving = min(numel, nnz[i]) if nnz is not None and nnz[i] > 0 else numel  # elements with a gradient
            should = lr if kind == "adaptive" else lr * grms * math.sqrt(numel / moving)  # per moving element
            ratio = math.sqrt(dw_sq[i] / moving) / should
            self._lost_ratios[i] = ratio
            bits, spacing = exp.bits[i], wrms * 2.0 ** -exp.bits[i] if exp.bits[i] is not None else 0.0
            if bits is not None and not exp.direct and should < spacing:
                self._lost[i] = 0  # the 16-bit copy of an fp32 master moves by whole spacings: a smaller step is
                continue  # not seen step by step (norm gains at 1.0 under bf16 wait several steps)
            self._closest["min_update_vs_optimizer"] = min(self._closest["min_update_vs_optimizer"], ratio)
            floor = max(self.lost_ratio, 0.5) if bits is not None and should < spacing / 2 \
                else self.lost_ratio  # 16-bit weights the optimizer writes, a step below half their spacing
            self._lost[i] = self._lost[i] + 1 if ratio < floor else 0
            if self._lost[i] == self.patience:
                grms_moving = math.sqrt(g_sq[i] / moving)  # per element with a gradient: what eps is compared to
                cause = lost_cause(kind, should, grms_moving, exp.eps[i], coef, bits if exp.direct else None, wrms)
                named.setdefault(cause, []).append((i, {"ratio": ratio, "lr": lr, "grad_rms": grms_moving,
                                                        "weight_rms": wrms,
                                                        "update_rms": ratio * should, "eps": exp.eps[i],
                                                        "moving_fraction": moving / numel, "floor": floor}))
        found = [self._lost_finding(cause, layers, gnorm, coef) for cause, layers in named.items()
                 if cause not in self._lost_causes]  # a cause already reported: its later layers are listed only
        for cause, layers in named.items():
            self._lost_causes.setdefault(cause, []).extend(self._layers[i] for i, _ in layers)
        return found

    def _lost_finding(self, cause: str, layers: list[tuple[int, dict]], gnorm: float, coef: float) -> tuple:
        i, facts = min(layers, key=lambda x: x[1]["ratio"])
        exp, name = self._expect, self._layers[i]
        others = f" (and {len(layers) - 1} more: {', '.join(self._layers[j] for j, _ in layers if j != i)[:200]})" \
            if len(layers) > 1 else ""
        head = (f"layer {name}{others} moves {facts['ratio']:.2g} x the step its optimizer ({exp.optimizer_name}, "
                f"lr {facts['lr']:.3g}) should give (update RMS {facts['update_rms']:.3g} per element with a "
                f"gradient) for {self.patience} checks in a row, below "
                + (f"lost_ratio={self.lost_ratio:g}" if facts["floor"] == self.lost_ratio else
                   f"{facts['floor']:g} (16-bit weights, a step below half their spacing)"))
        why = explain(cause, facts, exp.clip, coef, gnorm)
        details = {"cause": cause, "layers": [self._layers[j] for j, _ in layers], "optimizer": exp.optimizer_name,
                   "clip": exp.clip, "clip_coef": coef, "grad_norm": gnorm if math.isfinite(gnorm) else None,
                   **facts}
        return ("layer_update_lost", i, head + why[0], why[1], details)

    # ---- findings: rank 0 writes (every rank took the same decision) -----------------------
    def _emit(self, trainer: Any, step: int, code: str, message: str, advice: str, details: dict) -> None:
        self.report_capped(trainer, "warning", code, f"step {step}: {message}", advice, details, rank=None,
                           step=step, limit=self.max_findings_per_code)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._params:
            self._read(trainer)  # COLLECTIVE (world > 1): the steps still queued, every rank
        if trainer.global_rank != 0 or not self._params:
            return
        med_rel = _column_medians(self._rel_hist, len(self._layers))
        med_upd = _column_medians(self._upd_hist, len(self._layers))
        table = ", ".join(f"{k} {u:.2g}" for k, u in zip(self._layers, med_upd) if u is not None)
        counts = ", ".join(f"{c} x{n}" for c, n in sorted(self._counts.items())) or "none"
        self.report(trainer, "info", "layer_summary",
                    f"{len(self._layers)} layers, {len(self._rel_hist)} gradient / {len(self._upd_hist)} update "
                    f"checks; median update ratio per layer: {table or 'not measured'}; findings: {counts}",
                    details={"layers": self._layers, "median_update_ratio": med_upd, "median_grad_rel": med_rel,
                             "update_lost": dict(self._lost_causes),
                             "counts": dict(self._counts), "source": self._source,
                             **{k: (v if math.isfinite(v) else None) for k, v in self._closest.items()}}, rank=None)


def _nonzero(g: torch.Tensor) -> torch.Tensor:
    """Non-zero elements of a gradient, on its device (a sparse embedding gradient: of its coalesced values)."""
    return g.coalesce().values().count_nonzero() if g.is_sparse else g.count_nonzero()


def _column_medians(rows: deque, n: int) -> list[float | None]:
    cols = [[r[i] for r in rows if r[i] is not None and math.isfinite(r[i])] for i in range(n)]
    return [statistics.median(c) if c else None for c in cols]


def _values(x: torch.Tensor | list[float]) -> list[float]:
    """Per-layer values as a list (the queue's rows are read once, as lists; tests pass tensors)."""
    return x if isinstance(x, list) else x.tolist()


_sumsq = sumsq_per_tensor  # grad_access.py: per tensor, on the device
