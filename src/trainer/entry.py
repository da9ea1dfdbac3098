"""`train(cfg)`: build -> fit -> export -> report, for one run (the config comes prepared:
src/config/prepare.py, whose docstring draws the whole way from the command line to fit).

Rank awareness: everything before ``trainer.fit`` runs in the launching process (rank 0),
and again in each child rank, which Lightning starts inside ``fit``. ``rank_zero_only.rank``
(read from LOCAL_RANK/RANK at import) is the reliable rank test before fit; writes into
the run dir are rank 0's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import hydra
import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from dsdebug.callbacks import is_debug_check
from dsdebug.callbacks.isolation import set_strict
from dsdebug.errors import ConfigError, StoppedByCheck
from dsdebug.findings import configure_channel, get_channel
from dsdebug.findings.sinks import attach_dashboards
from dsdebug.checkpoint.checkpoints import FinalCheckpoint, export_final, resolve_ckpt_path
from dsdebug.models.int8_export import val_batches
from dsdebug.report.finish import finish_run
from dsdebug.report.history import HistoryLogger
from dsdebug.checkpoint.final_step import FinalStep
from dsdebug.distributed.liveness import LivenessCallback, watch_parent
from dsdebug.distributed.liveness import state as liveness_state
from dsdebug.checkpoint.preemption import PreemptionCheckpoint
from dsdebug.distributed.rank_files import RankFiles
from dsdebug.distributed.startup_signals import stop_if_received
from dsdebug.checkpoint.reshard import enable_universal_loading, plan_resume
from dsdebug.checkpoint.resume import check_resume_config, prepare_loggers, settle_run_dir
from dsdebug.trainer.instantiate import instantiate_callbacks, instantiate_loggers, instantiate_section
from dsdebug.findings.secrets import redact
from dsdebug.config.tokenizer_check import check_fits_model, check_vocab_size
from dsdebug.config.plan import Adjustment, RunPlan, replace_plan

__all__ = ["Built", "bind_config", "build", "model_config", "resolved_config", "the_plan", "train"]

log = logging.getLogger(__name__)


def the_plan(plan: Any, who: str) -> RunPlan:
    """``plan`` when it is the run plan ``prepare`` returns, else a RuntimeError naming ``who`` needs it."""
    if not isinstance(plan, RunPlan):
        raise RuntimeError(f"{who} needs the run plan that dsdebug.config.prepare.prepare(cfg) returns (a prepared "
                           f"config), got {type(plan).__name__}")
    return plan


class Built(NamedTuple):
    datamodule: Any
    module: Any
    trainer: L.Trainer
    final_ckpt: FinalCheckpoint
    plan: RunPlan  # the plan the objects were built from (a new one when build learnt a value: the hub vocabulary)


def build(plan: RunPlan, logger_arguments: dict[str, dict] | None = None,
          keep_callback: Any = None) -> Built:
    """Data, model, callbacks, loggers, strategy and trainer from the run plan (its config is read-only: what a
    value known only now changes goes into a new plan and into the arguments the objects are built with).
    ``logger_arguments``: per logger, values over its config (a resume in place); ``keep_callback``: which of
    ``callbacks`` to build (the doctor keeps the user's own). The checks that compare the run's config across
    ranks get it last, ``bind_config`` (before fit)."""
    plan = the_plan(plan, "build(plan)")
    cfg = plan.cfg
    # callbacks first: they set env vars/flags (seeds, NCCL debug) before anything else exists,
    # and a bad callback value fails in ~1 s instead of after data and model are built
    callbacks = instantiate_callbacks(cfg.get("callbacks"), keep=keep_callback)
    datamodule = instantiate_section(cfg.data, "data")
    pretrained = getattr(datamodule, "pretrained", None)
    if pretrained is not None and datamodule.vocab_size != plan.vocab_size:
        # a hub tokenizer's size is known only now: the plan records it (config/plan.py replace_plan) and the model
        # section is resolved with it (model_config); the config itself is not written
        check_vocab_size(cfg, datamodule.vocab_size, pretrained.label)
        if rank_zero_only.rank == 0:
            log.info("data.vocab_size=%s -> %d: it follows %s", cfg.data.vocab_size, datamodule.vocab_size,
                     pretrained.label)
        plan = replace_plan(plan, Adjustment("data.vocab_size", cfg.data.vocab_size, datamodule.vocab_size,
                                             f"follows {pretrained.label}, read when the data was built"),
                            vocab_size=datamodule.vocab_size)
    model_cfg = model_config(plan)
    model_cfg.pop("tokenizer", None)  # read by the data config (data.tokenizer), not a module argument
    module = instantiate_section(
        model_cfg, "model",
        optimizer=instantiate_section(cfg.optim.optimizer, "optim.optimizer"),
        scheduler=instantiate_section(cfg.optim.scheduler, "optim.scheduler") if cfg.optim.get("scheduler") else None,
    )
    _check_vocab(module, datamodule, pretrained_net="name_or_path" in (cfg.model.get("net") or {}))
    ckpt_dir = Path(cfg.paths.output_dir) / "checkpoints"
    pre = cfg.get("preemption") or {}
    preemption = PreemptionCheckpoint(ckpt_dir, signals=list(pre.get("signals", ["SIGTERM", "SIGUSR1"])),
                                      enabled=bool(pre.get("enabled", True)))
    final_ckpt = FinalCheckpoint(ckpt_dir, preemption=preemption)
    # FinalStep first: its should_stop must be set before the other callbacks ask whether this step logs
    # RankFiles before LivenessCallback: its fit-end gather runs while a dead rank still ends the run
    callbacks = [FinalStep(), *callbacks, RankFiles(), LivenessCallback(), preemption, final_ckpt]
    arguments = {name: dict(args) for name, args in plan.logger_arguments.items()}  # a sweep job's W&B group/name
    for name, args in (logger_arguments or {}).items():
        arguments.setdefault(name, {}).update(args)
    loggers = instantiate_loggers(cfg.get("logger"), arguments)
    # every scalar any logger gets also lands in <run_dir>/history.jsonl (for the report)
    loggers.append(HistoryLogger(cfg.paths.output_dir))
    strategy = instantiate_section(cfg.strategy, "strategy")
    if getattr(strategy, "wall_clock_breakdown", False):  # the ds_config turned DeepSpeed's timers on
        from dsdebug.callbacks.ds_wall_clock import DeepSpeedWallClock

        callbacks.append(DeepSpeedWallClock())
    trainer = instantiate_section(cfg.trainer, "trainer", strategy=strategy, callbacks=callbacks, logger=loggers)
    if hasattr(trainer.strategy, "check_params"):  # a parameter the engine cannot hold: one line now, before any rank starts
        trainer.strategy.check_params(module, trainer.gradient_clip_val)
    return Built(datamodule, module, trainer, final_ckpt, plan)


def bind_config(trainer: L.Trainer, plan: RunPlan) -> None:
    """The checks that compare the run's config across ranks (consistency, replica_parity) get it: the last stop
    of the config before fit."""
    for callback in trainer.callbacks:
        if hasattr(callback, "bind_config"):
            callback.bind_config(plan.cfg)


def _as_planned(plan: RunPlan) -> DictConfig:
    """The config with what the plan learnt after prepare (a hub tokenizer's vocabulary): a copy when that differs,
    so every ``${data.vocab_size}`` resolves to it; the run's config itself is never written."""
    cfg = plan.cfg
    if plan.vocab_size is None or plan.vocab_size == cfg.data.get("vocab_size"):
        return cfg
    source = copy.deepcopy(cfg)
    OmegaConf.set_readonly(source, False)
    with open_dict(source):
        source.data.vocab_size = plan.vocab_size
    return source


def model_config(plan: RunPlan) -> dict[str, Any]:
    """The ``model`` section resolved for the run (its ``${data.vocab_size}``: the plan's vocabulary)."""
    return OmegaConf.to_container(_as_planned(plan).model, resolve=True)


def resolved_config(plan: RunPlan) -> dict[str, Any]:
    """The whole config as the run uses it, resolved and with secrets redacted: what config_resolved.yaml holds,
    the loggers get, and a resume compares with the checkpoint's."""
    return redact(OmegaConf.to_container(_as_planned(plan), resolve=True))


def _check_vocab(module: Any, datamodule: Any, pretrained_net: bool) -> None:
    emb = getattr(module.net, "get_input_embeddings", lambda: None)()
    model_vocab = getattr(emb, "num_embeddings", None)
    pretrained = getattr(datamodule, "pretrained", None)
    if pretrained is not None:  # the loaded tokenizer against the built model (covers hub ids)
        config = getattr(module.net, "config", None)
        # special ids only mean something in a pretrained model's config (a random init's are defaults)
        config = config.to_dict() if pretrained_net and hasattr(config, "to_dict") else {}
        if model_vocab is not None:
            config["vocab_size"] = model_vocab
        check_fits_model(pretrained.facts, pretrained.label, config, "the model's config (model.net)")
        return
    if model_vocab is not None and model_vocab < datamodule.vocab_size:
        raise ConfigError(
            f"data.vocab_size={datamodule.vocab_size} exceeds the model's vocabulary ({model_vocab}); "
            f"set data.vocab_size<={model_vocab} or use a model with a larger vocab"
        )


def train(plan: RunPlan) -> dict[str, Any]:
    """build -> fit -> export -> report for the run plan ``dsdebug.config.prepare.prepare(cfg)`` returns (src/train.py
    run calls it first; so does tests' train_in_process)."""
    started = time.time()
    plan = the_plan(plan, "train(plan)")
    watch_parent()  # a child rank exits if rank 0 dies (no orphans)
    set_strict((plan.cfg.get("debug") or {}).get("strict"))  # a check that raises: isolated (default) or re-raised
    try:
        return _train(plan, started)
    finally:
        set_strict(None)  # this run's setting ends with it (a later fit in this process: DSDEBUG_STRICT decides)


def _train(plan: RunPlan, started: float) -> dict[str, Any]:
    cfg = plan.cfg
    output_dir = Path(cfg.paths.output_dir)
    channel = configure_channel(output_dir)  # every rank appends to <run_dir>/findings.jsonl
    # verify the checkpoint before anything is built: a corrupt one fails in ~1 s
    chosen = resolve_ckpt_path(cfg, output_dir)
    ckpt_path, universal = plan_resume(cfg, chosen, output_dir, plan.world_size)
    resume_step, logger_arguments = prepare_loggers(cfg, chosen, output_dir)  # in place: the same W&B run and TB dir
    plan = dataclasses.replace(plan, resume={  # the resume plan, in the run plan (run_plan.json)
        "checkpoint": chosen, "load": ckpt_path, "universal": bool(universal), "in_place_step": resume_step,
        "logger_arguments": logger_arguments})
    L.seed_everything(cfg.seed, workers=True)
    datamodule, module, trainer, final_ckpt, plan = build(plan, logger_arguments)
    resolved = resolved_config(plan)  # after build: a hub tokenizer's vocabulary is known now
    if rank_zero_only.rank == 0:
        check_resume_config(resolved, chosen)  # against the config that wrote it: refuse or warn, one line
    stop_if_received("while the model and data were built")  # a preemption signal so far: end here
    if universal:
        enable_universal_loading(trainer.strategy)
    dashboards = None
    if rank_zero_only.rank == 0:
        # after the refusal point: a refused attempt must leave no dashboard files behind
        dashboards = attach_dashboards(channel, trainer.loggers)  # findings -> TensorBoard text, W&B alerts
        _print_header(cfg, output_dir, module)
        settle_run_dir(trainer.loggers, output_dir, resume_step)  # a previous attempt's end, CSV rows kept
        _write_config(plan, resolved, output_dir, trainer)
    bind_config(trainer, plan)  # the config's last stop before fit: the checks that compare it across ranks
    # a checkpoint file (DDP) is unpickled with weights_only=True: tensors and plain containers
    # only, no code; DeepSpeed loads its own shards (weights_only=False inside DeepSpeed)
    fit_started = time.time()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path,
                weights_only=True if ckpt_path and Path(ckpt_path).is_file() else None)

    fit_s = time.time() - fit_started
    metrics = _collect_metrics(trainer, module, started, ckpt_path, final_ckpt.path)
    steps_run = trainer.global_step - liveness_state.start_step
    tokens = steps_run * cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * trainer.world_size
    tokens *= int(cfg.data.get("seq_len") or 0)
    metrics["fit_time_s"] = round(fit_s, 2)
    metrics["throughput/tokens_per_s"] = round(tokens / fit_s, 1) if fit_s > 0 and tokens else None
    preempted = final_ckpt.preemption is not None and final_ckpt.preemption.stopped
    if preempted:
        metrics["status"] = "preempted"
    if trainer.is_global_zero:
        if final_ckpt.path is not None and (cfg.export.fp32 or cfg.export.hf) and not preempted:
            net_cfg = model_config(plan)["net"]
            net_factory = lambda: hydra.utils.instantiate(net_cfg)  # noqa: E731
            pretrained = getattr(datamodule, "pretrained", None)
            metrics["exports"] = export_final(
                final_ckpt.path, output_dir / "export", net_factory, datamodule.tokenizer, hf=bool(cfg.export.hf),
                tokenizer_dir=pretrained.local_dir if pretrained is not None else None,
                adapter=getattr(module, "adapter", None),  # model.adapter: export/adapter + the merged net
                int8_batches=val_batches(datamodule, cfg.trainer.get("limit_val_batches"))
                if cfg.export.get("int8") else None,  # export.int8: size and val perplexity vs fp32
            )
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        report = finish_run(output_dir)  # advisor rules -> findings, then report.html / report.md
        if dashboards is not None:  # every rank's findings and the advisor's, then W&B's findings table
            dashboards.finish(channel.read_all())
        _print_summary(metrics, output_dir)
        channel.print_summary(report, metrics.get("status"))  # incidents, then the verdict line, report path last
    if channel.stop_request is not None:
        raise StoppedByCheck(channel.stop_request)
    return metrics


def _print_header(cfg: DictConfig, output_dir: Path, module: Any = None) -> None:
    """What this run is, in a few lines: group choices, then every debug knob (torchtitan style).
    The model is the class that was built (``model.net._target_`` may point away from the group's net)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        choices = HydraConfig.get().runtime.choices
        picked = " ".join(f"{g}={choices[g]}" for g in ("model", "data", "strategy", "trainer", "logger", "debug")
                          if choices.get(g) is not None)
    except ValueError:  # not under Hydra (tests calling train() directly)
        picked = ""
    net = getattr(module, "net", None)
    if net is not None:  # "model=deepseek_v3_tiny" alone would name the group's net, not an overridden one
        built = f"net={type(net).__name__}"
        picked = f"{picked} {built}".strip() if "model=" not in picked else picked.replace(
            f"model={choices['model']}", f"model={choices['model']} {built}", 1)
    log.info("run: %s -> %s", picked, output_dir)
    for name, conf in (cfg.get("callbacks") or {}).items():
        if isinstance(conf, DictConfig) and is_debug_check(str(conf.get("_target_", ""))):
            knobs = {k: v for k, v in OmegaConf.to_container(conf, resolve=True).items() if k != "_target_"}
            log.info("debug: %s %s", name, knobs)


def _write_config(plan: RunPlan, resolved: dict[str, Any], output_dir: Path, trainer: L.Trainer) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    plan.write(output_dir)  # run_plan.json: the derived values, and what prepare changed and why
    for logger in trainer.loggers:
        logger.log_hyperparams(resolved)


def _collect_metrics(trainer: L.Trainer, module: Any, started: float, resumed_from: str | None,
                     final_ckpt: Path | None) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1
    }
    metrics.update({
        "val/loss_at_start": module.val_loss_at_start,
        "moe": moe.summary() if hasattr(moe := getattr(module, "moe", None), "summary") else None,  # for the report
        "global_step": trainer.global_step,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "zero_stage": (trainer.strategy.config or {}).get("zero_optimization", {}).get("stage")
        if hasattr(trainer.strategy, "config") else None,
        "precision": str(trainer.precision),
        "time_s": round(time.time() - started, 2),
        "resumed_from": resumed_from,
        "final_checkpoint": str(final_ckpt) if final_ckpt else None,
        "status": "interrupted" if trainer.interrupted else
        ("stopped_by_check" if get_channel().stop_request is not None else "completed"),
    })
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def _print_summary(metrics: dict[str, Any], output_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    table = Table(title="run summary", show_header=False)
    for key in ("status", "strategy", "zero_stage", "world_size", "precision", "global_step", "time_s",
                "throughput/tokens_per_s",
                "train/loss", "val/loss_at_start", "val/loss", "val/ppl", "final_checkpoint"):
        if metrics.get(key) is not None:
            table.add_row(key, fmt(metrics[key]))
    for name, path in (metrics.get("exports") or {}).items():
        table.add_row(f"export/{name}", path)
    table.add_row("run dir", str(output_dir))
    Console().print(table)
