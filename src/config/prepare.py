"""`prepare(cfg)`: the one step between the composed config and `build` — validate once, derive once.

The way to ``trainer.fit``, per process (the launching process, and again each child rank that
Lightning starts by re-running the entry point with ``LOCAL_RANK`` set)::

    src/train.py main()
      -m only     trainer/cli.py precheck_overrides   every job of the sweep composed first (and SLURM
                                                      tasks vs ranks), so a bad job is one line before
                                                      any runs; validates nothing
      compose     @hydra.main                         the config the run uses, once (an error composing
                                                      it: one line, trainer/cli.py composition_error)
      src/train.py run(cfg)
        -m: distributed/sweep.py run_job_in_subprocess       each job = a fresh `train.py` process: it
                                                      runs this same path (no validation here)
        config/prepare.py prepare(cfg)                THIS: validate once, then every derivation
        trainer/entry.py train(cfg)                   build -> fit -> export -> report

What ``prepare`` changes in ``cfg`` (in this order). None of it imports torch, Lightning, DeepSpeed or
transformers (but for the probes named in config/validate.py), so bad input fails in under a
second; tests/config/test_validation_imports.py holds that:

1. ``validate_config`` (config/validate.py): every key checked, one-line ConfigError; it writes nothing
   and returns the ``trainer.devices``/``num_nodes`` an external launcher's world fixes, adopted here
   (distributed/launch_env.py launcher_world).
2. ``data.tokenizer``/``data.vocab_size`` from the tokenizer in use (config/tokenizer_check.py).
3. ``DS_ACCELERATOR=cpu`` for a CPU run (DeepSpeed reads it at import).
4. ``data.global_batch_size`` -> per-rank ``data.batch_size`` (config/global_batch.py).
5. ``strategy.config`` (a DeepSpeed JSON) -> the matching Lightning keys (config/ds_config.py).
6. ``optim.optimizer.lr`` := ``optim.lr`` scaled to the global batch (models/optim.py scaled_lr).
7. ``optim.optimizer.fused: auto`` := true, false under torch AMP fp16 (models/optim.py resolve_fused).

Then the config is read-only, and the returned run plan (config/plan.py) holds the derived values, the
composed config as asked, and what changed and why. Nothing writes the config later: a value known only
then (a hub tokenizer's vocabulary, the loggers' resume and sweep identity) is passed as an argument to
what is built, and a new plan records it (docs/architecture.md, "From the command line to the report").
"""

from __future__ import annotations

import copy
import os

from omegaconf import DictConfig, OmegaConf, open_dict

from dsdebug.config.ds_config import apply_ds_json_to_cfg
from dsdebug.config.global_batch import apply_global_batch_size, world_size
from dsdebug.config.plan import RunPlan, adjustments_between, is_prepared, mark_prepared
from dsdebug.config.tokenizer_check import settle_tokenizer
from dsdebug.config.validate import fp16_supported, validate_config
from dsdebug.models.optim import resolve_fused, scaled_lr

__all__ = ["is_prepared", "prepare", "sweep_logger_arguments"]


def prepare(cfg: DictConfig) -> RunPlan:
    """Validate ``cfg``, settle every value derived from others into it, make it read-only and return
    the run plan (config/plan.py). Call it once per process, before ``build``; a second call is refused
    (it would validate a config that was already changed by the derivations)."""
    if is_prepared(cfg):
        raise RuntimeError("prepare(cfg) was already called on this config")
    asked = copy.deepcopy(cfg)  # the composed config, as the user asked for it
    world = validate_config(cfg)
    with open_dict(cfg):
        for key, value in world.items():  # an external launcher's world: trainer.devices / num_nodes
            cfg.trainer[key] = value
    settle_tokenizer(cfg)
    if str(cfg.trainer.accelerator) == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with open_dict(cfg):
        apply_global_batch_size(cfg)
        apply_ds_json_to_cfg(cfg, lambda: fp16_supported(str(cfg.trainer.accelerator)))
        global_batch = cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * world_size(cfg)
        cfg.optim.optimizer.lr = scaled_lr(float(cfg.optim.lr), global_batch, cfg.optim.get("scale_lr_base_batch_size"))
        if "fused" in cfg.optim.optimizer:
            cfg.optim.optimizer.fused = resolve_fused(cfg.optim.optimizer.fused, cfg.trainer.precision,
                                                      (cfg.get("strategy") or {}).get("_target_"))
    from dsdebug.distributed.sweep import wandb_sweep_identity

    identity = wandb_sweep_identity(str(cfg.paths.output_dir), str(cfg.get("task_name", "train"))) \
        if (cfg.get("logger") or {}).get("wandb") is not None else None  # (only W&B groups a sweep's runs)
    OmegaConf.set_readonly(asked, True)
    OmegaConf.set_readonly(cfg, True)  # from here on a write raises (tests/config/test_plan.py)
    plan = RunPlan(
        cfg=cfg, asked=asked, world_size=world_size(cfg), devices=cfg.trainer.devices,
        num_nodes=int(cfg.trainer.get("num_nodes", 1) or 1), per_rank_batch=int(cfg.data.batch_size),
        accumulate=int(cfg.trainer.accumulate_grad_batches), global_batch=int(global_batch),
        lr_asked=float(cfg.optim.lr), lr=float(cfg.optim.optimizer.lr), vocab_size=cfg.data.get("vocab_size"),
        tokenizer=cfg.data.get("tokenizer"), fused=cfg.optim.optimizer.get("fused"),
        precision=str(cfg.trainer.precision), gradient_clip=cfg.trainer.get("gradient_clip_val"),
        logger_arguments=sweep_logger_arguments(cfg, identity), adjustments=adjustments_between(asked, cfg))
    mark_prepared(cfg)
    return plan


def sweep_logger_arguments(cfg: DictConfig, identity: dict | None) -> dict[str, dict]:
    """A multirun job's W&B ``group``/``name`` (``identity``: distributed/sweep.py wandb_sweep_identity) for what the
    user left unset: the arguments the W&B logger is built with (the config is not written)."""
    wandb_cfg = (cfg.get("logger") or {}).get("wandb")
    if wandb_cfg is None or not identity:
        return {}
    args = {}
    if not wandb_cfg.get("group"):
        args["group"] = identity["group"]
    if wandb_cfg.get("name") in (None, "", cfg.get("task_name")):
        args["name"] = identity["name"]
    return {"wandb": args} if args else {}
