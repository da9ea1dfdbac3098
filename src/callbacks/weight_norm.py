"""`WeightNorm`: weights that shrink toward zero step after step, judged against the decay the optimizer is set for.

The config example and the table of findings: the class docstring (`WeightNorm`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import torch

from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import (_at_accumulation_boundary, base_optimizer, decay_coupled, display_name,
                                            grad_source, host_float, local_param, optimizer_param_groups,
                                            sumsq_per_tensor, unpadded)
from dsdebug.config.args import Rule, integer, number
from dsdebug.distributed import collectives

__all__ = ["WeightNorm", "decay_cause"]

log = logging.getLogger(__name__)
USUAL_DECAY = 0.2  # weight_decay above this is outside the usual 0.01-0.1 (AdamW)
_CAUSE_ORDER = ("coupled_l2", "decay", "outside")  # the causes a report names (decay_on_norm counts as decay); ties: the first


def decay_cause(coupled: bool, lr: float, weight_decay: float, decay_floor: float, ratio: float,
                one_dim: bool) -> str:
    """Why a weight's norm fell to ``ratio`` x its start: ``coupled_l2`` (an adaptive optimizer's weight_decay is L2
    added to the gradient); where the configured decay alone takes the norm down to ``decay_floor`` x by now, at
    least half of the fall in log terms: ``decay_on_norm`` (on a 1-D norm gain or bias), ``decay`` (a weight_decay
    above the usual, > USUAL_DECAY) or ``expected`` (a usual weight_decay over a long run: the equilibrium it is
    for); else ``outside`` (more than the configured decay can give: the loss's gradient or code outside the
    optimizer)."""
    if coupled and weight_decay > 0:
        return "coupled_l2"
    if weight_decay > 0 and lr > 0 and decay_floor <= math.sqrt(ratio):  # the decay gives half the log-fall
        return "decay_on_norm" if one_dim else "decay" if weight_decay > USUAL_DECAY else "expected"
    return "outside"


def _step_decay(momentum_sgd: bool, group: dict) -> float:
    """log of the factor the group's decay multiplies a weight by in one step (decoupled ``1 - lr * wd``; SGD with
    momentum: the L2 term accumulates in the momentum, ``lr * wd / (1 - momentum)`` in the steady state)."""
    lr, wd = host_float(group.get("lr", 0.0)), host_float(group.get("weight_decay", 0.0) or 0.0)
    if lr is None or wd is None:
        return 0.0
    shrink = lr * wd
    if momentum_sgd:
        shrink /= max(1e-3, 1.0 - (host_float(group.get("momentum", 0.0)) or 0.0))
    return math.log(max(1e-12, 1.0 - shrink)) if shrink < 1 else -27.6


class WeightNorm(DebugCallback):
    """`WeightNorm`: weights that shrink toward zero step after step, judged against the decay the optimizer is
    set for.

    A weight whose norm falls and keeps falling trains to nothing while the loss only looks slow:
    ``torch.optim.Adam(weight_decay=0.1)`` (L2 added to the gradient, which Adam then normalises: each weight moves
    toward 0 by up to ``lr`` per step, whatever its size; measured on the tiny DeepSeek net: half its norm by step 5,
    3 % by step 60), an L2 penalty in the loss under Adam (the same, built by hand), a ``weight_decay`` far above the
    usual 0.01-0.1 or applied to norm gains and biases, a hook or a manual ``p.mul_()`` shrinking weights outside
    the optimizer. Nothing else names it: layer_health compares layers with each other (every layer shrinks alike),
    the gradient norm stays healthy.

    How: at each checked step (``every_n_steps``, before the optimizer step) the sum of squares of each trainable
    parameter's weights is computed where they live (ZeRO-3: each rank's partition; ZeRO-1/2 and DDP: the weights
    every rank holds) and queued; every ``read_every_n_steps`` steps the queue is all-reduced once and read once
    (``[N x parameters]``, every rank, in ``on_train_batch_end``) and each step is judged in order. A parameter is
    named when its norm is below ``collapse_fraction`` x its norm at the first check and fell at each of the last
    ``patience`` checks (zero-initialised parameters, LoRA's B, are left out). The finding says what the optimizer
    is set for -- each group's lr x weight_decay per step, coupled or decoupled, accumulated over the run's
    schedule (host floats, no device read) -- and so which of the causes above it is. A usual weight_decay
    (<= 0.2) that explains the fall of a matrix over a long run is the equilibrium it is for: not reported, listed
    in the summary (norm gains and biases decayed are reported whatever the value). A fall the optimizer's
    settings do not explain is reported once the collapsed parameters hold ``share`` of the trainable weights:
    alone, a norm gain the loss wants smaller is learning (measured on the tiny DeepSeek under healthy AdamW: some
    attention norm gains at 0.5x by step 300); it is listed in the summary.

    Example::

        python train.py debug=full                                 # on in full
        python train.py +callbacks=weight_norm callbacks.weight_norm.collapse_fraction=0.3

    | finding code | severity | when |
    |---|---|---|
    | ``weight_collapse`` | error (the collapsed parameters hold >= ``share`` of the trainable weights), else warning | norm < ``collapse_fraction`` x its first and falling ``patience`` checks in a row |
    | ``weight_summary`` | info | at the end: the lowest norm ratios and the groups' accumulated decay |

    It logs no metrics. Resume (``state_attrs``): the first norms, the streaks, the parameters named and the
    accumulated decay carry over.
    """
    name = "weight_norm"
    policies = ("warn", "stop")
    policy_note = "skip: the collapse is judged up to read_every_n_steps steps after the updates that made it"
    state_attrs = ("_first", "_prev", "_falling", "_named", "_decay_log", "_lowest", "_checks", "_counts")

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(1),
        "collapse_fraction": number(0, 1, open_low=True, open_high=True),
        "patience": integer(1),
        "share": number(0, 1),
        "read_every_n_steps": integer(1),
        "max_findings_per_code": integer(1),
    }

    def __init__(self, every_n_steps: int = 1, collapse_fraction: float = 0.5, patience: int = 3,
                 share: float = 0.1, read_every_n_steps: int = 10, max_findings_per_code: int = 5,
                 on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(every_n_steps=every_n_steps, collapse_fraction=collapse_fraction, patience=patience,
                            share=share, read_every_n_steps=read_every_n_steps,
                            max_findings_per_code=max_findings_per_code)
        self.every_n_steps, self.patience, self.read_every = int(every_n_steps), int(patience), int(read_every_n_steps)
        self.collapse_fraction, self.share = float(collapse_fraction), float(share)
        self.max_findings_per_code = int(max_findings_per_code)
        self._params: list[torch.Tensor] = []
        self._names: list[str] = []
        self._queue: list[tuple[torch.Tensor, int, list[float]]] = []
        self._groups: list[dict] | None = None  # per parameter: its optimizer group (None: unknown)
        self._group_of: list[int] = []
        self._coupled: list[bool] = []
        self._momentum_sgd: list[bool] = []
        self._optimizer_name = "?"
        self._reset(0)

    def _reset(self, n: int) -> None:
        self._first: list[float | None] = [None] * n
        self._prev: list[float | None] = [None] * n
        self._falling = [0] * n
        # 0: above collapse_fraction or not falling; 1: collapsed, not reported; 2: reported; 3: the usual decay's
        self._named = [0] * n
        self._lowest: list[float | None] = [None] * n
        self._decay_log: list[float] = []
        self._checks = 0
        self._counts: dict[str, int] = {}

    # ---- setup: every rank --------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        named = [(display_name(n), p) for n, p in pl_module.named_parameters() if p.requires_grad]
        self._names, self._params = [n for n, _ in named], [p for _, p in named]
        self._numel = [float(getattr(p, "ds_numel", p.numel())) for p in self._params]
        self._one_dim = [len(getattr(p, "ds_shape", p.shape)) <= 1 for p in self._params]
        self._source = grad_source(trainer.strategy)
        self._groups = None  # mapped again at this fit's first optimizer step
        if len(self._first) != len(self._params):  # fresh, or (DDP restores first) a resume of another net
            self._reset(len(self._params))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self._params and len(self._first) != len(self._params):  # DeepSpeed restores after on_fit_start
            log.warning("weight_norm: the checkpoint's state is for %d parameters, this net has %d: starting afresh",
                        len(self._first), len(self._params))
            self._reset(len(self._params))

    def _map_groups(self, trainer: Any) -> None:
        """Each parameter's optimizer group (after the optimizer and DeepSpeed's engine exist)."""
        by_id = optimizer_param_groups(trainer) or {}
        groups: list[dict] = []
        self._group_of = []
        index: dict[int, int] = {}
        for p in self._params:
            g = by_id.get(id(p))
            if g is not None and id(g) not in index:
                index[id(g)] = len(groups)
                groups.append(g)
            self._group_of.append(index[id(g)] if g is not None else -1)
        self._groups = groups
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._coupled = [decay_coupled(optimizer, g) for g in groups]
        sgd = type(base_optimizer(optimizer)).__name__ == "SGD"
        self._momentum_sgd = [sgd and not g.get("nesterov") and (host_float(g.get("momentum", 0.0)) or 0.0) > 0
                              for g in groups]
        self._optimizer_name = type(base_optimizer(optimizer)).__name__ if optimizer is not None else "?"
        if len(self._decay_log) != len(groups):
            self._decay_log = [0.0] * len(groups)

    # ---- measure: local, every rank (no collective) ---------------------------------------
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._params or not _at_accumulation_boundary(trainer):
            return
        if self._groups is None:
            self._map_groups(trainer)
        step = trainer.global_step
        if self.due(step):  # the weights before this step's update, with the decay of the steps before it
            sq = sumsq_per_tensor([unpadded(local_param(p), p) for p in self._params])
            whole = 1 if self._source == "zero3" else trainer.world_size  # replicated weights: each rank's 1/world
            self._queue.append((sq / whole, step, list(self._decay_log)))
        for i, g in enumerate(self._groups):  # what the decay takes this step: host floats, no device read
            self._decay_log[i] += _step_decay(self._momentum_sgd[i], g)

    # ---- reduce + judge: EVERY rank --------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if len(self._queue) >= self.read_every or 0 < (getattr(trainer, "max_steps", 0) or -1) <= trainer.global_step:
            self._read(trainer)

    def read_queued(self, trainer: Any) -> None:
        self._read(trainer)

    def _read(self, trainer: Any) -> None:
        """COLLECTIVE (world > 1): one all-reduce of the queued ``[N x parameters]`` and one host read, every rank
        at the same step (the queue fills alike everywhere)."""
        queue, self._queue = self._queue, []
        if not queue:
            return
        rows = collectives.reduce(trainer, torch.stack([r.double() for r, _, _ in queue]), "sum").cpu().tolist()
        for row, (_, step, decay_log) in zip(rows, queue):
            self.judge(trainer, step, [math.sqrt(v) if v >= 0 and math.isfinite(v) else math.nan for v in row],
                       decay_log)

    def judge(self, trainer: Any, step: int, norms: list[float], decay_log: list[float]) -> list[str]:
        """One checked step's per-parameter weight norms (all-reduced); returns the parameters named now."""
        self._checks += 1
        collapsed: list[int] = []
        for i, norm in enumerate(norms):
            if not math.isfinite(norm):
                continue  # non-finite weights: nan_triage's and grad_monitor's business
            if self._first[i] is None:
                self._first[i] = norm
            first, prev = self._first[i], self._prev[i]
            self._prev[i] = norm
            if not first:
                continue  # zero-initialised: no scale to fall from
            ratio = norm / first
            self._lowest[i] = ratio if self._lowest[i] is None else min(self._lowest[i], ratio)
            self._falling[i] = self._falling[i] + 1 if prev is not None and norm < prev else 0
            if ratio >= self.collapse_fraction:
                self._named[i] = 0  # recovered: a later fall is a new episode
            elif self._falling[i] >= self.patience and not self._named[i]:
                self._named[i] = 1  # collapsed; reported once its cause is the config's or enough weights fell
        pending = [i for i, state in enumerate(self._named) if state == 1]
        if pending:
            collapsed = self._report_collapse(trainer, step, pending, norms, decay_log)
        return [self._names[i] for i in collapsed]

    def _group_facts(self, i: int, decay_log: list[float]) -> tuple[str, dict]:
        """The optimizer facts of parameter i's group: (cause, details)."""
        g = self._group_of[i] if i < len(self._group_of) else -1
        ratio = self._prev[i] / self._first[i]
        if g < 0 or self._groups is None:
            return "outside", {}
        group = self._groups[g]
        lr, wd = host_float(group.get("lr", 0.0)) or 0.0, host_float(group.get("weight_decay", 0.0) or 0.0) or 0.0
        floor = math.exp(decay_log[g]) if g < len(decay_log) else 1.0
        cause = decay_cause(self._coupled[g], lr, wd, floor, ratio, self._one_dim[i])
        return cause, {"group": g, "lr": lr, "weight_decay": wd, "coupled": self._coupled[g], "decay_floor": floor}

    def _report_collapse(self, trainer: Any, step: int, pending: list[int], norms: list[float],
                         decay_log: list[float]) -> list[int]:
        """Report the collapsed parameters not reported yet whose fall the optimizer's settings explain, or all of
        them once the collapsed parameters hold ``share`` of the trainable weights (a norm gain the loss wants
        smaller is learning, not a fault); returns those reported."""
        facts = {i: self._group_facts(i, decay_log) for i in pending}
        for i in pending:
            if facts[i][0] == "expected":
                self._named[i] = 3  # the usual decay's equilibrium: not a fault (the summary lists it)
        pending = [i for i in pending if self._named[i] == 1]
        held = sum(self._numel[i] for i, state in enumerate(self._named) if state in (1, 2)) / max(
            1.0, sum(self._numel))
        collapsed = pending if held >= self.share else [i for i in pending if facts[i][0] != "outside"]
        if not collapsed:
            return []
        for i in collapsed:
            self._named[i] = 2
        decay = ("decay", "decay_on_norm")
        causes = ["decay" if facts[i][0] in decay else facts[i][0] for i in collapsed]
        cause = max(_CAUSE_ORDER, key=lambda c: (causes.count(c), -_CAUSE_ORDER.index(c)))  # ties: a fixed order
        gains = [self._names[i] for i in collapsed if self._one_dim[i] and facts[i][0] in decay]
        worst = sorted(collapsed, key=lambda i: norms[i] / self._first[i])
        shown = ", ".join(f"{self._names[i]} {norms[i] / self._first[i]:.2f}x" for i in worst[:4])
        more = f" (+{len(worst) - 4} more)" if len(worst) > 4 else ""
        d = next(facts[i][1] for i in worst if (facts[i][0] in decay if cause == "decay" else facts[i][0] == cause))
        if cause != "outside" and not d:
            cause = "outside"  # a parameter no optimizer group holds (optimizer_coverage's business)
        if cause == "decay":
            cause = "decay_on_norm" if gains else "decay"
        name = self._optimizer_name
        if cause == "coupled_l2":
            why = (f"{name}'s weight_decay={d['weight_decay']:g} is an L2 term added to the gradient, which {name} "
                   f"then normalises: every weight moves toward 0 by up to lr={d['lr']:.3g} per step, whatever its "
                   "size")
            advice = ("use decoupled decay: torch.optim.AdamW (optim.optimizer._target_=torch.optim.AdamW; "
                      "DeepSpeed's FusedAdam/CPUAdam: adam_w_mode=true), or weight_decay=0")
        elif cause in ("decay", "decay_on_norm"):
            why = (f"the optimizer's decay, lr x weight_decay = {d['lr'] * d['weight_decay']:.3g} per step "
                   f"(weight_decay={d['weight_decay']:g}), alone takes a norm down to {d['decay_floor']:.2f}x by now")
            if cause == "decay_on_norm":
                why += f"; {', '.join(gains[:4])} are norm gains or biases, which are usually not decayed"
            advice = "keep norm gains and biases in a group with weight_decay=0"
            if d["weight_decay"] > USUAL_DECAY:
                advice = ("lower weight_decay (0.01-0.1 is usual with AdamW: optim.optimizer.weight_decay) and "
                          + advice)
        else:
            floor = ("" if not d else " (its weight_decay is 0)" if not d["weight_decay"] else
                     f" (by now at most down to {d['decay_floor']:.2f}x)")
            why = (f"more than the optimizer's decay can give{floor}: the loss's gradient pulls the weights to 0 (an L2 "
                   "or norm penalty added to the loss, under Adam normalised to ~lr per step) or code outside the "
                   "optimizer shrinks them (a hook, a manual p.mul_() or p.data assignment)")
            advice = ("look for a penalty on the weights in the loss (with Adam, use AdamW's decay instead) and for "
                      "code that writes to parameters outside the optimizer step")
        severity = "error" if held >= self.share else "warning"
        message = (f"step {step}: weights collapsing: {len(collapsed)} parameter(s) fell below "
                   f"{self.collapse_fraction:g}x their first norm, falling {self.patience} checks in a row: "
                   f"{shown}{more}; {why}")
        details = {"params": [self._names[i] for i in worst], "param": self._names[worst[0]],
                   "ratios": [norms[i] / self._first[i] for i in worst], "share": held, "cause": cause,
                   "optimizer": name, **d}
        self.report_capped(trainer, severity, "weight_collapse", message, advice, details, step=step,
                           limit=self.max_findings_per_code)
        return collapsed

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._params:
            self._read(trainer)  # COLLECTIVE (world > 1): the steps still queued, every rank
        if trainer.global_rank != 0 or not self._params:
            return
        low = sorted((r, n) for r, n in zip(self._lowest, self._names) if r is not None)[:3]
        decay = [math.exp(v) for v in self._decay_log]
        quiet = [n for n, state in zip(self._names, self._named) if state == 1]
        settled = [n for n, state in zip(self._names, self._named) if state == 3]
        self.report(trainer, "info", "weight_summary",
                    f"{len(self._params)} parameters over {self._checks} checks; lowest norm vs the first: "
                    + (", ".join(f"{n} {r:.2f}x" for r, n in low) or "not measured")
                    + (f"; lr x weight_decay over the run compounds to {', '.join(f'{v:.2f}x' for v in decay)} per "
                       "group" if decay else "")
                    + (f"; below {self.collapse_fraction:g}x following their gradient, not reported (under "
                       f"{self.share:g} of the weights): {', '.join(quiet[:4])}" if quiet else "")
                    + (f"; below {self.collapse_fraction:g}x where a usual weight_decay settles them: "
                       f"{', '.join(settled[:4])}" if settled else ""),
                    details={"lowest": [{"param": n, "ratio": r} for r, n in low], "decay_floor": decay,
                             "collapsed_unreported": quiet, "settled_by_decay": settled,
                             "counts": dict(self._counts)}, rank=None)
