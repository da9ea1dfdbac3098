"""`prepare(cfg)`: the one step between the composed config and `build` — validate once, derive once.

The way to ``trainer.fit``, per process (the launching process, and again each child rank that
Lightning starts by re-running the entry point with ``LOCAL_RANK`` set)::

    src/train.py main()
      compose #1  trainer/cli.py precheck_overrides   Hydra compose API, only to turn a composition
                                                      error (unknown option, misspelt key, syntax,
                                                      every job of a -m sweep, SLURM tasks vs ranks)
                                                      into one line; validates nothing. Skipped in
                                                      our own child ranks (their parent checked).
      compose #2  @hydra.main                         the config the run uses
      trainer/cli.py run(cfg)
        -m: distributed/sweep.py run_job_in_subprocess       each job = a fresh `train.py` process: it
                                                      runs this same path (no validation here)
        config/prepare.py prepare(cfg)                THIS: validate once, then every derivation
        trainer/entry.py train(cfg)                   build -> fit -> export -> report

What ``prepare`` changes in ``cfg`` (in this order). None of it imports torch, Lightning, DeepSpeed or
transformers (but for the probes named in config/validate.py), so bad input fails in under a
second; tests/config/test_validation_imports.py holds that:

1. ``validate_config`` (config/validate.py): every key checked, one-line ConfigError. It also
   fits ``trainer.devices``/``num_nodes`` to an external launcher's world (distributed/launch_env.py).
2. ``data.tokenizer``/``data.vocab_size`` from the tokenizer in use (config/tokenizer_check.py).
3. ``DS_ACCELERATOR=cpu`` for a CPU run (DeepSpeed reads it at import).
4. ``data.global_batch_size`` -> per-rank ``data.batch_size`` (config/global_batch.py).
5. ``strategy.config`` (a DeepSpeed JSON) -> the matching Lightning keys (config/ds_config.py).
6. ``optim.optimizer.lr`` := ``optim.lr`` scaled to the global batch (models/optim.py scaled_lr).
7. ``optim.optimizer.fused: auto`` := true, false under torch AMP fp16 (models/optim.py resolve_fused).

Changed later, by the layers that own the knowledge (not config's business): ``data.vocab_size``
once a hub tokenizer is loaded (trainer/entry.py build), the loggers' resume identity
(checkpoint/resume.py prepare_loggers) and the W&B sweep group (callbacks/log_sync.py).
"""

from __future__ import annotations

import os
import weakref

from omegaconf import DictConfig, open_dict

from dsdebug.config.ds_config import apply_ds_json_to_cfg
from dsdebug.config.global_batch import apply_global_batch_size, world_size
from dsdebug.config.tokenizer_check import settle_tokenizer
from dsdebug.config.validate import fp16_supported, validate_config
from dsdebug.models.optim import resolve_fused, scaled_lr

__all__ = ["prepare", "is_prepared"]

_prepared: dict[int, weakref.ref] = {}  # by identity: DictConfig compares (and hashes) by content


def prepare(cfg: DictConfig) -> DictConfig:
    """Validate ``cfg`` and settle every value derived from others, in place; returns ``cfg``.
    Call it once per process, before ``build``; a second call is refused (it would validate a
    config that was already changed by the derivations)."""
    if is_prepared(cfg):
        raise RuntimeError("prepare(cfg) was already called on this config")
    validate_config(cfg)
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
    _prepared[id(cfg)] = weakref.ref(cfg)
    return cfg


def is_prepared(cfg: DictConfig) -> bool:
    """Whether ``prepare`` ran on this config object (``build``/``train`` need it)."""
    ref = _prepared.get(id(cfg))
    return ref is not None and ref() is cfg
