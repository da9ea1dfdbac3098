"""What the framework does with every top-level key of a user's ds_config.json (DeepSpeed 0.19.8).

A ds_config.json copied from a tutorial, HF's tests or DeepSpeedExamples must either train as
written or stop with one line saying why. Each key DeepSpeed 0.19.8 reads falls in one class:

| class | what happens | said where |
|---|---|---|
| settled | the number becomes the run's setting (the JSON wins), ``"auto"`` takes the run's | info line per change |
| honoured | passed to DeepSpeed, which acts on it under Lightning | docs/ds_config.md |
| applied | the framework acts on it (DeepSpeed alone would not under Lightning) | docs/ds_config.md |
| replaces | DeepSpeed builds it instead of the project's (optimizer, scheduler) | warning |
| ignored | DeepSpeed accepts it but nothing reads it under Lightning | one info line listing them |
| refused | cannot apply here: one-line error naming the key and what to use | ``ConfigError`` |

Unknown keys (DeepSpeed ignores them silently, so a typo costs a run) get a warning with the
closest known key. Pure Python on a dict: runs before torch is imported (fast errors).
docs/ds_config.md is the same table for people; tests/config/test_ds_config_corpus.py keeps them in step.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from dsdebug.errors import ConfigError

__all__ = ["APPLIED", "CHECKPOINTING_DS_ONLY", "DS_OPTIMIZERS", "HONOURED", "IGNORED", "KNOWN", "REFUSABLE",
           "REPLACES", "SETTLED", "ignored_keys", "refusals", "unknown_keys"]

SETTLED = {
    "train_batch_size": "with train_micro_batch_size_per_gpu and gradient_accumulation_steps, DeepSpeed's rule "
                        "gives data.batch_size and trainer.accumulate_grad_batches",
    "train_micro_batch_size_per_gpu": "-> data.batch_size",
    "gradient_accumulation_steps": "-> trainer.accumulate_grad_batches",
    "gradient_clipping": "-> trainer.gradient_clip_val",
    "fp16": "enabled -> trainer.precision=16-mixed (bf16-mixed on a CPU without fp16); its loss-scale keys honoured",
    "bf16": "enabled -> trainer.precision=bf16-mixed",
    "bfloat16": "old name of bf16, read the same way",
}
HONOURED = {
    "zero_optimization": "ZeRO stage, buckets, offload; validated with DeepSpeed's own model up front",
    "steps_per_print": "the engine's progress line (step, lr, loss scale) every N optimizer steps",
    "prescale_gradients": "divide gradients before the all-reduce",
    "gradient_predivide_factor": "divide by this before and the rest after the all-reduce",
    "gradient_allreduce_op": "the reduction op of the gradient all-reduce",
    "communication_data_type": "dtype of gradient communication",
    "zero_allow_untested_optimizer": "lets ZeRO wrap an optimizer DeepSpeed did not build",
    "zero_force_ds_cpu_optimizer": "requires DeepSpeed's CPU optimizer with offload",
    "memory_breakdown": "memory use printed around forward/backward/step",
    "dump_state": "the engine prints its state after init",
    "disable_allgather": "ZeRO-1/2 partition update without all-gather",
    "disable_python_gc": "gc control inside the engine",
    "comms_logger": "DeepSpeed's per-collective log (deepspeed.comm.log_summary)",
    "tensorboard": "DeepSpeed's own monitor files (beside the framework's loggers)",
    "csv_monitor": "DeepSpeed's own monitor files",
    "wandb": "DeepSpeed's own monitor (a second W&B run: prefer logger=wandb)",
    "comet": "DeepSpeed's own monitor",
    "checkpoint": "DeepSpeed checkpoint options (tag validation, node-local storage, universal loading)",
    "aio": "asynchronous I/O for NVMe offload",
    "data_types": "e.g. grad_accum_dtype",
    "timers": "throughput timer options",
    "log_level": "DeepSpeed's logger level",
    "torch_autocast": "torch.autocast inside the engine's forward",
    "sparse_gradients": "sparse embedding gradients",
}
APPLIED = {
    "wall_clock_breakdown": "DeepSpeed's timers, made safe for Lightning's re-entrant forward; per-step phase times "
                            "logged as deepspeed/<phase>_ms and summarised as a finding",
    "flops_profiler": "DeepSpeed's profiler at its profile_step (turns the wall-clock timers on too, as above)",
    "activation_checkpointing": "turns on the model's gradient checkpointing (HF gradient_checkpointing_enable); "
                                "the DeepSpeed-checkpoint-only sub-keys are listed as ignored",
}
REPLACES = {
    "optimizer": "DeepSpeed builds it instead of the project's AdamW (optim.*); \"auto\" params come from optim.*",
    "scheduler": "DeepSpeed builds it instead of the project's warmup + cosine; \"auto\" params from the run",
}
IGNORED = {
    "dataloader_drop_last": "only for DeepSpeed's own data loader (deepspeed_io); the framework's drops the last "
                            "partial batch already",
    "data_efficiency": "needs DeepSpeed's data loader / curriculum hooks, not used under Lightning",
    "curriculum_learning": "needs DeepSpeed's data loader, not used under Lightning",
    "progressive_layer_drop": "not read by DeepSpeed 0.19's engine",
    "eigenvalue": "used only with progressive layer drop / MoQ",
    "quantize_training": "MoQ: needs DeepSpeed's quantizer wired into the model",
    "compression_training": "needs deepspeed.compression.init_compression on the model",
    "weight_quantization": "inference only",
    "sparse_attention": "needs DeepSpeed's sparse attention modules in the model",
    "pipeline": "only for DeepSpeed's PipelineModule",
    "autotuning": "only under `deepspeed --autotuning`",
    "vocabulary_size": "only for DeepSpeed's own model builders",
    "nebula": "Azure Nebula checkpoint service",
    "datastates_ckpt": "an alternative checkpoint engine, not used by Lightning's checkpointing",
    "graph_harvesting": "CUDA graphs for DeepSpeed's own kernels",
    "compile": "DeepCompile runs only after engine.compile(), which Lightning does not call",
    "expert_parallel": "only for DeepSpeed's MoE layers (HF/DeepSeek MoE layers here are plain modules)",
    "use_data_before_expert_parallelism": "only for DeepSpeed's MoE layers",
    "seq_parallel_communication_data_type": "only with sequence parallelism",
}
# sub-keys of activation_checkpointing that only DeepSpeed's own checkpoint function reads
CHECKPOINTING_DS_ONLY = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                         "number_checkpoints", "synchronize_checkpoint_boundary", "profile")
REFUSABLE = {  # keys refused only with some values (see refusals())
    "amp": "apex AMP: apex is not installed; use \"bf16\" or \"fp16\"",
    "managed_gradient_accumulation": "false moves the update into a caller-owned step(); Lightning steps every "
                                     "micro-batch",
    "elasticity": "enabled: DeepSpeed would choose the batch size; Lightning's loader has a fixed one",
    "hybrid_engine": "enabled: RLHF generation engine, not a training setup",
    "sequence_parallel_size": "> 1: Ulysses needs a sequence-parallel model and data loader",
    "tensor_parallel": "autotp_size > 1: needs a tensor-parallel model load",
}
KNOWN = {**SETTLED, **HONOURED, **APPLIED, **REPLACES, **IGNORED, **REFUSABLE}

# optimizer "type" values DeepSpeed 0.19.8 builds itself (case-insensitive); any other must be a torch.optim class
DS_OPTIMIZERS = ("adam", "adamw", "adagrad", "lamb", "lion", "muon", "muadam", "muadamw", "musgd")
_ONE_BIT = ("onebitadam", "onebitlamb", "zerooneadam")
_VALID_TYPES = "Adam, AdamW, Adagrad, Lion, Lamb (CUDA only), Muon, or a torch.optim class name such as SGD"


def refusals(config: dict, source: str, on_cpu: bool) -> None:
    """Raise ConfigError (one line) for the first key that cannot apply on this machine."""
    def refuse(key: str, why: str) -> None:
        raise ConfigError(f"{source}: {key}: {why}")

    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("type"), str):
        kind = optimizer["type"]
        if kind.lower() in _ONE_BIT:
            refuse(f"optimizer.type={kind}", "1-bit optimizers compress the gradient all-reduce over NCCL/MPI (not "
                   "gloo/CPU) and were removed in DeepSpeed 0.19; use \"AdamW\" (the same update, uncompressed), "
                   "or remove the optimizer section to train with the project's AdamW (optim.*)")
        if kind.lower() == "lamb" and on_cpu:
            refuse(f"optimizer.type={kind}", "DeepSpeed's Lamb is FusedLamb, a CUDA kernel; on CPU use \"AdamW\" "
                   "or run on a GPU")
        if kind.lower() not in DS_OPTIMIZERS and not _is_torch_optimizer(kind):
            refuse(f"optimizer.type={kind}", f"not an optimizer DeepSpeed can build; valid: {_VALID_TYPES}")
        params = optimizer.get("params") or {}
        if "max_grad_norm" in params:
            refuse("optimizer.params.max_grad_norm", "DeepSpeed refuses it; use the top-level \"gradient_clipping\"")
    if _enabled(config.get("amp"), default=False):
        refuse("amp.enabled", REFUSABLE["amp"])
    if config.get("managed_gradient_accumulation") is False:
        refuse("managed_gradient_accumulation=false", REFUSABLE["managed_gradient_accumulation"] +
               "; remove the key")
    if _enabled(config.get("elasticity"), default=False):
        refuse("elasticity.enabled", "DeepSpeed's elastic batch sizing fights Lightning's fixed loader batch; set "
               "train_batch_size (or train_micro_batch_size_per_gpu) instead")
    if _enabled(config.get("hybrid_engine"), default=False):
        refuse("hybrid_engine.enabled", REFUSABLE["hybrid_engine"].split(": ", 1)[1] + "; remove the section")
    if isinstance(config.get("sequence_parallel_size"), int) and config["sequence_parallel_size"] > 1:
        refuse(f"sequence_parallel_size={config['sequence_parallel_size']}", "Ulysses sequence parallelism needs a "
               "sequence-parallel model and data loader, which this framework does not build; use 1")
    tp = config.get("tensor_parallel")
    if isinstance(tp, dict) and isinstance(tp.get("autotp_size"), int) and tp["autotp_size"] > 1:
        refuse(f"tensor_parallel.autotp_size={tp['autotp_size']}", "tensor parallelism needs the model loaded "
               "through DeepSpeed's AutoTP, which this framework does not do; remove the section")
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        for sub in ("offload_optimizer", "offload_param"):
            section = zero.get(sub)
            if isinstance(section, dict) and section.get("device") == "nvme":
                path = section.get("nvme_path")
                if not path or not os.path.isdir(str(path)):
                    refuse(f"zero_optimization.{sub}.nvme_path={path}", "NVMe offload needs an existing directory "
                           "on fast local storage; give one, or use \"device\": \"cpu\"")


def unknown_keys(config: dict) -> list[str]:
    """Top-level keys DeepSpeed 0.19.8 does not read, each with the closest known one."""
    out = []
    for key in config:
        if key not in KNOWN:
            close = difflib.get_close_matches(key, KNOWN, n=1)
            out.append(f"{key} (did you mean {close[0]}?)" if close else key)
    return out


def ignored_keys(config: dict) -> list[str]:
    """Keys present that nothing reads under Lightning, with why (for the info line)."""
    out = [f"{key} ({IGNORED[key]})" for key in config if key in IGNORED]
    checkpointing = config.get("activation_checkpointing")
    if isinstance(checkpointing, dict):
        ds_only = [k for k in CHECKPOINTING_DS_ONLY if checkpointing.get(k)]
        if ds_only:
            out.append(f"activation_checkpointing.{{{', '.join(ds_only)}}} (read only by DeepSpeed's own checkpoint "
                       "function, which HF models do not call; their gradient checkpointing is turned on instead)")
    return out


def _enabled(section: Any, default: bool) -> bool:
    if isinstance(section, dict):
        return section.get("enabled", default) is True
    return section is True


def _is_torch_optimizer(name: str) -> bool:
    import torch.optim  # only reached for a non-DeepSpeed type name

    return isinstance(getattr(torch.optim, name, None), type)
