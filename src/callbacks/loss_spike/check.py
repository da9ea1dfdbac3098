"""`LossSpike`: loss spikes, caught before the update, with policy warn | skip | rollback.

The config example and the table of metrics and findings: the class docstring (`LossSpike`).
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from typing import Any, ClassVar

import torch

from dsdebug.checkpoint import rollback as rb
from dsdebug.config.args import Rule, boolean, integer, number, one_of, optional
from dsdebug.errors import ConfigError
from dsdebug.callbacks import isolation
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import _at_accumulation_boundary, grad_source, local_grad, untrained_vocab
from dsdebug.callbacks.loss_scale import read_scaler
from dsdebug.callbacks.loss_spike.window import SpikeWindow
from dsdebug.findings import Finding, get_channel
from dsdebug.distributed import collectives

__all__ = ["LossSpike", "SpikeWindow"]

POLICIES = ("warn", "skip", "rollback")



class LossSpike(DebugCallback):
    """`LossSpike`: loss spikes, caught before the update, with policy warn | skip | rollback.

    Each optimizer step, before the update, the training loss (averaged over ranks and over the
    accumulated micro-batches) is judged against a rolling window of the last ``window`` healthy
    steps: robust z = (loss - median) / (1.4826 MAD) and relative jump = loss / median - 1.
    A step is a spike when z >= ``z_threshold`` AND jump >= ``min_rel_jump`` -- or, with
    ``use_grad_norm``, when the global gradient norm is >= ``grad_ratio`` x its window median and
    the loss is half as far out (a joint loss + grad-norm decision). A non-finite loss is a spike.
    Before ``warmup_steps`` healthy steps the window is not trusted; early steps are judged against
    priors that need no history instead: from step 0, a loss above (1 + ``prior_margin``) x an untrained
    model's (ln(vocab), for a causal LM) is a spike (logits scaled up, a loss scale left in, an LR blow-up);
    from ``early_min_steps`` healthy steps, a loss ``early_jump`` (x2) above the median of the last five,
    or ``min_rel_jump`` above it when it is back above ln(vocab). A loss going down is never a
    spike, so the big early moves of training are silent. The score logged as ``spike/score``
    is the decision statistic: a spike iff score >= 1.

    Policies (``policy``): ``warn`` reports; ``skip`` drops that update on every rank
    (``skip_optimizer_step``, see src/models/lm_module.py); ``rollback`` drops it, then reloads
    weights + optimizer state from the newest checkpoint that verifies against its manifest,
    keeping the step counter, LR schedule and data iterator moving forward, so the batches from
    that checkpoint to the spike are skipped (PaLM), recorded in ``<run_dir>/skipped_batches.json``.
    A resume (``ckpt_path=``/``resume=``) from a checkpoint before them, with this check on, drops
    them from the data stream (``LMDataModule.exclude_batches``). No verified checkpoint yet:
    rollback skips instead, and says so. After ``max_rollbacks`` rollbacks (or
    ``max_consecutive_skips`` skipped steps in a row) a further spike stops the run (exit 3).

    Host reads (a device sync each on a GPU): with ``policy=warn`` the step's values (each rank's loss, the
    gradient sum of squares) stay on the device and are read, all-reduced and judged every
    ``read_every_n_steps`` steps (default 10: one all-reduce of ``[N x (world + 1)]`` and one host read per
    N steps); each step is judged in order with its own step and batch, so a spike is named up to N - 1
    steps after it arose, at the step it arose. ``skip`` and ``rollback`` act before the update, so they
    read and all-reduce every step (``read_every_n_steps`` must be 1 or null with them). The window still
    waiting at a checkpoint is judged after it, not on a resume from it.

    fp16 (``dsdebug.callbacks.loss_scale``): the gradient norm is the unscaled one (DeepSpeed's gradients still
    carry the loss scale here; divided on the device); a step whose gradients overflowed (the loss scaler skips
    that update) is judged by its loss alone.

    Ranks: every decision uses the all-reduced values, so all ranks act alike (EVERY rank reaches the same
    reads at the same steps). A rollback adds one broadcast (the checkpoint rank 0 verified) and
    DeepSpeed's load. Rank 0 writes the findings. Gradients are read as grad_monitor reads them (DDP,
    ZeRO-1/2/3).

    Example::

        python train.py +callbacks=loss_spike callbacks.loss_spike.policy=rollback \\
            callbacks.model_checkpoint.every_n_train_steps=50

    | metric key (every optimizer step) | meaning |
    |---|---|
    | ``spike/loss_median`` | median of the window's losses |
    | ``spike/score`` | decision statistic (>= 1 = spike) |

    | finding code | severity | when |
    |---|---|---|
    | ``loss_spike`` | warning | a spike, policy warn (step, batch, loss vs median, rank with the largest loss) |
    | ``loss_spike_skipped`` | warning | a spike whose update was dropped (skip; rollback without a verified checkpoint) |
    | ``loss_spike_rollback`` | warning | rolled back to a checkpoint; the skipped batch range |
    | ``loss_spike_persistent`` | error | more than ``max_rollbacks`` / ``max_consecutive_skips``: the run stops |
    | ``loss_spike_resume_skip`` | info | a resume drops batches a rollback skipped |
    | ``loss_spike_summary`` | info | at the end: steps checked, spikes, largest score, z and jump |

    Resume (from all-reduced losses, alike on every rank): the window's last ``max(window, warmup_steps)``
    healthy records (so a warm-up done stays done), and ``state_attrs``: rollbacks done, spiking steps in
    a row, finding counts, the summary's steps checked and largest score.
    """
    name = "loss_spike"
    state_attrs = ("_rollbacks", "_in_row", "_counts", "_checked", "_largest")

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "policy": one_of(*POLICIES),
        "window": integer(5),
        "warmup_steps": integer(5),
        "z_threshold": number(0, open_low=True),
        "min_rel_jump": number(0, open_low=True),
        "use_grad_norm": boolean(),
        "grad_ratio": number(1, open_low=True),
        "max_rollbacks": integer(0),
        "max_consecutive_skips": integer(1),
        "max_findings_per_code": integer(1),
        "prior_margin": number(0, note="0 = off"),
        "early_min_steps": integer(1),
        "early_jump": number(0, open_low=True),
        "read_every_n_steps": optional(integer(1), "auto: 10 with policy=warn, 1 with skip or rollback"),
    }

    def __init__(self, policy: str = "warn", window: int = 50, warmup_steps: int = 20, z_threshold: float = 6.0,
                 min_rel_jump: float = 0.25, use_grad_norm: bool = True, grad_ratio: float = 3.0,
                 max_rollbacks: int = 3, max_consecutive_skips: int = 10, max_findings_per_code: int = 5,
                 prior_margin: float = 0.5, early_min_steps: int = 3, early_jump: float = 1.0,
                 read_every_n_steps: int | None = None) -> None:
        super().__init__(on_error="warn")
        self.check_declared(policy=policy, window=window, warmup_steps=warmup_steps, z_threshold=z_threshold,
                            min_rel_jump=min_rel_jump, use_grad_norm=use_grad_norm, grad_ratio=grad_ratio,
                            max_rollbacks=max_rollbacks, max_consecutive_skips=max_consecutive_skips,
                            max_findings_per_code=max_findings_per_code, prior_margin=prior_margin,
                            early_min_steps=early_min_steps, early_jump=early_jump,
                            read_every_n_steps=read_every_n_steps)
        if policy != "warn" and read_every_n_steps not in (None, 1):
            raise ConfigError(f"callbacks.{self.name}.read_every_n_steps={read_every_n_steps} does not work with "
                              f"policy={policy}: it acts before each update, so it reads every step; valid: 1 or null "
                              "(or policy=warn)")
        self.read_every = read_every_n_steps or (10 if policy == "warn" else 1)
        self._queue: list[tuple[torch.Tensor, int, int, int | None]] = []  # (step's vector, step, epoch, batch)
        self.policy, self.use_grad_norm = policy, use_grad_norm
        self.max_rollbacks, self.max_consecutive_skips = max_rollbacks, max_consecutive_skips
        self.max_findings_per_code = max_findings_per_code
        self.detector = SpikeWindow(window, warmup_steps, float(z_threshold), float(min_rel_jump),
                                    float(grad_ratio) if use_grad_norm else None, None, float(prior_margin),
                                    early_min_steps, float(early_jump))
        self._loss_sum: torch.Tensor | None = None
        self._seen: deque[tuple[int, int, int]] = deque(maxlen=100_000)  # (step, epoch, batch_idx)
        self._params: list[torch.Tensor] = []
        self._scaler = None  # fp16: the run's loss scaler (dsdebug.callbacks.loss_scale)
        self._pending: dict | None = None
        self._counts: dict[str, int] = {}
        self._checked = self._rollbacks = self._in_row = 0
        self._largest: dict[str, Any] = {"score": 0.0, "step": None, "z": 0.0, "jump": 0.0}

    # ---- setup: every rank ----------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._source = grad_source(trainer.strategy)
        self._params = [p for p in pl_module.parameters() if p.requires_grad] if self.use_grad_norm else []
        self._scaler = read_scaler(trainer) if self._params else None  # fp16: DeepSpeed's gradients are loss-scaled
        vocab = untrained_vocab(trainer, pl_module)
        self.detector.prior = math.log(vocab) if vocab and vocab > 1 else None

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # a resume (Lightning restores before the train loader's first iteration; never our rollback's load)
        if trainer.ckpt_path:
            self._exclude_on_resume(trainer, Path(str(trainer.ckpt_path)), int(checkpoint.get("global_step", 0)))

    def _exclude_on_resume(self, trainer: Any, ckpt: Path, step: int) -> None:
        """Batches a rollback skipped after this checkpoint are not replayed (local, every rank)."""
        run_dir = Path(trainer.default_root_dir)
        records = rb.read_record(ckpt.parent.parent / rb.SKIP_FILE) or rb.read_record(run_dir / rb.SKIP_FILE)
        if not records:
            return
        dm = trainer.datamodule
        geometry = (trainer.world_size, int(getattr(dm, "batch_size", 0) or 0))
        ranges = rb.exclusions_for_resume(records, step, geometry)
        supported = hasattr(dm, "exclude_batches")
        for epoch, first, last in ranges if supported else ():
            dm.exclude_batches(epoch, first, last)
        if not ranges or trainer.global_rank != 0:
            return
        if not supported:
            self.report(trainer, "warning", "loss_spike_resume_skip",
                        f"resuming from {ckpt.name} (step {step}): {type(dm).__name__} cannot drop the {len(ranges)} "
                        "batch range(s) a rollback skipped; they will be replayed",
                        "use dsdebug.data.datamodule.LMDataModule or give your datamodule exclude_batches()", rank=None)
            return
        if not (run_dir / rb.SKIP_FILE).is_file():  # the record follows the run
            for r in records:
                rb.append_record(run_dir, r)
        self.report(trainer, "info", "loss_spike_resume_skip",
                    f"resuming from {ckpt.name} (step {step}): dropping batch positions "
                    + ", ".join(f"{a}..{b} of epoch {e}" for e, a, b in ranges)
                    + " that a rollback skipped (skipped_batches.json)", details={"ranges": ranges}, rank=None)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._seen.append((trainer.global_step, trainer.current_epoch, batch_idx))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        # Lightning passes loss / accumulate_grad_batches: the sum over micro-batches is the mean
        loss = loss.detach().float().sum()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    # ---- the check: EVERY rank, same branches (decisions on all-reduced values) -----------------
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._loss_sum is None or not _at_accumulation_boundary(trainer):
            return
        world, rank = trainer.world_size, trainer.global_rank
        loss_sum, self._loss_sum = self._loss_sum, None
        vec = torch.zeros(world + 1, dtype=torch.float64, device=loss_sum.device)  # on the device: no host read
        vec[rank] = loss_sum.double()
        if self._params:
            grads = [g for g in (local_grad(p, self._source) for p in self._params) if g is not None and g.numel()]
            if grads:
                norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double()
                if self._scaler is not None:  # fp16: the unscaled norm (on the device: no host read)
                    norms = norms / self._scaler.grad_factor(optimizer)
                sq = norms.pow(2).sum()
                vec[world] = sq.to(vec.device) / (world if self._source == "replicated" else 1)  # replicated: all
        self._queue.append((vec, trainer.global_step, trainer.current_epoch, self._seen[-1][2] if self._seen else None))
        last = 0 < (trainer.max_steps or -1) <= trainer.global_step + 1  # the run's last step: read it now
        if len(self._queue) >= self.read_every or last:
            self._read(trainer, pl_module)

    def read_queued(self, trainer: Any) -> None:
        self._read(trainer, trainer.lightning_module)  # before a checkpoint takes the window (base.py)

    def _read(self, trainer: Any, pl_module: Any) -> None:
        """Judge the queued steps in order. COLLECTIVE (world > 1): one all-reduce of [N x (world + 1)] and one
        host read, EVERY rank at the same step (the queue fills alike everywhere)."""
        queue, self._queue = self._queue, []
        if not queue:
            return
        world = trainer.world_size
        rows = collectives.reduce(trainer, torch.stack([v for v, _, _, _ in queue]), "sum").cpu().tolist()
        for row, (_, step, epoch, batch) in zip(rows, queue):
            gnorm = math.sqrt(row[world]) if self._params else None
            if gnorm is not None and not math.isfinite(gnorm) and self._scaler is not None:
                gnorm = None  # an fp16 overflow: the loss scaler skips that update; the loss alone judges the step
            self._judge_step(trainer, pl_module, row[:world], gnorm, step, epoch, batch)

    def _judge_step(self, trainer: Any, pl_module: Any, losses: list[float], gnorm: float | None, step: int,
                    epoch: int, batch: int | None) -> None:
        loss = sum(losses) / len(losses)
        v = self.detector.judge(loss, gnorm)
        self._checked += 1
        if v["score"] > self._largest["score"] and math.isfinite(v["score"]):
            self._largest = {"score": v["score"], "step": step, "z": v.get("z") or 0.0, "jump": v.get("jump") or 0.0}
        if v["median"] is not None and trainer.global_rank == 0:  # loggers write on rank 0; the step it judged
            for lg in trainer.loggers:
                lg.log_metrics({"spike/loss_median": v["median"], "spike/score": v["score"]}, step=step)
        if not v["spike"]:
            self.detector.push(step, loss, gnorm)
            self._in_row = 0
            return
        self._on_spike(trainer, pl_module, v, losses, step, epoch, batch)

    def _on_spike(self, trainer: Any, pl_module: Any, v: dict, losses: list[float], step: int, epoch: int,
                  batch: int | None) -> None:
        top = max(range(len(losses)), key=lambda r: losses[r] if math.isfinite(losses[r]) else math.inf)
        where = f"step {step} (epoch {epoch}, batch {batch})"
        rank_note = f"; largest local loss on rank {top} ({losses[top]:.4g})" if len(losses) > 1 else ""
        details = {k: v.get(k) for k in ("median", "mad", "z", "jump", "grad_norm", "grad_ratio", "score")}
        details.update(loss=sum(losses) / len(losses), rank_losses=losses, top_rank=top, batch_idx=batch, epoch=epoch)
        text = f"loss spike at {where}: {v['why']}{rank_note}"
        if self.policy == "warn":
            if math.isfinite(details["loss"]):  # the run goes on with it: a lasting level becomes the new normal
                self.detector.push(step, details["loss"], v.get("grad_norm"))
            self._emit(trainer, "warning", "loss_spike", text + "; the update is applied (policy=warn)",
                       "inspect that batch (debug=data) and the LR/warm-up; policy=skip drops such updates, "
                       "rollback also returns to the last verified checkpoint", details, step=step)
            return
        self._in_row += 1
        limit = self.policy == "rollback" and self._rollbacks >= self.max_rollbacks
        if limit or self._in_row > self.max_consecutive_skips:
            pl_module.skip_optimizer_step = True  # the stop checkpoint keeps the weights from before the spike
            why = (f"{self._rollbacks} rollbacks (max_rollbacks={self.max_rollbacks})" if limit else
                   f"{self._in_row} spiking steps in a row (max_consecutive_skips={self.max_consecutive_skips})")
            finding = self._emit(trainer, "error", "loss_spike_persistent", f"{text}; stopping after {why}",
                                 "the loss does not come back: lower the LR, check the data from that batch on, "
                                 "resume from an earlier checkpoint", details, step=step)
            channel = get_channel()
            if channel.stop_request is None:
                channel.stop_request = finding
            trainer.should_stop = True
            return
        pl_module.skip_optimizer_step = True  # every rank: lm_module drops this update
        if self.policy == "skip":
            self._emit(trainer, "warning", "loss_spike_skipped", text + "; this update was dropped on every rank",
                       "if spikes repeat at the same data, inspect those batches (debug=data); lower the LR", details,
                       step=step)
        else:
            self._pending = {"text": text, "details": details, "step": step}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None  # every rank has the same pending rollback
        step = pending["step"]
        found = rb.newest_verified(rb.checkpoint_dir(trainer), step) if trainer.global_rank == 0 else None
        if trainer.world_size > 1:  # COLLECTIVE (every rank is here): rank 0's verified choice
            found = collectives.broadcast(trainer, found, src=0)
        if found is None:
            self._emit(trainer, "warning", "loss_spike_skipped",
                       pending["text"] + "; no verified checkpoint yet, so rollback skipped this update instead",
                       "checkpoint more often (callbacks.model_checkpoint.every_n_train_steps)", pending["details"],
                       step=step)
            return
        path, ckpt_step = found
        with isolation.changing_training_state():  # a failure here ends the run: no half-loaded model trains on
            rb.load_weights_and_optimizer(trainer, pl_module, path)  # every rank
        self.detector.rollback_to(ckpt_step)
        self._rollbacks += 1
        ranges = rb.position_ranges(list(self._seen), ckpt_step, step)
        entry = {"rollback": self._rollbacks, "spike_step": step, "checkpoint": Path(path).name,
                 "checkpoint_step": ckpt_step, "steps": [ckpt_step, step], "batches": ranges,
                 "world_size": trainer.world_size, "batch_size": int(getattr(trainer.datamodule, "batch_size", 0) or 0)}
        record = rb.append_record(Path(trainer.default_root_dir), entry) if trainer.global_rank == 0 else None
        self._emit(trainer, "warning", "loss_spike_rollback",
                   f"{pending['text']}; rolled back to {Path(path).name} (step {ckpt_step}, verified): the updates of "
                   f"steps {ckpt_step}..{step} are undone and their batches ("
                   + ", ".join(f"{a}..{b} of epoch {e}" for e, a, b in ranges)
                   + f") skipped, recorded in {rb.SKIP_FILE}; training goes on at step {step + 1}"
                   + f" (rollback {self._rollbacks}/{self.max_rollbacks})",
                   "a resume with this check on does not replay those batches; if spikes return, lower the LR",
                   {**pending["details"], **entry, "record": str(record) if record else None}, step=step)

    def _emit(self, trainer: Any, severity: str, code: str, message: str, advice: str, details: dict,
              step: int | None = None) -> Finding:
        step = trainer.global_step if step is None else step
        n = self._counts[code] = self._counts.get(code, 0) + 1
        if n == self.max_findings_per_code:
            message += f" (further {code} findings are only counted)"
        finding = Finding(self.name, severity, code, message, advice, step=step, rank=None, details=details)
        if trainer.global_rank == 0 and (n <= self.max_findings_per_code or severity == "error"):
            self.report(trainer, severity, code, message, advice, details, rank=None, step=step)
        return finding

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._read(trainer, pl_module)  # COLLECTIVE (world > 1): the steps still queued, every rank
        if trainer.global_rank == 0:
            counts = ", ".join(f"{c} x{n}" for c, n in sorted(self._counts.items())) or "none"
            big = self._largest
            self.report(trainer, "info", "loss_spike_summary",
                        f"checked {self._checked} steps (policy={self.policy}); spikes: {counts}; largest score "
                        f"{big['score']:.3g} (1 = spike) at step {big['step']} (robust z {big['z']:.3g} vs "
                        f"{self.detector.z_threshold:g}, jump {big['jump']:.3g} vs {self.detector.min_rel_jump:g})",
                        details={"steps_checked": self._checked, "counts": dict(self._counts), "largest": big,
                                 "rollbacks": self._rollbacks}, rank=None)

    # ---- state in checkpoints: the window (and whether warm-up is done) survives a resume ----------
    def state_dict(self) -> dict[str, Any]:
        keep = max(self.detector.window, self.detector.warmup_steps)
        return {**super().state_dict(), "history": list(self.detector.history)[-keep:]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.detector.history.clear()
        self.detector.history.extend(tuple(r) for r in state.get("history", []))
        if "rollbacks" in state:  # a checkpoint written before state_attrs
            self._rollbacks = int(state["rollbacks"])
