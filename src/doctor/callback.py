"""`DoctorCallback`: the preflight doctor inside a Lightning fit. At ``on_fit_start`` (after the
strategy wrapped the model and built the optimizer: the run's real DDP/DeepSpeed set-up) it runs
every probe, gathers every rank's results, reports them as findings, then ends the fit before the
first training step (nothing is trained, no checkpoint is kept).

    trainer = L.Trainer(..., callbacks=[DoctorCallback()])
    trainer.fit(module, datamodule)          # probes instead of training
    callback.results                         # [ProbeResult], alike on every rank

The command line does this for a run's overrides: ``python train.py <overrides> doctor=true``
(``dsdebug.doctor.entry``).

Probes, in order (docs/debugging.md "Preflight doctor"):

| probe | where it runs | finding code |
|---|---|---|
| collectives | every rank (COLLECTIVE) | ``doctor/collectives`` |
| init_loss, causality, sample_independence, train_eval | a rank-local copy of the net (ZeRO-3: gathered first) | ``doctor/<probe>`` |
| coverage | one real step through the strategy (COLLECTIVE) | ``doctor/coverage`` |
| plan, memory | arithmetic on the config and what the step measured | ``doctor/plan``, ``doctor/memory`` |
| checkpoint (+ overfit between save and load) | the strategy's save/load and steps (COLLECTIVE) | ``doctor/checkpoint``, ``doctor/overfit`` |

Severity: fail -> error, warn -> warning, pass/skip -> info. Every rank runs every probe in the same
order (the collective ones included). The probes on a net and a batch are the registry's
(probes/registry.py, shared with the run's preflight and outcome_monitor checks), and every probe is
run under the one rule of probes/on_the_run.py ``guarded``: one that raises is a skip naming the
exception (an error of the net's own is met again by the probes that step through the strategy); a
collective one (collectives, coverage, checkpoint, the ZeRO-3 gather) is logged and raised: a rank that
left it half-way would hang the others.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from dsdebug.callbacks.base import DebugCallback
from dsdebug.doctor.checkpoint import checkpoint_round_trip
from dsdebug.doctor.collectives import collectives
from dsdebug.doctor.coverage import coverage
from dsdebug.doctor.memory import device_bytes, forecast, model_states
from dsdebug.doctor.overfit import overfit
from dsdebug.doctor.stepper import StrategyStepper
from dsdebug.probes.on_the_run import guarded
from dsdebug.probes.ranks import gather, merge
from dsdebug.probes.registry import PROBES, ProbeInputs, is_pretrained
from dsdebug.probes.result import ProbeResult
from dsdebug.probes.train_eval import without_dropout

__all__ = ["DoctorCallback", "LOCAL", "ORDER"]

log = logging.getLogger(__name__)

# the registry's probes on the net's local copy, in the registry's order; the plan runs after coverage (it reads
# the gradient norm that step measured)
LOCAL = tuple(name for name in PROBES if name != "plan")
ORDER = ("collectives", *LOCAL, "coverage", "plan", "memory", "overfit", "checkpoint")


class DoctorCallback(DebugCallback):
    """Runs the doctor's probes at ``on_fit_start`` and ends the fit (see the module docstring).

    ``net_factory``: builds a fresh copy of ``pl_module.net`` (needed under ZeRO-3 for the local
    probes; else the net is deep-copied). ``pretrained``: the weights are not a random init (a low
    loss at init is expected; an overfit that falls slowly is a warning, not a failure).
    ``user_values``: config key -> the value the user asked for, compared with what the run really
    uses (a silent adjustment becomes a warning naming the key).
    ``workdir``: where the checkpoint round trip writes (a temp dir by default; shared by the ranks)."""

    name = "doctor"
    isolated = False  # the doctor is the run (it replaces training): its failures end it, as they should

    def __init__(self, net_factory: Callable[[], torch.nn.Module] | None = None, pretrained: bool = False,
                 overfit_steps: int = 16, user_values: dict[str, Any] | None = None,
                 workdir: str | Path | None = None, stop: bool = True) -> None:
        super().__init__()
        self.net_factory, self.pretrained, self.overfit_steps = net_factory, pretrained, overfit_steps
        self.user_values = dict(user_values or {})
        self.workdir, self.stop = workdir, stop
        self.results: list[ProbeResult] = []

    # ---- the fit hook ---------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        mine = self.run_probes(trainer, pl_module)  # every rank
        self.results = merge(gather(mine), trainer.world_size)  # COLLECTIVE
        for r in self.results:  # decided alike on every rank; rank 0 writes
            if trainer.global_rank == 0:
                self.report(trainer, r.severity, r.probe, r.line(), r.advice if r.status in ("fail", "warn")
                            else "", details={"status": r.status, "culprit": r.culprit, "seconds": r.seconds,
                                              **r.details}, rank=r.details.get("rank"), step=None)
        if self.stop:
            from lightning.pytorch.utilities.exceptions import _TunerExitException

            raise _TunerExitException()  # Lightning ends fit cleanly (status finished, teardown), no step taken

    def run_probes(self, trainer: Any, pl_module: Any) -> list[ProbeResult]:
        """Every probe, in ORDER, on this rank. COLLECTIVE (every rank, same order)."""
        stepper = StrategyStepper(trainer, pl_module)
        batch = self._batch(trainer)
        out: list[ProbeResult] = [guarded("collectives", collectives, collective=True)]
        net = _guard_value(lambda: self._local_net(pl_module, stepper), collective=stepper.stage == 3)  # COLLECTIVE under ZeRO-3
        # the registry's probes (probes/registry.py) on this rank's own copy: local, traced, thorough
        inputs = ProbeInputs(net, batch, batch, pretrained=self.pretrained or is_pretrained(net),
                             shifts_labels=bool(getattr(pl_module, "shifts_labels", True)), thorough=True,
                             trainer=trainer, pl_module=pl_module)
        for name in LOCAL:
            out.append(ProbeResult(name, "skip", "no local copy of the net (ZeRO-3 without a net factory)")
                       if net is None else guarded(name, lambda name=name: PROBES[name].call(inputs, True)))
        inputs.net = net = None  # the local copy is not needed past these probes
        cov, info = _guard_pair("coverage", lambda: coverage(stepper, batch), collective=True)
        out.append(cov)
        inputs.plan_args = self._plan_args(trainer, pl_module, stepper, batch, info)
        out.append(guarded("plan", lambda: PROBES["plan"].call(inputs, True)))
        out.append(guarded("memory", lambda: self._memory(trainer, pl_module, stepper)))
        failed_cov = cov.culprit if cov.failed else ""
        # one folder for every rank: rank 0's name, broadcast (COLLECTIVE; each rank's own temp name would
        # leave rank 1 loading a checkpoint it never wrote)
        ckpt_dir = Path(self.workdir) if self.workdir else Path(trainer.strategy.broadcast(
            str(Path(tempfile.gettempdir()) / f"dsdebug-doctor-{os.getpid()}"), src=0))
        holder: dict[str, Any] = {}

        def train() -> list[float]:
            started = time.perf_counter()
            result, losses = overfit(stepper, batch, self.overfit_steps, coverage_failed=failed_cov)
            result.seconds = round(time.perf_counter() - started, 3)
            if self.pretrained and result.failed and not failed_cov:  # fine-tuning LRs move a trained model slowly
                result.status = "warn"
            holder["overfit"] = result
            return losses

        ck, _ = _guard_pair("checkpoint", lambda: checkpoint_round_trip(stepper, batch, str(ckpt_dir / "roundtrip.ckpt"),
                                                                        train=train), collective=True)
        out.append(holder.get("overfit") or ProbeResult("overfit", "fail", "did not run: the checkpoint probe "
                                                        "failed before it", "checkpoint"))
        if "overfit" in holder:
            ck.seconds = round(max(0.0, ck.seconds - holder["overfit"].seconds), 3)
        out.append(ck)
        if trainer.global_rank == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        return out

    # ---- inputs ---------------------------------------------------------------------
    def _batch(self, trainer: Any) -> dict:
        """This rank's first training batch (rank r takes batch r, as a sharded loader would)."""
        loader = trainer.datamodule.train_dataloader() if trainer.datamodule is not None else \
            trainer.fit_loop._data_source.dataloader()
        it = iter(loader)
        batch = next(it)
        for _ in range(trainer.global_rank):
            batch = next(it, batch)
        self._loader = loader
        return batch

    def _local_net(self, pl_module: Any, stepper: StrategyStepper) -> torch.nn.Module | None:
        """A copy of the net this rank can run alone, with dropout off. COLLECTIVE under ZeRO-3."""
        net = getattr(pl_module, "net", pl_module)
        if stepper.stage == 3:
            if self.net_factory is None:
                return None
            import deepspeed

            named = list(net.named_parameters())
            with deepspeed.zero.GatheredParameters([p for _, p in named]):
                state = {n: p.detach().clone() for n, p in named}
            state.update({n: b.detach().clone() for n, b in net.named_buffers()})
            fresh = self.net_factory()
            fresh.load_state_dict(state, strict=False)
        elif self.net_factory is not None:
            fresh = self.net_factory()
            fresh.load_state_dict(net.state_dict(), strict=False)
        else:
            fresh = copy.deepcopy(net)
        for (_, p), (_, q) in zip(net.named_parameters(), fresh.named_parameters()):
            q.requires_grad_(p.requires_grad)
        return without_dropout(fresh.to(pl_module.device))

    def _plan_args(self, trainer: Any, pl_module: Any, stepper: StrategyStepper, batch: dict, info: Any) -> dict:
        """What the doctor knows beyond a run's first batch, for the plan probe: the loader, the clip the strategy
        applies, the gradient norm the coverage probe measured, the values adjusted against what was asked."""
        group = trainer.optimizers[0].param_groups[0]
        lr = float(group.get("initial_lr", group["lr"]))
        total = trainer.estimated_stepping_batches
        total = int(total) if total != float("inf") else int(trainer.max_steps if trainer.max_steps > 0 else 1000)
        return {"loader": getattr(self, "_loader", None), "clip": stepper.gradient_clip(),
                "grad_norm": info.grad_norm if info is not None else None,
                "adjustments": self._adjustments(trainer, pl_module, stepper, lr, total, batch)}

    def _adjustments(self, trainer: Any, pl_module: Any, stepper: StrategyStepper, lr: float, total: int,
                     batch: dict) -> list[tuple[str, str]]:
        """Keys whose value in use differs from what the user asked (``user_values``)."""
        asked, out = self.user_values, []
        if asked.get("optim.lr") is not None and abs(float(asked["optim.lr"]) - lr) > 1e-12 * max(1.0, lr):
            out.append(("optim.lr", f"optim.lr={asked['optim.lr']} is used as {lr:.4g} (linear LR scaling: "
                                    "optim.scale_lr_base_batch_size)"))
        steps = asked.get("trainer.max_steps")
        if isinstance(steps, int) and steps > 0 and total < steps:
            out.append(("trainer.max_steps", f"trainer.max_steps={steps} but the run stops after {total} optimizer "
                                             "steps (trainer.max_epochs or the data ends it first)"))
        clip = asked.get("optim.grad_clip")
        used = stepper.gradient_clip()
        if clip is not None and (used or 0.0) != float(clip or 0.0):
            out.append(("optim.grad_clip", f"optim.grad_clip={clip} but the strategy clips at {used} (a ds_config's "
                                           "gradient_clipping wins)"))
        seq = asked.get("data.seq_len")
        if seq is not None and int(batch["input_ids"].shape[1]) != int(seq):
            out.append(("data.seq_len", f"data.seq_len={seq} but batches hold {batch['input_ids'].shape[1]} tokens"))
        limit = getattr(getattr(getattr(pl_module, "net", None), "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and int(batch["input_ids"].shape[1]) > limit:
            out.append(("data.seq_len", f"sequences of {batch['input_ids'].shape[1]} tokens exceed the model's "
                                        f"max_position_embeddings={limit}"))
        acc = asked.get("trainer.accumulate_grad_batches")
        if stepper.deepspeed and acc is not None:
            ds_acc = (trainer.strategy.config or {}).get("gradient_accumulation_steps")
            if ds_acc is not None and int(ds_acc) != int(acc):
                out.append(("trainer.accumulate_grad_batches", f"trainer.accumulate_grad_batches={acc} but DeepSpeed "
                                                               f"accumulates {ds_acc} micro-batches"))
        return out

    def _memory(self, trainer: Any, pl_module: Any, stepper: StrategyStepper) -> ProbeResult:
        from dsdebug.callbacks.memory.footprint import oom_advice

        states, layout = model_states(trainer.strategy, pl_module, trainer.world_size)
        local = max(1, int(getattr(trainer, "num_devices", 1) or 1))
        total, name = device_bytes(pl_module.device, local_ranks=local if pl_module.device.type == "cpu" else 1)
        advice = oom_advice("forward", layout, False, self.user_values.get("data.batch_size"),
                            self.user_values.get("data.seq_len"))
        return forecast(states, stepper.activation_bytes[0], total, name,
                        layout, advice)


# ---- helpers: guarded probes, gathering ranks ----------------------------------------

def _guard_pair(name: str, fn: Callable[[], tuple], collective: bool = False) -> tuple[ProbeResult, Any]:
    holder: list = []

    def run() -> ProbeResult:
        result, extra = fn()
        holder.append(extra)
        return result

    result = guarded(name, run, collective)
    return result, (holder[0] if holder else None)


def _guard_value(fn: Callable[[], Any], collective: bool = False) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001
        if collective:
            raise
        log.warning("doctor: could not copy the net for the local probes", exc_info=True)
        return None
