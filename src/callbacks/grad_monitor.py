"""`GradMonitor`: gradient norms, NaN/Inf, explosions, spikes and vanishing layers, before the update.

The config example and the table of metrics and findings: the class docstring (`GradMonitor`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import torch

from dsdebug.distributed import collectives
from dsdebug.config.args import Rule, either, integer, number, optional
from dsdebug.errors import ConfigError
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import (_at_accumulation_boundary, display_name, grad_source, layer_of, run_clip,
                                            local_grad, local_param, sumsq_per_tensor)
from dsdebug.callbacks.loss_scale import OverflowJudge, read_scaler

__all__ = ["GradMonitor"]

log = logging.getLogger(__name__)


CLIP_STEPS = 5  # finite steps in a row whose norm is judged against the clip threshold


class GradMonitor(DebugCallback):
    """`GradMonitor`: gradient norms, NaN/Inf, explosions, spikes and vanishing layers, before the update.

    Catches: a NaN/Inf gradient (named: first offending parameter, its layer,
    step, batch, and the rank whose loss was already non-finite, if any), exploding gradients
    (global norm above ``max_norm``), sudden spikes against an EMA of the global norm, and layers
    whose gradient vanished. It runs in ``on_before_optimizer_step``: after backward, before
    clipping and the update, so a bad step is reported (and with ``on_error=skip|stop``
    dropped) before it reaches the weights. ``stop`` also drops the bad update, so the
    checkpoint it saves holds the last good weights.

    Host reads (a device sync each on a GPU): with ``on_error=warn`` the step's per-parameter sums of
    squares and loss flags stay on the device and are all-reduced, read and judged every
    ``read_every_n_steps`` steps (default 10: one all-reduce of ``[N x (params + world)]``, one host read;
    also at each ``every_n_steps`` metrics step, whose metrics need that step's gradients): every step is
    judged in order with its own step and batch, so a NaN is named up to N - 1 steps after it arose, at the
    step it arose, and "weights still finite" describes the weights when it is read. ``skip`` and ``stop``
    act before the update, so they read every step (``read_every_n_steps`` 1 or null with them).

    Correct under every strategy: with DDP (and one process) it reads ``param.grad``; under
    ZeRO-1/2 (``param.grad`` is None there after the reduction, verified) it reads each rank's
    fp32 gradient fragment (``param._hp_mapping``); under ZeRO-3 the local partition
    (``deepspeed.utils.safe_get_local_grad``). The per-parameter sums of squares are then
    all-reduced once per step, so norms are exact and no per-parameter collective runs. Only
    histograms need whole gradients (``safe_get_full_grad``, every rank, at their cadence).
    With DeepSpeed gradient accumulation it checks at the accumulation boundary only.

    fp16 (``dsdebug.callbacks.loss_scale``): norms are of the unscaled gradients. DeepSpeed unscales inside
    its step, after this hook, so its gradients are divided by the current loss scale here (a python
    number: no host read); torch AMP has unscaled them already. A step whose loss is finite but whose
    gradients overflowed is the dynamic loss scaler's job (it skips the update and lowers the scale):
    counted in the summary, not a finding -- through the scaler's initial search for a scale and up to 3
    overflows in a row after it. A non-finite loss, the 4th overflow in a row, or one at the scale's
    floor is ``nonfinite_grad`` (mixed_precision's ``overflow_streak`` / ``loss_scale_min`` judge the scaler).

    Example::

        python train.py +callbacks=grad_monitor callbacks.grad_monitor.every_n_steps=5 \\
            callbacks.grad_monitor.on_error=skip strategy=zero3 trainer=ddp_sim

    | metric key (every ``every_n_steps``) | meaning |
    |---|---|
    | ``grad/norm/global`` | L2 norm of all gradients, before clipping |
    | ``grad/norm_ema`` | EMA of the global norm (what spikes are judged against) |
    | ``grad/max_abs`` | largest absolute gradient element |
    | ``grad/norm/<layer>`` | L2 norm per layer (``model.layers.3``; else the owning module) |
    | ``grad/param_norm/<param>`` | per parameter, when ``log_param_norms: true`` |
    | ``grad/hist/<param>`` | TensorBoard histogram every ``histogram_every_n_steps`` (0 = off) |

    | finding code | severity | when |
    |---|---|---|
    | ``nonfinite_grad`` | error | a gradient holds NaN/Inf (every step; fp16: not an overflow the loss scaler absorbs) |
    | ``grad_exploding`` | error | global norm > ``max_norm`` (every step) |
    | ``grad_spike`` | warning | norm > max(``spike_min_ratio`` x EMA, EMA + ``spike_factor`` x std), after ``warmup_steps``; before: norm > ``early_factor`` x the median of the healthy norms so far (>= 3 steps) |
    | ``vanishing_grad`` | warning | a trainable layer's norm < ``vanish_threshold`` (at the cadence, after warm-up) |
    | ``clip_dominates`` | warning | the global norm of 5 steps in a row is >= ``clip_shrink`` x the clip threshold (``optim.grad_clip`` / a ds_config's ``gradient_clipping``): clipping shrinks every update by orders of magnitude, the LR acts as LR / that factor (judged from the first steps) |
    | ``grad_summary`` | info | at the end: steps checked, largest norm, anomaly counts |

    Resume (``state_attrs``, from all-reduced norms, alike on every rank): the EMA mean/variance of the
    global norm, the healthy steps seen (warm-up), the layers already reported vanished, the finding
    counts and the summary's steps checked and largest norm.
    """
    name = "grad_monitor"
    state_attrs = ("_ema_mean", "_ema_var", "_healthy_seen", "_vanished", "_counts", "_checked", "_largest",
                   "_early_norms", "_clip_ratios")

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(0, note="0 = no metrics"),
        "max_norm": number(0, open_low=True),
        "spike_factor": number(0, open_low=True),
        "spike_min_ratio": number(1),
        "ema_beta": number(0, 1, open_low=True, open_high=True),
        "warmup_steps": integer(1),
        "vanish_threshold": number(0, note="0 = off"),
        "histogram_every_n_steps": integer(0, note="0 = off"),
        "max_findings_per_code": integer(1),
        "early_factor": either(number(1, open_low=True), number(0, 0), valid="a number > 1 (0 = off)"),
        "clip_shrink": either(number(1, open_low=True), number(0, 0), valid="a number > 1 (0 = off)"),
        "read_every_n_steps": optional(integer(1), "auto: 10 with on_error=warn, 1 with skip or stop"),
    }

    def __init__(self, every_n_steps: int = 10, max_norm: float = 1.0e3, spike_factor: float = 6.0,
                 spike_min_ratio: float = 3.0, ema_beta: float = 0.95, warmup_steps: int = 50,
                 vanish_threshold: float = 1.0e-8, histogram_every_n_steps: int = 100,
                 log_param_norms: bool = False, max_findings_per_code: int = 5, on_error: str = "warn",
                 early_factor: float = 10.0, read_every_n_steps: int | None = None,
                 clip_shrink: float = 100.0) -> None:
        super().__init__(on_error=on_error)
        if on_error != "warn" and read_every_n_steps not in (None, 1):
            raise ConfigError(f"callbacks.{self.name}.read_every_n_steps={read_every_n_steps} does not work with "
                              f"on_error={on_error}: it acts before each update, so it reads every step; valid: 1 or "
                              "null (or on_error=warn)")
        self.read_every = read_every_n_steps or (10 if on_error == "warn" else 1)
        # (step's vector on the device, step, batch, its fp16 loss scale: DeepSpeed's python number, else None)
        self._queue: list[tuple[torch.Tensor, int, int | None, float | None]] = []
        self.check_declared(every_n_steps=every_n_steps, max_norm=max_norm, spike_factor=spike_factor,
                            spike_min_ratio=spike_min_ratio, ema_beta=ema_beta, warmup_steps=warmup_steps,
                            vanish_threshold=vanish_threshold, histogram_every_n_steps=histogram_every_n_steps,
                            max_findings_per_code=max_findings_per_code, early_factor=early_factor,
                            clip_shrink=clip_shrink, read_every_n_steps=read_every_n_steps)
        self.early_factor, self.clip_shrink = float(early_factor), float(clip_shrink)
        self._clip: float | None = None  # the run's clip threshold (on_fit_start)
        self._clip_ratios: list[float] = []  # global norm / clip of the last CLIP_STEPS finite steps
        self._early_norms: list[float] = []  # the healthy norms before warm-up (the early rule's reference)
        self.every_n_steps, self.max_norm = every_n_steps, float(max_norm)
        self.spike_factor, self.spike_min_ratio = float(spike_factor), float(spike_min_ratio)
        self.ema_beta = float(ema_beta)
        self.warmup_steps, self.vanish_threshold = warmup_steps, float(vanish_threshold)
        self.histogram_every_n_steps, self.log_param_norms = histogram_every_n_steps, bool(log_param_norms)
        self.max_findings_per_code = max_findings_per_code
        self._ema_mean = self._ema_var = 0.0
        self._healthy_seen = self._checked = 0
        self._counts: dict[str, int] = {}
        self._vanished: set[str] = set()
        self._largest = (0.0, None)
        self._loss_bad: torch.Tensor | None = None
        self._batch_idx: int | None = None
        self._params: list[torch.Tensor] = []
        self._scaler = None
        self._overflow = OverflowJudge(None)
        self._factor: float | torch.Tensor = 1.0  # the loss scale the step's gradients still carry (fp16)

    # ---- setup: every rank ----------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # After the strategy built the optimizer (and freeze_verify froze in setup).
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        self._names = [display_name(n) for n, _ in named]
        self._params = [p for _, p in named]
        self._layers = list(dict.fromkeys(layer_of(n) for n in self._names))
        index = {layer: i for i, layer in enumerate(self._layers)}
        self._layer_idx = torch.tensor([index[layer_of(n)] for n in self._names], dtype=torch.long)
        self._source = grad_source(trainer.strategy)
        self._tensorboard = any(type(lg).__name__ == "TensorBoardLogger" for lg in trainer.loggers)
        self._scaler = read_scaler(trainer)  # fp16: DeepSpeed's gradients are still loss-scaled in the hook
        self._overflow = OverflowJudge(self._scaler, resumed=trainer.global_step > 0)
        self._clip = run_clip(trainer)
        log.info("grad_monitor: %d trainable parameters in %d layers, gradients from %s", len(self._params),
                 len(self._layers), self._source)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        # Local: remember whether THIS rank's loss was already non-finite (names the rank later).
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else (self._loss_bad | bad)

    # ---- the check: EVERY rank, same branches (all decisions use all-reduced values) ----
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._params or not _at_accumulation_boundary(trainer):
            return
        step, world = trainer.global_step, trainer.world_size
        grads = [local_grad(p, self._source) for p in self._params]
        self._factor = self._scaler.grad_factor(optimizer) if self._scaler is not None else 1.0
        sumsq = self._sumsq(grads)  # on the device: no host read
        loss_bad = torch.zeros(world, dtype=torch.float64, device=sumsq.device)
        if self._loss_bad is not None:
            loss_bad[trainer.global_rank] = self._loss_bad.to(loss_bad.device, torch.float64)
        self._loss_bad = None
        # replicated gradients (DDP, one process): every rank holds all of it, so the sum over ranks of x/world is x
        self._queue.append((torch.cat([sumsq / (world if self._source == "replicated" else 1), loss_bad]), step,
                            self._batch_idx, self._overflow.scale_now()))  # fp16: the step's loss scale
        metrics = self.due(step)
        histograms = self._tensorboard and self.due(step, self.histogram_every_n_steps)
        last = 0 < (trainer.max_steps or -1) <= step + 1
        if len(self._queue) >= self.read_every or last or metrics or histograms:
            self._read(trainer, pl_module, grads if metrics else None)
        if histograms:
            self._histograms(trainer, grads)

    def read_queued(self, trainer: Any) -> None:
        self._read(trainer, trainer.lightning_module)  # before a checkpoint takes the EMA (base.py)

    def _read(self, trainer: Any, pl_module: Any, grads: list | None = None) -> None:
        """Judge the queued steps in order; ``grads`` (the last step's) for its metrics. COLLECTIVE (world > 1):
        one all-reduce of [N x (params + world)] and one host read, EVERY rank at the same step."""
        queue, self._queue = self._queue, []
        if not queue:
            return
        world, n = trainer.world_size, len(self._params)
        rows = collectives.reduce(trainer, torch.stack([v for v, *_ in queue]), "sum").cpu().tolist()
        for i, (row, (_, step, batch, scale)) in enumerate(zip(rows, queue)):
            self._judge_step(trainer, pl_module, row[:n], [r for r, v in enumerate(row[n:]) if v > 0], step,
                             batch, grads if i == len(queue) - 1 else None, scale)

    def _judge_step(self, trainer: Any, pl_module: Any, sq: list[float], bad_loss_ranks: list[int], step: int,
                    batch: int | None, grads: list | None, scale: float | None = None) -> None:
        self._checked += 1
        bad = [i for i, v in enumerate(sq) if not math.isfinite(v)]
        if self._overflow.judge(not bad_loss_ranks, not bad, scale) == "absorbed":
            return  # an fp16 overflow the loss scaler skips (and lowers the scale for): counted, not reported
        if bad:
            self._report_nonfinite(trainer, pl_module, bad, sq, bad_loss_ranks, step, batch)
            return
        norm = math.sqrt(sum(sq))
        layer_sq = torch.zeros(len(self._layers), dtype=torch.float64).index_add_(
            0, self._layer_idx, torch.tensor(sq, dtype=torch.float64))
        if norm > self._largest[0]:
            self._largest = (norm, step)
        if norm > self.max_norm:
            self._report_large(trainer, pl_module, "grad_exploding", "error", norm, sq, layer_sq,
                               f"exceeds max_norm={self.max_norm:g}", step, batch)
        elif self._healthy_seen >= self.warmup_steps and norm > self._spike_limit():
            self._report_large(trainer, pl_module, "grad_spike", "warning", norm, sq, layer_sq,
                               f"is a spike: EMA {self._ema_mean:.3g} +- {math.sqrt(self._ema_var):.3g}", step, batch)
        elif self._early_spike(norm):
            self._report_large(trainer, pl_module, "grad_spike", "warning", norm, sq, layer_sq,
                               f"is a spike in the first steps: {norm / self._early_ref():.3g}x the median "
                               f"{self._early_ref():.3g} of the {len(self._early_norms)} steps so far (> early_factor="
                               f"{self.early_factor:g}; the EMA judges from step {self.warmup_steps})", step, batch)
        else:
            self._update_ema(norm)
        self._judge_clip(trainer, pl_module, norm, step)
        if grads is not None:  # a metrics step: the queue was read at it, so these are its gradients
            self._cadence(trainer, pl_module, grads, norm, sq, layer_sq)

    def _judge_clip(self, trainer: Any, pl_module: Any, norm: float, step: int) -> None:
        """Clipping that shrinks every update: the norm of CLIP_STEPS finite steps in a row >= clip_shrink x the clip
        threshold. Once per run (the ratio is in details and the grad/norm metrics)."""
        if not self._clip or not self.clip_shrink or self._counts.get("clip_dominates"):
            return
        self._clip_ratios = (self._clip_ratios + [norm / self._clip])[-CLIP_STEPS:]
        if len(self._clip_ratios) < CLIP_STEPS or min(self._clip_ratios) < self.clip_shrink:
            return
        shrink = sorted(self._clip_ratios)[CLIP_STEPS // 2]
        median = shrink * self._clip
        self._emit(trainer, pl_module, "warning", "clip_dominates",
                   f"the gradient norm of the last {CLIP_STEPS} steps (median {median:.3g}) is {shrink:.3g}x the clip "
                   f"threshold {self._clip:g}: clipping shrinks every update by orders of magnitude, so the run trains "
                   f"as if its LR were {shrink:.3g}x smaller",
                   f"raise optim.grad_clip (or the ds_config's gradient_clipping) to about the norm (~{median:.2g}), or "
                   "find why the gradients are this large (the loss's scale, a missing normalisation)",
                   {"clip": self._clip, "median_norm": median, "shrink": shrink,
                    "ratios": list(self._clip_ratios)}, rank=None, step=step)

    def _sumsq(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """Per-parameter sums of squares of the unscaled gradients, where they live (no host read)."""
        return sumsq_per_tensor(grads, self._factor)  # unscaled (fp16)

    def _spike_limit(self) -> float:
        return max(self.spike_min_ratio * self._ema_mean, self._ema_mean + self.spike_factor * math.sqrt(self._ema_var))

    def _early_ref(self) -> float:
        ordered = sorted(self._early_norms)
        return ordered[len(ordered) // 2]

    def _early_spike(self, norm: float) -> bool:
        """Before warm-up: healthy early norms move a few-fold at most; 10x the median so far is a spike."""
        return (self.early_factor > 0 and self._healthy_seen < self.warmup_steps and len(self._early_norms) >= 3
                and self._early_ref() > 0 and norm > self.early_factor * self._early_ref())

    def _update_ema(self, norm: float) -> None:
        if self._healthy_seen < self.warmup_steps:
            self._early_norms.append(norm)
        if self._healthy_seen == 0:
            self._ema_mean, self._ema_var = norm, 0.0
        else:
            d = norm - self._ema_mean
            self._ema_mean += (1 - self.ema_beta) * d
            self._ema_var = self.ema_beta * (self._ema_var + (1 - self.ema_beta) * d * d)
        self._healthy_seen += 1

    # ---- findings ---------------------------------------------------------------------
    def _report_nonfinite(self, trainer: Any, pl_module: Any, bad: list[int], sq: list[float],
                          bad_loss_ranks: list[int], step: int, batch: int | None) -> None:
        first, names = self._names[bad[0]], [self._names[i] for i in bad]
        kind = "NaN" if math.isnan(sq[bad[0]]) else "Inf"
        layers = list(dict.fromkeys(layer_of(n) for n in names))
        where = f"step {step}, batch {batch}"
        listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        if bad_loss_ranks:
            # every gradient follows from the bad loss: the parameters (registration order) locate nothing
            lead = (f"non-finite loss on rank(s) {bad_loss_ranks} at {where}: {kind} gradients in {len(bad)}/"
                    f"{len(self._names)} parameters in {len(layers)} layer(s), all downstream of that loss (so "
                    f"not a culprit: {listed}); the forward pass of that rank's batch produced it "
                    f"(+callbacks=nan_triage names the module)")
        else:
            lead = (f"{kind} gradient in {first} (layer {layer_of(first)}) at {where}: {len(bad)}/{len(self._names)} "
                    f"parameters non-finite ({listed}); the loss was finite on every rank, so it arose in backward "
                    f"(a custom autograd op or hook, sqrt/log/div at 0) and the gradient reduction hides the rank")
            if self._overflow.why:  # fp16: why the dynamic loss scaler's skip-and-lower does not cover it
                lead += f"; not an overflow the loss scaler absorbs: {self._overflow.why}"
        # COLLECTIVE (every rank is in this branch): are the weights still finite? (read at the step itself: before
        # its update; read later: as they are now)
        bad_weights = torch.stack([~torch.isfinite(local_param(p)).all() for p in self._params]).any()
        params_finite = not self.any_rank(trainer, bool(bad_weights))
        when = ("update not applied yet" if step == trainer.global_step else
                f"at step {trainer.global_step}, when read: {trainer.global_step - step} update(s) later")
        self._emit(
            trainer, pl_module, "error", "nonfinite_grad",
            f"{lead}; weights {'still finite' if params_finite else 'ALREADY non-finite'} ({when})",
            "on_error=skip drops this step; stop saves the last good weights. Look at the first parameter's "
            "op, lower the LR, check fp16 loss scaling and the batch",
            {"params": names[:50], "count": len(bad), "layers": layers, "nonfinite_loss_ranks": bad_loss_ranks,
             "params_finite_before_update": params_finite if step == trainer.global_step else None,
             "params_finite_when_read": params_finite, "batch_idx": batch,
             # arisen in backward: the first non-finite parameter is where to look (the incident's headline); from a
             # non-finite loss, every parameter downstream is non-finite and none is named
             "param": None if bad_loss_ranks else first},
            rank=bad_loss_ranks[0] if len(bad_loss_ranks) == 1 else None, step=step)

    def _report_large(self, trainer: Any, pl_module: Any, code: str, severity: str, norm: float,
                      sq: list[float], layer_sq: torch.Tensor, why: str, step: int, batch: int | None) -> None:
        top = sorted(range(len(sq)), key=lambda i: -sq[i])[:5]
        top_layer = int(layer_sq.argmax())
        name, layer_norm = self._names[top[0]], math.sqrt(float(layer_sq[top_layer]))
        self._emit(
            trainer, pl_module, severity, code,
            f"gradient norm {norm:.4g} at step {step} {why}; largest in {name} "
            f"({math.sqrt(sq[top[0]]):.4g}), layer {self._layers[top_layer]} ({layer_norm:.4g}); "
            f"next: {', '.join(f'{self._names[i]} {math.sqrt(sq[i]):.3g}' for i in top[1:3])}",
            "check that layer's inputs/initialisation, the batch and the LR/warm-up; clipping (optim.grad_clip) "
            "hides it but does not fix it" + ("; on_error=skip drops such steps" if severity == "error" else ""),
            {"norm": norm, "param": name, "layer": self._layers[top_layer], "ema_mean": self._ema_mean,
             "top": {self._names[i]: math.sqrt(sq[i]) for i in top}, "batch_idx": batch},
            rank=None, step=step)

    def _emit(self, trainer: Any, pl_module: Any, severity: str, code: str, message: str, advice: str,
              details: dict, rank: int | None, step: int | str = "self") -> None:
        """Called on EVERY rank with the same decision: rank 0 writes, every rank applies the policy."""
        if severity == "error" and self.on_error == "stop":
            pl_module.skip_optimizer_step = True  # keep the last good weights in the stop checkpoint
        self.report_capped(trainer, severity, code, message, advice, details, rank=rank, step=step,
                           limit=self.max_findings_per_code)

    # ---- cadence: metrics (rank 0 logs), vanishing, histograms ----------------------------
    def _cadence(self, trainer: Any, pl_module: Any, grads: list, norm: float, sq: list[float],
                 layer_sq: torch.Tensor) -> None:
        # max |g| via aminmax: the inf-norm foreach kernel measured ~7x slower on CPU
        present = [g for g in grads if g is not None and g.numel() > 0]
        amax = torch.stack([torch.stack(torch.aminmax(g)).abs().max().float() for g in present]).max() \
            if present else torch.zeros(())
        amax = amax / self._factor  # unscaled (fp16)
        if trainer.world_size > 1 and self._source != "replicated":  # COLLECTIVE, every rank (same cadence)
            amax = collectives.reduce(trainer, amax.reshape(1), "max")
        layer_norms = layer_sq.sqrt().tolist()
        metrics = {"grad/norm/global": norm, "grad/norm_ema": self._ema_mean, "grad/max_abs": float(amax.max())}
        metrics.update({f"grad/norm/{layer}": v for layer, v in zip(self._layers, layer_norms)})
        if self.log_param_norms:
            metrics.update({f"grad/param_norm/{n}": math.sqrt(v) for n, v in zip(self._names, sq)})
        if trainer.global_rank == 0:  # loggers write on rank 0 only; no collective here
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=trainer.global_step)
        if self.vanish_threshold > 0 and self._healthy_seen >= self.warmup_steps:
            low = [(layer, v) for layer, v in zip(self._layers, layer_norms)
                   if v < self.vanish_threshold and layer not in self._vanished]
            if low:
                self._vanished.update(layer for layer, _ in low)
                self._emit(trainer, pl_module, "warning", "vanishing_grad",
                           f"gradient vanished in {len(low)} trainable layer(s) at step {trainer.global_step}: "
                           + ", ".join(f"{layer} ({v:.2g})" for layer, v in low[:8])
                           + f" < vanish_threshold={self.vanish_threshold:g}",
                           "check for dead activations, saturated gates, a detached path or a too-deep "
                           "stack without residuals; freeze_verify tells unused from detached",
                           {"layers": {layer: v for layer, v in low}}, rank=None)

    def _histograms(self, trainer: Any, grads: list) -> None:
        with collectives.collective_region():  # ZeRO: one full-gradient gather per parameter, agreed once
            error = self._histograms_in_region(trainer, grads)
        if error is not None:  # outside the block: every rank is past its gathers
            raise error

    def _histograms_in_region(self, trainer: Any, grads: list) -> Exception | None:
        """Every rank makes every gather (same order); what only rank 0 does (the histograms) cannot stop the
        others: its first error is returned, for raising once the block of collectives is over."""
        error: Exception | None = None
        for name, p, g in zip(self._names, self._params, grads):
            if self._source != "replicated":  # COLLECTIVE per parameter, every rank, same order
                from deepspeed.utils import safe_get_full_grad

                g = safe_get_full_grad(p)
            if g is None or trainer.global_rank != 0 or error is not None:
                continue
            try:
                self._histogram(trainer, name, g)
            except Exception as exc:  # noqa: BLE001 - raised by _histograms, once every rank is past the gathers
                error = exc
        return error

    def _histogram(self, trainer: Any, name: str, g: torch.Tensor) -> None:
        values = (g.detach().float() / self._factor).cpu().flatten()
        values = values[torch.isfinite(values)]  # NaN/Inf are named by the checks; TensorBoard refuses them
        if not values.numel():
            return
        for lg in trainer.loggers:
            if type(lg).__name__ == "TensorBoardLogger":
                lg.experiment.add_histogram(f"grad/hist/{name}", values, trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._read(trainer, pl_module)  # COLLECTIVE (world > 1): the steps still queued, every rank
        if trainer.global_rank == 0 and self._params:
            counts = ", ".join(f"{c} x{n}" for c, n in sorted(self._counts.items())) or "none"
            absorbed = self._overflow.absorbed
            self.report(trainer, "info", "grad_summary",
                        f"checked {self._checked} steps ({len(self._params)} parameters, gradients from "
                        f"{self._source}); largest global norm {self._largest[0]:.4g} at step {self._largest[1]}; "
                        f"anomalies: {counts}" + (f"; {absorbed} fp16 overflow step(s) the loss scaler skipped"
                                                  if absorbed else ""),
                        details={"steps_checked": self._checked, "largest_norm": self._largest[0],
                                 "counts": dict(self._counts), "source": self._source,
                                 "overflows_absorbed": absorbed}, rank=None)


