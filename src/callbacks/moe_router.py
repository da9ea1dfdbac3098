"""`MoERouter`: MoE router health -- collapse, dead experts, load imbalance, aux-loss trend.

The config example and the table of metrics and findings: the class docstring (`MoERouter`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import torch

from dsdebug.config.args import Rule, integer, number
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import step_loss
from dsdebug.models.moe_aux import normalised_probs
from dsdebug.distributed import collectives

__all__ = ["MoERouter", "record_stats", "window_stats"]
log = logging.getLogger(__name__)


class MoERouter(DebugCallback):
    """`MoERouter`: MoE router health -- collapse, dead experts, load imbalance, aux-loss trend.

    Catches a router that sends (nearly) every token to the same expert(s), experts that receive no
    token at all, persistent load imbalance, and a balance (aux) loss that keeps climbing. It taps
    the routing the module already captures (``MoEBalance.observe``: the chosen top-k experts and the
    router logits of every training forward, every MoE layer, DeepSeek V2/V3 and HF Mixtral /
    Qwen-MoE / OLMoE routers), counts tokens per expert per layer on each rank, and closes a window
    every ``window_steps`` optimizer steps (and at ``max_steps``): the window's
    ``[layers x experts]`` counts, entropy sums and aux/CE sums are ONE all-reduce on every rank, so
    every decision is global and the same on all ranks; rank 0 writes the findings (rank=None).
    Windows starting before ``warmup_steps`` are logged, not judged (random-init routers are jumpy);
    instead the first ``early_steps`` steps are judged ONE BY ONE against the prior of a fresh router,
    near-uniform load: a layer whose load is concentrated (an expert chosen by >= ``collapse_tokens``
    of the step's tokens, or load entropy < ``collapse_entropy``) for ``early_patience`` steps in a row
    has collapsed from initialisation (a biased gate, tied scores). Only the step before the first
    update holds that prior: a healthy tiny DeepSeek-V3 spread its load at step 0 (busiest expert 43%
    of the tokens, load entropy 0.93) but concentrated it as soon as the LR was up (91% at step 2 with
    a 20-step warm-up, at step 1 with a 1-step warm-up), before the balance loss spreads it again.
    That costs one small all-reduce per step during those steps only.
    Works under ddp, ZeRO-1/2/3 (the hooks see the router's outputs; no parameter is read).

    Router entropy is per token, from the router's logits (softmax; DeepSeek-V3: its sigmoid scores
    normalised to sum 1), averaged over tokens, divided by log E: 1 = the router cannot decide, low =
    confident (healthy routers grow confident; this is information, not a finding). Collapse is
    judged on the LOAD: ``load_entropy`` = (H(load) - log k) / (log E - log k), 1 = uniform over the
    E experts, 0 = every token on the same top-k experts.

    Example::

        python train.py +callbacks=moe_router callbacks.moe_router.window_steps=20 trainer=ddp_sim strategy=zero3

    | metric key (at each window) | meaning |
    |---|---|
    | ``moe_router/entropy/L<i>`` | mean per-token router entropy / log E, decoder layer i |
    | ``moe_router/load_entropy/L<i>`` | normalised entropy of the window's token load (1 uniform, 0 collapsed) |
    | ``moe_router/max_share/L<i>`` | busiest expert's share of the layer's routed token-slots (uniform: 1/E) |
    | ``moe_router/dead/L<i>`` | experts that got no token in the window (see ``dead_below``) |
    | ``moe_router/aux_loss`` | window mean of ``train/aux_loss`` / its balanced value (1 = balanced) |

    | finding code | severity | when (full windows after ``warmup_steps``) |
    |---|---|---|
    | ``router_collapse`` | error | an expert is chosen by >= ``collapse_tokens`` of a layer's tokens |
    | ``router_collapse`` | warning | a layer's ``load_entropy`` < ``collapse_entropy`` |
    | ``router_collapse`` | error/warning | the same, per step over the first ``early_steps`` steps, ``early_patience`` in a row |
    | ``dead_experts`` | warning | experts with share <= ``dead_below`` x 1/E (0: no token at all), named per layer |
    | ``load_imbalance`` | warning | max/mean load > ``imbalance_max`` for ``imbalance_windows`` windows in a row |
    | ``aux_loss_rising`` | warning | window aux loss rose ``aux_windows`` times in a row, to > (1+``aux_rise``) x its minimum |
    | ``router_summary`` | info | at the end: per-layer entropy, load entropy, max share, dead experts, token share matrix |

    Resume (``state_attrs``, from all-reduced windows, alike on every rank): per layer the imbalanced
    windows in a row, the dead experts already named, the judged windows' aux/CE means and the
    rising-aux flag, the finding counts. A window open at the checkpoint starts afresh (its counts are
    each rank's own), and the summary's token shares cover the steps since the (re)start.
    """
    name = "moe_router"
    policies = ("warn", "stop")
    policy_note = "skip: a window is judged after its steps were applied"
    state_attrs = ("_imbalanced", "_dead_seen", "_aux", "_aux_reported", "_counts")

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "window_steps": integer(1),
        "warmup_steps": integer(0),
        "collapse_tokens": number(0, 1, open_low=True),
        "collapse_entropy": number(0, 1, open_high=True, note="0 = off"),
        "dead_below": number(0, 1, open_high=True),
        "imbalance_max": number(1, open_low=True),
        "imbalance_windows": integer(1),
        "aux_rise": number(0),
        "aux_windows": integer(0, note="0 = off"),
        "max_findings_per_code": integer(1),
        "early_steps": integer(0, note="0 = off"),
        "early_patience": integer(1),
    }

    def __init__(self, window_steps: int = 50, warmup_steps: int = 100, collapse_tokens: float = 0.9,
                 collapse_entropy: float = 0.3, dead_below: float = 0.0, imbalance_max: float = 3.5,
                 imbalance_windows: int = 2, aux_rise: float = 0.5, aux_windows: int = 3,
                 max_findings_per_code: int = 5, on_error: str = "warn", early_steps: int = 1,
                 early_patience: int = 1) -> None:
        super().__init__(on_error=on_error)
        self.check_declared(window_steps=window_steps, warmup_steps=warmup_steps, collapse_tokens=collapse_tokens,
                            collapse_entropy=collapse_entropy, dead_below=dead_below, imbalance_max=imbalance_max,
                            imbalance_windows=imbalance_windows, aux_rise=aux_rise, aux_windows=aux_windows,
                            max_findings_per_code=max_findings_per_code, early_steps=early_steps,
                            early_patience=early_patience)
        self.early_steps, self.early_patience = early_steps, early_patience
        self.window_steps, self.warmup_steps = window_steps, warmup_steps
        self.collapse_tokens, self.collapse_entropy = float(collapse_tokens), float(collapse_entropy)
        self.dead_below, self.imbalance_max = float(dead_below), float(imbalance_max)
        self.imbalance_windows, self.aux_rise, self.aux_windows = imbalance_windows, float(aux_rise), aux_windows
        self.max_findings_per_code = max_findings_per_code
        self._moe = None
        self._counts: dict[str, int] = {}
        self._imbalanced: list[int] = []
        self._dead_seen: set[tuple[int, int]] = set()  # (layer, expert) already named
        self._aux: list[tuple[float, float]] = []
        self._aux_reported = False
        self._restored: dict[str, Any] | None = None  # a resume's state, until on_fit_start knows the layers

    # ---- setup: every rank ----------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        moe = getattr(pl_module, "moe", None)
        self._observer = self.guarded(self._on_forward, "the router observer")  # runs in the model's forward
        self._moe = moe if moe is not None and moe.observe(self._observer) else None
        if self._moe is None:
            if trainer.global_rank == 0:
                self.report(trainer, "info", "no_routers", f"{type(getattr(pl_module, 'net', pl_module)).__name__} "
                            "has no MoE routers: moe_router checks nothing", rank=None)
            return
        self.layers, self.experts, self.top_k = list(moe.layers), moe.num_experts, moe.top_k
        self.aux_balanced = float(self.top_k) if moe.source == "model" else 1.0  # HF's scale: top_k; ours: 1
        n = len(self.layers)
        # the window's sums stay where the routing is (no host read per step: one at each window's close)
        device = getattr(pl_module, "device", None) or torch.device("cpu")
        self._window = torch.zeros(n * self.experts + 2 * n + 4, dtype=torch.float64, device=device)
        self._step_counts = torch.zeros(n, self.experts, dtype=torch.float64, device=device)  # this step's (early rule)
        self._early_streak, self._early_named = [0] * n, set()
        self._early_closest = {"max_expert_frac": 0.0, "min_load_entropy": 1.0, "per_step": []}
        self._total = torch.zeros(n, self.experts, dtype=torch.float64)
        self._start = self._first = trainer.global_step  # again in on_train_start (after a resume)
        self._counts = {}
        self._imbalanced = [0] * n
        self._dead_seen = set()
        self._aux = []  # (aux, ce) window means, judged windows
        self._aux_reported = False
        self._last: dict | None = None
        if self._restored is not None:  # DDP: Lightning restored it before this hook reset the state
            self._apply_restored()
        log.info("moe_router: %d MoE layer(s) x %d experts, top-%d; window %d steps, judged from step %d",
                 n, self.experts, self.top_k, self.window_steps, self.warmup_steps)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._restored = None  # applied: Lightning restores before on_fit_start (DDP) or after it (DeepSpeed)
        if self._moe is not None:  # the loop state is restored now: windows count from the resumed step
            self._start = self._first = trainer.global_step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict
        self._apply_restored()

    def _apply_restored(self) -> None:
        saved, layers = len(self._restored.get("_imbalanced", ())), getattr(self, "layers", None)
        if layers is not None and saved != len(layers):
            log.warning("moe_router: the checkpoint's state is for %d MoE layers, this net has %d: starting afresh",
                        saved, len(layers))
            return
        super().load_state_dict(self._restored)

    def _on_forward(self, records: list, aux: torch.Tensor | None) -> None:
        """Inside every training forward, every rank: local counts only (no collective)."""
        if len(records) != len(self.layers):
            return  # e.g. a partial forward; nothing reliable to count
        counts, ent, tokens = record_stats(records, self.experts)
        n, w = len(self.layers), self._window
        if counts.device != w.device:  # the routing moved (a first forward before on_fit_start placed it)
            self._window, self._step_counts = w.to(counts.device), self._step_counts.to(counts.device)
            w = self._window
        w[: n * self.experts] += counts.reshape(-1)
        self._step_counts += counts.reshape(n, self.experts)
        w[n * self.experts: n * self.experts + n] += ent
        w[n * self.experts + n: n * self.experts + 2 * n] += tokens.to(w.device)
        if aux is not None:  # on the device: read at the window's close
            w[-4] += aux.detach().double().reshape(()).to(w.device) / self.aux_balanced
            w[-3] += 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._moe is None:
            return
        ce = step_loss(pl_module, outputs)
        if isinstance(ce, torch.Tensor):  # a non-finite loss is left out, decided on the device (no host read)
            ce = ce.detach().double().reshape(()).to(self._window.device)
            finite = torch.isfinite(ce)
            self._window[-2] += torch.where(finite, ce, torch.zeros_like(ce))
            self._window[-1] += finite.double()
        step = trainer.global_step  # same on every rank: the window closes at the same point everywhere
        counts, self._step_counts = self._step_counts, torch.zeros_like(self._step_counts)
        if step - 1 < self.early_steps:  # every rank: the same steps
            self._judge_early(trainer, pl_module, counts, step - 1)
        done = step - self._start
        if done >= self.window_steps or (done > 0 and 0 < (trainer.max_steps or -1) <= step):
            self._close(trainer, pl_module, self._start, step, full=done >= self.window_steps)

    # ---- a window: EVERY rank, same branches (decisions use all-reduced values) -------------
    def _close(self, trainer: Any, pl_module: Any, start: int, end: int, full: bool) -> None:
        vec, self._window = self._window, torch.zeros_like(self._window)
        self._start = end
        # COLLECTIVE (world > 1): one small all-reduce per window, every rank; then the window's one host read
        vec = collectives.reduce(trainer, vec, "sum").cpu()
        n, e = len(self.layers), self.experts
        counts = vec[: n * e].reshape(n, e)
        if counts.sum() <= 0:
            return
        self._total += counts
        st = window_stats(counts, vec[n * e: n * e + n], vec[n * e + n: n * e + 2 * n], self.top_k)
        dead = [[x for x in range(e) if st["share"][i, x] <= self.dead_below / e] for i in range(n)]
        aux = float(vec[-4] / vec[-3]) if vec[-3] > 0 else None
        ce = float(vec[-2] / vec[-1]) if vec[-1] > 0 else None
        self._last = {"entropy": st["entropy"].tolist(), "load_entropy": st["load_entropy"].tolist(),
                      "max_share": st["max_share"].tolist(), "dead": dead, "steps": (start, end - 1)}
        if trainer.global_rank == 0:  # loggers write on rank 0 only; no collective here
            metrics = {f"moe_router/{k}/L{layer}": (len(dead[i]) if k == "dead" else self._last[k][i])
                       for k in ("entropy", "load_entropy", "max_share", "dead") for i, layer in enumerate(self.layers)}
            if aux is not None:
                metrics["moe_router/aux_loss"] = aux
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=end - 1)
        if full and start >= self.warmup_steps:
            self._judge(trainer, pl_module, st, dead, aux, ce, f"steps {start}-{end - 1}")

    def _judge(self, trainer: Any, pl_module: Any, st: dict, dead: list, aux: float | None,
               ce: float | None, where: str) -> None:
        e, k = self.experts, self.top_k
        for i, layer in enumerate(self.layers):
            frac, share = st["token_frac"][i], st["share"][i]
            toks = int(st["tokens"][i])
            order = sorted(range(e), key=lambda x: -float(share[x]))
            top = ", ".join(f"E{x} {float(frac[x]):.0%}" for x in order[:4])
            hot = [x for x in order if float(frac[x]) >= self.collapse_tokens]
            spread = float(st["load_entropy"][i])
            info = {"layer": layer, "tokens": toks, "tokens_frac": {f"E{x}": round(float(frac[x]), 4) for x in order},
                    "load_entropy": spread, "imbalance": float(st["imbalance"][i])}
            if hot or spread < self.collapse_entropy:
                why = (f"expert(s) {', '.join(f'E{x}' for x in hot)} chosen by >= {self.collapse_tokens:.0%} of tokens"
                       if hot else f"load entropy {spread:.2f} < collapse_entropy={self.collapse_entropy:g}")
                self._emit(trainer, pl_module, "error" if hot else "warning", "router_collapse",
                           f"router collapse in layer {layer} over {where} ({toks} tokens, all ranks): {why}; "
                           f"tokens choosing each expert: {top} (uniform {k / e:.0%}); load entropy {spread:.2f}",
                           "the router sends most tokens to the same experts: raise the balance loss "
                           "(model.moe_aux_loss_coef), lower the LR, check router init/bias (V3 "
                           "e_score_correction_bias) and that the aux loss reaches the router",
                           {**info, "experts": [f"E{x}" for x in (hot or order[:k])]})
            new_dead = [x for x in dead[i] if (layer, x) not in self._dead_seen]
            if new_dead:
                self._dead_seen.update((layer, x) for x in new_dead)
                self._emit(trainer, pl_module, "warning", "dead_experts",
                           f"{len(dead[i])}/{e} expert(s) of layer {layer} got "
                           f"{'no token' if self.dead_below == 0 else f'<= {self.dead_below:g} x the uniform share'}"
                           f" over {where} ({toks} tokens, all ranks): {', '.join(f'E{x}' for x in dead[i])}",
                           "a dead expert learns nothing: check the router's bias/logits for those experts, "
                           "raise the balance loss; a capacity/drop bug or a -inf mask can also starve them",
                           {**info, "experts": [f"E{x}" for x in dead[i]]})
            self._imbalanced[i] = self._imbalanced[i] + 1 if float(st["imbalance"][i]) > self.imbalance_max else 0
            if self._imbalanced[i] == self.imbalance_windows:
                self._emit(trainer, pl_module, "warning", "load_imbalance",
                           f"load imbalance in layer {layer}: busiest expert E{order[0]} gets "
                           f"{float(st['imbalance'][i]):.2f}x the mean load (> imbalance_max={self.imbalance_max:g}) "
                           f"for {self.imbalance_windows} window(s) up to {where}; tokens per expert: {top}",
                           "raise the balance loss coefficient or its warm-up; an overloaded expert "
                           "becomes a hot spot (memory, time, dropped tokens with capacity limits)", info)
        self._judge_aux(trainer, pl_module, aux, ce, where)

    def _judge_early(self, trainer: Any, pl_module: Any, counts: torch.Tensor, step: int) -> None:
        """One step's load against a fresh router's prior (near uniform): EVERY rank, same branches."""
        # COLLECTIVE (world > 1): one small all-reduce per step, first early_steps steps only; a host read each
        counts = collectives.reduce(trainer, counts, "sum").cpu()
        if counts.sum() <= 0:
            return
        st = window_stats(counts, torch.zeros(len(self.layers)), counts.sum(-1) / self.top_k, self.top_k)
        close = self._early_closest
        close["per_step"].append([step, round(float(st["token_frac"].max()), 4),
                                  round(float(st["load_entropy"].min()), 4)])
        for i, layer in enumerate(self.layers):
            frac, spread = st["token_frac"][i], float(st["load_entropy"][i])
            close["max_expert_frac"] = max(close["max_expert_frac"], float(frac.max()))
            close["min_load_entropy"] = min(close["min_load_entropy"], spread)
            hot = [x for x in range(self.experts) if float(frac[x]) >= self.collapse_tokens]
            bad = bool(hot) or spread < self.collapse_entropy
            self._early_streak[i] = self._early_streak[i] + 1 if bad else 0
            if self._early_streak[i] != self.early_patience or layer in self._early_named:
                continue
            self._early_named.add(layer)
            order = sorted(range(self.experts), key=lambda x: -float(frac[x]))
            top = ", ".join(f"E{x} {float(frac[x]):.0%}" for x in order[:4])
            why = (f"expert(s) {', '.join(f'E{x}' for x in hot)} chosen by >= {self.collapse_tokens:.0%} of tokens"
                   if hot else f"load entropy {spread:.2f} < collapse_entropy={self.collapse_entropy:g}")
            self._emit(trainer, pl_module, "error" if hot else "warning", "router_collapse",
                       f"router collapse in layer {layer} from the first steps ({self.early_patience} steps in a row up "
                       f"to step {step}, {int(st['tokens'][i])} tokens this step, all ranks): {why}; tokens choosing "
                       f"each expert: {top} (a fresh router spreads them: uniform {self.top_k / self.experts:.0%})",
                       "collapsed at initialisation: check the gate's init (a bias or one huge row, rows copied "
                       "over each other so scores tie), V3's e_score_correction_bias, and that the router's input "
                       "is not constant",
                       {"layer": layer, "early": True, "load_entropy": spread,
                        "tokens_frac": {f"E{x}": round(float(frac[x]), 4) for x in order},
                        "experts": [f"E{x}" for x in (hot or order[:self.top_k])]})

    def _judge_aux(self, trainer: Any, pl_module: Any, aux: float | None, ce: float | None, where: str) -> None:
        if aux is None or not self.aux_windows:
            return
        self._aux.append((aux, ce if ce is not None else math.nan))
        series = [a for a, _ in self._aux]
        low = min(series)
        tail = series[-self.aux_windows - 1:]
        rising = len(tail) == self.aux_windows + 1 and all(b > a for a, b in zip(tail, tail[1:]))
        if rising and aux > (1 + self.aux_rise) * low and not self._aux_reported:
            self._aux_reported = True  # once per rising streak
            ces = [c for _, c in self._aux[-self.aux_windows - 1:]]
            ce_txt = (f"while CE fell {ces[0]:.3f} -> {ces[-1]:.3f} (the router trades balance for loss)"
                      if ces[-1] < ces[0] else f"and CE did not fall ({ces[0]:.3f} -> {ces[-1]:.3f})")
            self._emit(trainer, pl_module, "warning", "aux_loss_rising",
                       f"balance (aux) loss rose {self.aux_windows} windows in a row up to {where}: "
                       f"{' -> '.join(f'{a:.3f}' for a in tail)} x balanced (minimum {low:.3f}), {ce_txt}",
                       "a collapse in the making: raise model.moe_aux_loss_coef, check it is applied "
                       "(train/loss_total) and look at moe_router/load_entropy per layer",
                       {"aux_windows": tail, "aux_min": low, "ce_windows": ces})
        elif not rising:
            self._aux_reported = False

    def _emit(self, trainer: Any, pl_module: Any, severity: str, code: str, message: str, advice: str,
              details: dict) -> None:
        """Called on EVERY rank with the same decision: rank 0 writes, every rank applies the policy."""
        self.report_capped(trainer, severity, code, message, advice, details, rank=None,
                           step=trainer.global_step - 1, limit=self.max_findings_per_code)

    def release(self, trainer: Any) -> None:
        """The router observer off the model (base.py)."""
        if self._moe is not None:
            self._moe.unobserve(self._observer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._moe is None:
            return
        self.release(trainer)
        if trainer.global_rank != 0:
            return
        if self._last is None:
            self.report(trainer, "info", "router_summary", "no window closed (the run was shorter than one "
                        f"window of {self.window_steps} steps)", rank=None)
            return
        share = self._total / self._total.sum(-1, keepdim=True).clamp_min(1.0)
        per_layer = "; ".join(
            f"L{layer}: entropy {self._last['entropy'][i]:.2f}, load entropy {self._last['load_entropy'][i]:.2f}, "
            f"max share {self._last['max_share'][i]:.3f}, dead {len(self._last['dead'][i])}"
            for i, layer in enumerate(self.layers))
        counts = ", ".join(f"{c} x{n}" for c, n in sorted(self._counts.items())) or "none"
        self.report(trainer, "info", "router_summary",
                    f"{len(self.layers)} MoE layer(s) x {self.experts} experts, top-{self.top_k}, steps "
                    f"{self._first}-{trainer.global_step - 1}; last window ({self._last['steps'][0]}-"
                    f"{self._last['steps'][1]}): {per_layer}; findings: {counts}",
                    details={"layers": self.layers, "experts": self.experts, "top_k": self.top_k,
                             "steps": [self._first, trainer.global_step - 1],
                             "share": {f"L{layer}": share[i].tolist() for i, layer in enumerate(self.layers)},
                             "last_window": self._last, "early": self._early_closest,
                             "counts": dict(self._counts)}, rank=None)


# -- statistics, pure tensor math: per-expert token counts and router entropy of the recorded
# routing, and a window's load balance / dead experts / collapse numbers
@torch.no_grad()
def record_stats(records: list, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward's token-slot counts ``[L, E]``, summed per-token router entropy ``[L]`` and tokens ``[L]``.
    Batched over layers (one bincount, one entropy), not one reduction per layer."""
    if len({(r.logits.shape, r.topk_indices.shape, r.score_func) for r in records}) > 1:  # layers differ
        parts = [record_stats([r], num_experts) for r in records]
        return tuple(torch.cat(t) for t in zip(*parts))  # type: ignore[return-value]
    n = len(records)
    idx = torch.stack([r.topk_indices.reshape(-1) for r in records])  # where the routing ran: no host copy
    idx = idx + torch.arange(n, device=idx.device).unsqueeze(1) * num_experts
    # counts by sort + searchsorted: deterministic on CUDA too (bincount's atomics are not, and under
    # debug=full's deterministic mode PyTorch would flag our own op)
    ordered = torch.sort(idx.reshape(-1)).values
    edges = torch.searchsorted(ordered, torch.arange(n * num_experts + 1, device=idx.device, dtype=ordered.dtype))
    counts = edges.diff().reshape(n, num_experts).double()
    probs = normalised_probs(torch.stack([r.logits.detach() for r in records]), records[0].score_func)
    entropy = torch.special.entr(probs).sum(-1).sum(-1).double()
    return counts, entropy, torch.full((n,), float(probs.shape[1]), dtype=torch.float64, device=counts.device)


def window_stats(counts: torch.Tensor, ent_sum: torch.Tensor, tokens: torch.Tensor, top_k: int) -> dict:
    """Per-layer statistics of one (all-reduced) window; tensors of length L unless noted."""
    experts = counts.shape[-1]
    share = counts / counts.sum(-1, keepdim=True).clamp_min(1.0)  # [L, E], rows sum to 1
    h = -(share * share.clamp_min(1e-30).log()).sum(-1)
    span = math.log(experts) - math.log(top_k)
    return {"share": share, "token_frac": share * top_k, "max_share": share.max(-1).values,
            "imbalance": share.max(-1).values * experts,
            "load_entropy": (h - math.log(top_k)) / span if span > 0 else torch.ones_like(h),
            "entropy": ent_sum / tokens.clamp_min(1.0) / math.log(max(experts, 2)), "tokens": tokens}
