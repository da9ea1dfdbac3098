"""``python train.py <the run's overrides> doctor=true``: build the run exactly as ``train`` does
(same data, model, optimizer, strategy, launcher and ranks), run the doctor's probes at the start of
fit (``DoctorCallback``) instead of training, print the verdict, write the probes as findings
(``findings.jsonl``) plus ``metrics.json`` and the report, and exit 0 when every probe passes, 3
(stopped by a check) when one fails.

The run's configured callbacks from dsdebug (debug checks, checkpointing, progress bar) and
Lightning (model summary, LR monitor) are left out: they judge or show training steps, and the doctor takes none outside its
probes; the user's own callbacks are kept. ``ckpt_path``/``resume`` are ignored: the doctor checks the run from its start.

Rank awareness: as ``trainer.entry.train``: every rank runs this, Lightning starts the child ranks
inside ``fit``; rank 0 writes the run dir files and prints."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf

from dsdebug.config.plan import RunPlan
from dsdebug.distributed.liveness import watch_parent
from dsdebug.doctor.callback import DoctorCallback
from dsdebug.doctor.verdict import print_verdict, summary_line
from dsdebug.errors import StoppedByCheck
from dsdebug.findings import Finding, configure_channel
from dsdebug.report.finish import finish_run
from dsdebug.trainer.entry import bind_config, build, model_config, resolved_config, the_plan

__all__ = ["doctor"]

log = logging.getLogger(__name__)


def doctor(plan: RunPlan) -> dict[str, Any]:
    """The probes instead of training, for the run plan ``dsdebug.config.prepare.prepare(cfg)`` returns."""
    started, cpu_started = time.time(), time.process_time()
    plan = the_plan(plan, "doctor(plan)")
    cfg = plan.cfg
    watch_parent()
    output_dir = Path(cfg.paths.output_dir)
    configure_channel(output_dir)
    L.seed_everything(cfg.seed, workers=True)
    asked = _user_values(plan)
    datamodule, module, trainer, _, plan = build(plan, keep_callback=_keeps)
    net_cfg = model_config(plan)["net"]
    pretrained = net_cfg.get("name_or_path") is not None
    callback = DoctorCallback(net_factory=lambda: hydra.utils.instantiate(net_cfg), pretrained=pretrained,
                              user_values=asked, workdir=output_dir / "doctor")
    trainer.callbacks.append(callback)
    if trainer.is_global_zero:
        log.info("doctor: probing %s on %d rank(s) -> %s", type(trainer.strategy).__name__, trainer.world_size,
                 output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        resolved = resolved_config(plan)
        (output_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
        plan.write(output_dir)
    bind_config(trainer, plan)
    trainer.fit(module, datamodule=datamodule)
    results = callback.results
    failed = [r for r in results if r.failed]
    seconds = round(time.time() - started, 2)
    metrics = {"status": "doctor_failed" if failed else "doctor_passed", "doctor_time_s": seconds,
               "doctor_cpu_s": round(time.process_time() - cpu_started, 2),  # rank 0's process, all its threads
               "world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__,
               "doctor": [asdict(r) for r in results]}
    if trainer.is_global_zero:
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
        print_verdict(results, seconds)
        if not failed:
            finish_run(output_dir)  # a failed doctor's report is written by the CLI with crash.json
    if failed:
        _release_process_group()
        first = failed[0]
        stop = StoppedByCheck(Finding("doctor", "error", first.probe, summary_line(results), first.advice))
        stop.args = (summary_line(results),)  # the CLI's one line: which probes failed and their culprits
        raise stop
    return metrics


def _release_process_group() -> None:
    """Every rank, before the exit that a failed probe causes: end the process group here. Left to the
    interpreter's shutdown under an exception, gloo's threads were still joinable at 2-rank DDP and
    the process aborted ("terminate called without an active exception", exit -6 instead of 3).
    COLLECTIVE (a barrier first, so no rank tears down while another still uses the group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _keeps(conf: Any) -> bool:
    """The user's own callbacks stay; the framework's (debug checks, checkpointing, progress bar) and
    Lightning's utilities (model summary, LR monitor) go: nothing to judge, show or keep before a run."""
    if not isinstance(conf, DictConfig):
        return False
    target = str(conf.get("_target_", ""))
    return bool(target) and not target.startswith(("dsdebug.", "lightning."))


def _user_values(plan: RunPlan) -> dict[str, Any]:
    """What the user asked for (the composed config, before prepare), but the per-rank batch and accumulation:
    the ones the run uses (data.global_batch_size or a ds_config sets them), which the probes compare with
    the engine's and the out-of-memory advice divides."""
    values = {key: plan.asked_for(key) for key in ("optim.lr", "optim.grad_clip", "trainer.max_steps", "data.seq_len")}
    return {**values, "data.batch_size": plan.per_rank_batch, "trainer.accumulate_grad_batches": plan.accumulate}
