"""Checks on the composed config that must fail before anything is built or launched.

Each failure is a one-line `ConfigError` naming the key and the valid values. Nothing here
imports torch, Lightning, DeepSpeed or transformers, so a bad value fails in under a second
(tests/config/test_validation_imports.py holds it), except the probes that run last and only when
asked: the GPU count (trainer=gpu), fp16 on a CPU (16-mixed) and DeepSpeed's own schema for a
ds_config.json's zero section. The table of bad inputs and their errors: docs/bad_inputs.md.
"""

from __future__ import annotations

import copy
import json
import math
import os
from numbers import Number
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from dsdebug.errors import ConfigError, fail
from dsdebug.config.ds_config import check_ds_json
from dsdebug.config.global_batch import check_global_batch_size
from dsdebug.distributed.launch_env import launcher_world
from dsdebug.config.targets import check_targets
from dsdebug.config.callback_args import check_callback_args
from dsdebug.models.ckpt_mode import checkpointing_mode
from dsdebug.models.kernel_options import compile_setting, cross_entropy_mode
from dsdebug.config.tokenizer_check import check_tokenizer

__all__ = ["OutputDirCheck", "PRECISIONS", "dir_problem", "fp16_supported", "pretrained_config", "validate_config"]

PRECISIONS = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "64-true")

# What to give for a mandatory (`???`) value, by key.
_REQUIRED_HINTS = {
    "data.source.paths": "e.g. data.source.paths='corpus/*.txt' (a glob, a list of globs or a directory)",
    "data.source.name": "e.g. data.source.name=roneneldan/TinyStories, or data.source.name=text "
                        "data.source.data_files=corpus.txt",
    "model.net.name_or_path": "a save_pretrained directory or a hub id, e.g. model.net.name_or_path=/path/to/model",
    "strategy.config": "a DeepSpeed JSON file, e.g. strategy.config=examples/ds_configs/zero3_offload_all_bf16_auto.json",
}


def fp16_supported(accelerator: str) -> bool:
    """Whether fp16 compute works here: always on CUDA; on CPU only with AVX512-FP16/AMX."""
    if accelerator in ("gpu", "cuda"):
        return True
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # older torch without the probe
        return False


def _positive_number(value, key: str, integer: bool = False) -> None:
    ok = isinstance(value, Number) and not isinstance(value, bool) and value > 0
    if ok and integer:
        ok = float(value).is_integer()
    if not ok:
        kind = "positive integer" if integer else "positive number"
        raise ConfigError(f"{key} must be a {kind}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_config(cfg: DictConfig) -> dict[str, int]:
    """Check every key (a one-line ConfigError). Writes nothing; returns the ``trainer`` values an external
    launcher's world fixes (``prepare`` adopts them), against which the rest was checked."""
    _check_required(cfg)
    _positive_number(cfg.optim.lr, "optim.lr")
    fused = (cfg.optim.get("optimizer") or {}).get("fused")
    if not (fused is None or isinstance(fused, bool) or (isinstance(fused, str) and fused.lower() == "auto")):
        raise ConfigError(f"optim.optimizer.fused={fused!r} is invalid; valid: auto (true; false under torch AMP fp16), "
                          "true (torch's fused kernel), false, null (torch's default)")
    if cfg.optim.get("grad_clip") is not None and cfg.optim.grad_clip < 0:
        raise ConfigError(f"optim.grad_clip must be >= 0 or null, got {cfg.optim.grad_clip!r}")
    t = cfg.trainer
    _positive_number(t.max_steps, "trainer.max_steps", integer=True)
    _positive_number(t.accumulate_grad_batches, "trainer.accumulate_grad_batches", integer=True)
    if not _is_int(cfg.seed):
        raise ConfigError(f"seed must be an integer, got {cfg.seed!r}")
    precision = str(t.precision)
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={precision!r} is invalid; valid: {', '.join(PRECISIONS)}")
    _validate_devices(t)
    world = launcher_world(cfg)
    if world:  # the rest is checked against the world the run will have
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            cfg.trainer.update(world)
        t = cfg.trainer
    if not isinstance(cfg.get("malloc_tuning", True), bool):
        raise ConfigError(f"malloc_tuning={cfg.get('malloc_tuning')!r} is invalid; valid: true (keep freed host "
                          "memory for reuse), false (glibc's defaults)")
    strict = (cfg.get("debug") or {}).get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ConfigError(f"debug.strict={strict!r} is invalid; valid: false (a check that raises is reported and "
                          "switched off, the run goes on), true (it ends the run), null (DSDEBUG_STRICT decides)")
    resume = cfg.get("resume")
    if resume not in (None, "auto", "latest", "latest_valid"):
        raise ConfigError(
            f"resume={resume!r} is invalid; valid: null, auto, latest, latest_valid (or use ckpt_path=<path>)")
    if cfg.get("ckpt_path") and resume:
        raise ConfigError(f"give either ckpt_path=<path> or resume={resume}, not both")
    if cfg.get("ckpt_path"):
        path = Path(str(cfg.ckpt_path)).expanduser()
        if not path.exists():
            raise ConfigError(f"ckpt_path={cfg.ckpt_path}: no such file or directory")
    _validate_data(cfg.data)
    _check_moe_aux_coef(cfg.model)
    checkpointing_mode(cfg.model.get("gradient_checkpointing"))  # a ConfigError naming the key, before torch
    compile_setting(cfg.model.get("compile"))  # the model's kernel switches, likewise
    cross_entropy_mode(cfg.model.get("cross_entropy"))
    _check_model_fits_data(cfg)
    check_global_batch_size(cfg)
    check_targets(cfg)
    check_callback_args(cfg)  # each check's declared argument rules, read as data (config/check_args.json)
    # Last, the checks that ask the machine or a library: torch for the GPU count and CPU fp16,
    # DeepSpeed's own schema for a ds_config.json's zero section. Every other value has been
    # checked by now without importing either (tests/config/test_validation_imports.py).
    _probe_gpus(t)
    if precision.startswith("16") and not fp16_supported(str(t.accelerator)):
        raise ConfigError(
            "trainer.precision=16-mixed: this CPU has no fp16 support (needs AVX512-FP16/AMX); "
            "valid here: 32-true, bf16-mixed (or run with trainer=gpu)"
        )
    check_ds_json(cfg)
    return world


def _check_required(cfg: DictConfig) -> None:
    """A `???` value left unset (e.g. data=text_files without data.source.paths)."""
    missing = sorted(_missing_keys(OmegaConf.to_container(cfg, resolve=False), ""))
    if missing:
        key = missing[0]
        hint = _REQUIRED_HINTS.get(key, f"e.g. {key}=<value>")
        also = f" (also unset: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ConfigError(f"{key} is required but not set{also}; give it on the command line: {hint}")


def _missing_keys(node: Any, prefix: str) -> list[str]:
    """Keys whose value is `???`, read without resolving any interpolation."""
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _missing_keys(v, f"{prefix}{key}.")]
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in _missing_keys(v, f"{prefix}{i}.")]
    return [prefix.rstrip(".")] if node == "???" else []


def _validate_devices(t: DictConfig) -> None:
    accelerator = str(t.accelerator)
    valid_acc = ("cpu", "gpu", "cuda", "auto")
    if accelerator not in valid_acc:
        raise ConfigError(f"trainer.accelerator={accelerator!r} is invalid; valid: {', '.join(valid_acc)}")
    num_nodes = t.get("num_nodes", 1)
    if not _is_int(num_nodes) or num_nodes < 1:
        raise ConfigError(f"trainer.num_nodes must be a positive integer, got {num_nodes!r}")
    devices = t.devices
    if accelerator in ("gpu", "cuda"):
        return  # counted by _probe_gpus, after every check that needs no torch
    if devices == "auto":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1 or devices > cores:
        raise ConfigError(
            f"trainer.devices={devices!r} CPU processes but this machine has {cores} core(s); valid: 1..{cores}"
        )


def _probe_gpus(t: DictConfig) -> None:
    """``trainer.devices`` against the GPUs torch sees (imports torch: GPU runs only)."""
    accelerator, devices = str(t.accelerator), t.devices
    if accelerator not in ("gpu", "cuda"):
        return
    import torch

    available = torch.cuda.device_count()
    if available == 0:
        raise ConfigError(
            f"trainer.accelerator={accelerator} but no CUDA GPU is visible; use trainer=cpu or trainer=ddp_sim"
        )
    if devices in ("auto", -1):
        return
    if not isinstance(devices, int) or devices < 1 or devices > available:
        raise ConfigError(f"trainer.devices={devices!r} but {available} GPU(s) are available; valid: 1..{available}, auto")


def _validate_data(data: DictConfig) -> None:
    """The sizes every other check relies on (LMDataModule checks them again, and the rest)."""
    for key in ("vocab_size", "seq_len", "batch_size"):
        value = data.get(key)
        if not _is_int(value) or value < 1:  # same wording as LMDataModule's own check
            raise ConfigError(f"data.{key} must be a positive int, got {value!r}")
    cache_dir = data.get("cache_dir")
    synthetic = str(data.get("source", {}).get("_target_", "")).endswith("SyntheticCorpus")
    _validate_documents(data, synthetic)
    if isinstance(cache_dir, str) and cache_dir and not synthetic:  # synthetic data writes no cache
        problem = dir_problem(cache_dir)
        if problem:
            raise ConfigError(
                f"data.cache_dir={cache_dir}: cannot create the tokenizer cache there: {problem}; "
                "valid: a writable directory (set data.cache_dir, paths.cache_dir or DSDEBUG_CACHE_DIR)"
            )


def _validate_documents(data: DictConfig, synthetic: bool) -> None:
    """data.packing / data.token_budget / data.token_budget_lr (LMDataModule checks them again)."""
    packing, budget, rule = data.get("packing", False), data.get("token_budget"), data.get("token_budget_lr", "none")
    if not isinstance(packing, bool):
        raise ConfigError(f"data.packing={packing!r} is invalid; valid: true, false")
    if budget is not None and (not _is_int(budget) or budget < data.seq_len):
        raise ConfigError(f"data.token_budget must be null or an int >= data.seq_len={data.seq_len} "
                          f"(tokens per rank per step), got {budget!r}")
    rules = ("none", "linear", "sqrt")  # dsdebug.data.token_budget.LR_RULES (not imported: torch-free here)
    if rule not in rules:
        raise ConfigError(f"data.token_budget_lr={rule!r} is invalid; valid: {', '.join(rules)}")
    if rule != "none" and budget is None:
        raise ConfigError(f"data.token_budget_lr={rule} needs data.token_budget=<tokens>; "
                          "valid: data.token_budget_lr=none, or set data.token_budget")
    if budget is not None and data.get("global_batch_size") is not None:
        raise ConfigError(f"data.global_batch_size={data.global_batch_size} does not apply with data.token_budget="
                          f"{budget}: a step's batches are cut by tokens, their row count varies; valid: leave "
                          "data.global_batch_size unset (data.batch_size is the validation batch)")
    if (packing or budget is not None) and synthetic:
        key = "data.packing=true" if packing else "data.token_budget"
        raise ConfigError(f"{key}: a synthetic source has no documents to pack or batch by length; "
                          "valid: data=kjv, data=text_files or data=hf_dataset (or leave it off)")


# -- the model must fit the data: positions and vocabulary ---------------------------------


def _check_moe_aux_coef(model: DictConfig) -> None:
    """The form src/models/moe_balance.resolve_coef accepts (which checks again for direct use)."""
    value = model.get("moe_aux_loss_coef", "auto")
    auto = isinstance(value, str) and value.strip().lower() == "auto"
    number = isinstance(value, Number) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not (auto or number):
        raise ConfigError(f"model.moe_aux_loss_coef={value!r} is invalid; valid: auto, or a number >= 0 (0 = off)")


def _check_model_fits_data(cfg: DictConfig) -> None:
    """data.seq_len <= the model's positions, and the token ids fit its embedding rows, from the
    config alone (for model=hf_pretrained: from its config.json), before anything is built. The
    ids are the tokenizer's when a pretrained one is used (its rules: tokenizer_check.py), else
    data.vocab_size's."""
    model, data = cfg.model, cfg.data
    net = model.get("net")
    if not isinstance(net, DictConfig):
        return
    max_pos, model_vocab = net.get("max_position_embeddings"), net.get("vocab_size")
    pos_name, vocab_name = "model.net.max_position_embeddings", "model.net.vocab_size"
    pos_fix, vocab_fix = f"raise {pos_name}", f"raise {vocab_name}"
    where, model_config, config_name = "", {"vocab_size": model_vocab}, "model.net"
    if "name_or_path" in net:
        loaded = pretrained_config(net.name_or_path)
        if loaded is None:
            model_config = None  # a hub id: checked when it is loaded
        else:
            model_config, config_file = loaded
            max_pos = model_config.get("max_position_embeddings", model_config.get("n_positions"))
            model_vocab = model_config.get("vocab_size")
            pos_name, vocab_name = "the model's max_position_embeddings", "the model's vocab_size"
            where, config_name = f" in {config_file}", str(config_file)
            pos_fix, vocab_fix = "use a model with a longer context", "use a model with a larger vocabulary"
    if _is_int(max_pos) and data.seq_len > max_pos:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds {pos_name}={max_pos}{where}; "
            f"valid: data.seq_len<={max_pos} (or {pos_fix})"
        )
    if check_tokenizer(cfg, model_config, config_name):
        return  # data.vocab_size follows the tokenizer, which was checked against the model
    if _is_int(model_vocab) and data.vocab_size > model_vocab:
        raise ConfigError(
            f"data.vocab_size={data.vocab_size} exceeds {vocab_name}={model_vocab}{where} (token ids "
            f"would index past the embedding); valid: data.vocab_size<={model_vocab} (or {vocab_fix})"
        )


def pretrained_config(name_or_path: Any) -> tuple[dict, Path] | None:
    """config.json of a local save_pretrained directory; None for a hub id. A local path
    (absolute, ./, ../ or ~) that is missing, or a directory without a readable config.json,
    is a ConfigError naming model.net.name_or_path."""
    name = str(name_or_path)
    path = Path(os.path.expanduser(name))
    if not path.exists():
        if name.startswith(("/", "./", "../", "~")):
            raise ConfigError(
                f"model.net.name_or_path={name}: no such directory; valid: a save_pretrained directory "
                "(with config.json) or a Hugging Face hub id 'org/name'"
            )
        return None
    if not path.is_dir():
        raise ConfigError(f"model.net.name_or_path={name} is a file; valid: a save_pretrained directory "
                          "(with config.json) or a hub id")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.net.name_or_path={name} has no config.json, so it is not a save_pretrained "
                          "directory; valid: a directory written by save_pretrained (e.g. a run's export/hf)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.net.name_or_path: {config_file} is unreadable or not JSON ({e}); "
                          "re-export the model with save_pretrained") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.net.name_or_path: {config_file} must hold a JSON object, "
                          f"got {type(config).__name__}")
    return config, config_file


# -- output directories --------------------------------------------------------------------


def dir_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be created/written as a directory (None when it can). Creates nothing.
    Checks the nearest existing ancestor: a file there, or no write permission (read-only
    file systems included; root passes permission bits, so a file in the way is the usual case)."""
    target = Path(os.path.expanduser(str(path))).absolute()
    probe = target
    while not probe.exists() and probe != probe.parent:
        if probe.is_symlink():
            return f"{probe} is a dangling symlink"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


class OutputDirCheck(Callback):
    """Hydra callback (conf/hydra/default.yaml): the run/sweep dir can be created, checked
    before Hydra makes it (else Hydra fails with a traceback and exit code 1)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_run_dir(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_run_dir(config, "hydra.sweep.dir")


def _check_run_dir(config: DictConfig, key: str) -> None:
    run_dir = str(OmegaConf.select(config, key))
    problem = dir_problem(run_dir)
    if problem is None:
        return
    log_dir = OmegaConf.select(config, "paths.log_dir", default=None)
    if log_dir and Path(run_dir).absolute().is_relative_to(Path(str(log_dir)).absolute()):
        fail(f"paths.log_dir={log_dir}: cannot create the run dir {run_dir}: {problem}; "
             "valid: a writable directory (set paths.log_dir)")
    fail(f"{key}={run_dir}: cannot create it: {problem}; valid: a writable directory (set {key} or paths.log_dir)")
