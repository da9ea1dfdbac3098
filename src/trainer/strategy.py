"""Strategies: Lightning's DDP and DeepSpeed, runnable on CPU as well as CUDA.

Lightning's `DeepSpeedStrategy` refuses any non-CUDA accelerator, although DeepSpeed has a
CPU accelerator (gloo backend, CPUAdam offload, bf16). Exactly three spots assume CUDA
(see ../shared/NOTES.md): the accelerator check in `setup_environment`, the device-index
validation in `setup_distributed`, and ``device_rank=root_device.index`` (None on CPU) in
the two `deepspeed.initialize` calls. `DebugDeepSpeedStrategy` changes only those, and
only when the root device is not CUDA; on GPUs it is Lightning's strategy unchanged.

One change applies on every device: gradient accumulation. Lightning divides each
micro-batch's loss by ``accumulate_grad_batches`` and DeepSpeed's ``engine.backward`` divided
it again by ``gradient_accumulation_steps`` (Lightning #6170), so k x b accumulation gave
1/k of the gradient of one k*b batch. `DebugDeepSpeedStrategy.backward` calls the engine
with ``scale_wrt_gas=False``: Lightning's division is the only one.

Parameters DeepSpeed's engine chokes on (param_layout.py): a 0-dim or non-contiguous one is carried
through ``deepspeed.initialize`` (`EngineLayout`), one it cannot hold is refused before it starts
(`check_params`); under DDP a parameter without a gradient is named in one line (`on_exception`).

A check's ``on_error=skip`` drops one update through the strategy, which knows its engine's internals:
``skip_update`` (skip_step.py).

Both strategies launch child ranks with `HydraAwareLauncher` (see launcher.py).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.fabric.utilities.seed import reset_seed

from dsdebug.config.ds_auto import resolve_auto_values
from dsdebug.config.ds_config import load_ds_config
from dsdebug.distributed.launcher import HydraLauncherMixin
from dsdebug.errors import ConfigError
from dsdebug.trainer.skip_step import arm_skip
from dsdebug.trainer.param_layout import EngineLayout, refuse_unheld, unused_parameter_error
from dsdebug.trainer.comm_options import (ZERO_PLUS_PLUS, build_ddp_hook, check_ddp_options, check_ds_options, ds_comm_setting,
                                          report_comm_setting)

__all__ = ["DebugDDPStrategy", "DebugDeepSpeedStrategy", "cache_cpu_device_count", "enable_activation_checkpointing",
           "guard_reentrant_forward", "skip_shm_comm_op"]

log = logging.getLogger(__name__)


def skip_shm_comm_op() -> None:
    """DeepSpeed's CPU backend builds (JIT, tens of seconds on first use) and loads its shared-memory
    comm op when its process group starts, every run, 1 rank included. The op serves only
    ``inference_all_reduce`` (AutoTP inference); training's collectives go through torch.distributed
    (gloo). Marked incompatible, it is neither built nor loaded: the first ``make train`` starts
    training that much sooner (docs/benchmarks.md, first run)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _check_ddp_keys(kwargs: dict[str, Any]) -> None:
    """Lightning hands keys it does not know to DistributedDataParallel, which raises a TypeError
    only once the ranks run: a key neither takes is a one-line error now."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    ours = ["comm_hook", "powersgd_rank", "powersgd_warm_start", "powersgd_start_iter"]
    lightning = [n for n in inspect.signature(DDPStrategy.__init__).parameters if n not in ("self", "kwargs")]
    torch_ddp = [n for n in inspect.signature(DistributedDataParallel.__init__).parameters
                 if n not in ("self", "module", "device_ids", "output_device", "process_group", "kwargs")]
    unknown = sorted(set(kwargs) - set(ours + lightning + torch_ddp))
    if unknown:
        raise ConfigError(f"strategy.{unknown[0]} is not an option of the DDP strategy; valid: "
                          f"{', '.join(dict.fromkeys(ours + lightning + torch_ddp))}")


class DebugDDPStrategy(HydraLauncherMixin, DDPStrategy):
    """Lightning's DDP with Hydra-aware child launching and a configurable comm hook
    (``comm_hook``: none | fp16 | bf16 | powersgd; see comm_options.py), registered on CPU too."""

    def __init__(self, comm_hook: str = "none", powersgd_rank: int = 1, powersgd_warm_start: bool = True,
                 powersgd_start_iter: int = 2, **kwargs: Any) -> None:
        import torch

        self.comm_hook = str(comm_hook)
        self._powersgd = {"powersgd_rank": powersgd_rank, "powersgd_warm_start": powersgd_warm_start,
                          "powersgd_start_iter": powersgd_start_iter}
        check_ddp_options(self.comm_hook, self._powersgd, kwargs)
        _check_ddp_keys(kwargs)
        if self.comm_hook != "none" and kwargs.get("ddp_comm_hook") is not None:
            raise ConfigError("strategy.comm_hook and strategy.ddp_comm_hook are both set; valid: one of them")
        if self.comm_hook == "bf16" and not torch.cuda.is_available():  # fail before any rank starts
            build_ddp_hook("bf16", self._powersgd, None, on_cuda=False)
        self._ddp_options = {k: kwargs[k] for k in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")
                             if k in kwargs}
        super().__init__(**kwargs)

    def skip_update(self, optimizer: Any) -> Any:
        """Drop the coming optimizer update (a check's ``on_error=skip``): skip_step.py; returns the undo."""
        return arm_skip(self.lightning_module.trainer, optimizer)

    def on_exception(self, exception: BaseException) -> None:
        # read torch's message before Lightning replaces it with its generic hint
        unused = unused_parameter_error(str(exception), self.lightning_module) if self.lightning_module else None
        super().on_exception(exception)
        if unused is not None:  # trainer/cli.py finds it behind the exception: one line, exit 2
            exception.__cause__ = unused

    def _register_ddp_hooks(self) -> None:
        if self.comm_hook == "none":
            super()._register_ddp_hooks()  # a ddp_comm_hook passed directly (Lightning: CUDA only)
        else:
            # Lightning registers hooks on CUDA only; torch's fp16 and PowerSGD hooks work on gloo too
            state, hook = build_ddp_hook(self.comm_hook, self._powersgd, None, self.root_device.type == "cuda")
            self.model.register_comm_hook(state, hook)
        if self.is_global_zero:
            setting = {"comm_hook": self.comm_hook, **self._ddp_options}
            if self.comm_hook == "powersgd":
                setting.update(self._powersgd)
            report_comm_setting("ddp", setting, self.world_size, self._get_process_group_backend())


class DebugDeepSpeedStrategy(HydraLauncherMixin, DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy on CUDA, and on CPU through DeepSpeed's CPU accelerator.

    ``config`` may be a dict or a path to a user's ds_config.json, passed through verbatim
    except that HF-style ``"auto"`` values are resolved from the trainer/model at setup.
    """

    OPTIONS = ("communication_data_type", *ZERO_PLUS_PLUS)  # ours, taken from **kwargs (trainer/instantiate.py lists them)

    def __init__(self, config: str | dict | None = None, **kwargs: Any) -> None:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:  # named, so the error names the extra (errors.EXTRAS)
            raise ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed")
        self._ds_config_source = config if isinstance(config, str) else None
        if isinstance(config, str):
            config = load_ds_config(config)
        comm = {k: kwargs.pop(k) for k in self.OPTIONS if k in kwargs}
        # only a user's ds_config asks for activation checkpointing: Lightning's own default config
        # (strategy=zero2 without a config) always carries an all-false "activation_checkpointing"
        # section, which turned gradient checkpointing on in every run (+~30 % CPU per step, measured)
        self._asks_activation_checkpointing = isinstance(config, dict) and isinstance(
            config.get("activation_checkpointing"), dict)
        super().__init__(config=config, **kwargs)
        if comm.get("communication_data_type") is not None:
            self.config["communication_data_type"] = comm.pop("communication_data_type")
        comm.pop("communication_data_type", None)
        if comm:  # ZeRO++ keys from the yaml; a user's ds_config.json is left as written
            self.config.setdefault("zero_optimization", {}).update(comm)
        import torch

        check_ds_options(self.config, on_cuda=torch.cuda.is_available())  # before any rank starts

    @property
    def _on_cuda(self) -> bool:
        return self.root_device.type == "cuda"

    @property
    def offloads_optimizer(self) -> bool:
        zero = (self.config or {}).get("zero_optimization", {})
        return (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")

    def check_params(self, module: Any, gradient_clip_val: float | None = None) -> None:
        """A parameter DeepSpeed's engine cannot hold (trainer/param_layout.py): one ConfigError before the
        engine starts. trainer/entry.py build calls it right after the model and trainer are built (with the
        trainer's clipping); the engine setup again, for a plain Lightning script."""
        precision = getattr(getattr(self, "precision_plugin", None), "precision", None)
        refuse_unheld(module, self.config, precision, gradient_clip_val)

    def skip_update(self, optimizer: Any) -> Any:
        """Drop the coming update through DeepSpeed's own overflow path (skip_step.py); returns the undo, or None
        before the accumulation boundary (the request waits for it)."""
        return arm_skip(self.lightning_module.trainer, optimizer)

    def setup_environment(self) -> None:
        if self._on_cuda:
            return super().setup_environment()
        # DeepSpeed picks its accelerator once, at first use: make it the CPU one.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Skip DeepSpeedStrategy's CUDA-only check; run DDP's environment setup.
        return DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if self._on_cuda:
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        skip_shm_comm_op()
        self._init_deepspeed_distributed()
        cache_cpu_device_count()

    def _device_rank(self) -> int:
        index = self.root_device.index
        return self.local_rank if index is None else index

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        # Lightning has already divided the loss by accumulate_grad_batches; DeepSpeed's engine
        # would divide it again by gradient_accumulation_steps (the same number: Lightning sets
        # it), leaving gradients k times too small (Lightning #6170). The grad_scale check
        # (src/callbacks/grad_scale.py) verifies the scale at the start of every run.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @property
    def wall_clock_breakdown(self) -> bool:
        """DeepSpeed's wall-clock timers are on (wall_clock_breakdown, or the flops profiler)."""
        config = self.config or {}
        return bool(config.get("wall_clock_breakdown")) or bool((config.get("flops_profiler") or {}).get("enabled"))

    def _format_config(self) -> None:
        filled = resolve_auto_values(self.config, self.lightning_module, source=self._ds_config_source)
        if filled and self.is_global_zero:
            name = os.path.basename(self._ds_config_source or "deepspeed config")
            log.info("ds_config %s: filled \"auto\" from the run: %s", name, ", ".join(filled))
        if self._asks_activation_checkpointing:
            enable_activation_checkpointing(self.config, self.lightning_module, self.is_global_zero)
        super()._format_config()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        if optimizer is None and lr_scheduler is None and "scheduler" not in self.config:
            # a JSON optimizer without a JSON scheduler: the project's schedule drives it (as HF
            # Trainer does); DeepSpeed calls this with the optimizer it built
            lr_scheduler = getattr(self.lightning_module, "lr_scheduler_for", None)
        self.check_params(model)
        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        with EngineLayout(model) as layout:  # 0-dim / non-contiguous parameters through DeepSpeed's start-up
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self._device_rank()),
                config=self.config,
                model=model,
                model_parameters=model_parameters,
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            layout.settle(engine)
        guard_reentrant_forward(engine)
        if self.is_global_zero:
            report_comm_setting(f"deepspeed zero{self.config.get('zero_optimization', {}).get('stage', 0)}",
                                ds_comm_setting(self.config), self.world_size, self._get_process_group_backend())
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model) -> None:
        self.check_params(model)
        if self._on_cuda:
            with EngineLayout(model) as layout:
                super()._initialize_deepspeed_inference(model)
                layout.settle(self.model)
            guard_reentrant_forward(self.model)
            return None
        # Lightning's version with device_rank set (root_device.index is None on CPU).
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config["zero_allow_untested_optimizer"]
            inference_config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        with EngineLayout(model) as layout:
            self.model, _, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self._device_rank()),
                config=inference_config,
                model=model,
                optimizer=None,
                lr_scheduler=None,
                model_parameters=[],
                dist_init_required=False,
            )
            layout.settle(self.model)
        guard_reentrant_forward(self.model)
        return None


def guard_reentrant_forward(engine: Any) -> None:
    """Make DeepSpeed's forward timers safe for Lightning's re-entrant forward.

    Lightning runs ``training_step``/``validation_step`` *as* the engine's module forward, and a
    step that calls ``self(x)`` enters the same module again, so DeepSpeed's forward pre-hook runs
    twice and its timers (on with wall_clock_breakdown or the flops profiler) fail with "fwd_microstep
    timer has already been started". Only the outermost forward now starts and stops them.
    """
    if not engine.wall_clock_breakdown():
        return  # timers off: leave the engine exactly as DeepSpeed built it
    prologue, epilogue = engine._forward_prologue, engine._forward_epilogue
    depth = [0]

    def outer_prologue(inputs: Any, kwargs: Any) -> Any:
        depth[0] += 1
        return prologue(inputs, kwargs) if depth[0] == 1 else None

    def outer_epilogue() -> None:
        depth[0] -= 1
        if depth[0] == 0:
            epilogue()

    engine._forward_prologue, engine._forward_epilogue = outer_prologue, outer_epilogue


def enable_activation_checkpointing(config: dict, module: Any, is_global_zero: bool) -> None:
    """A ds_config's "activation_checkpointing" section asks for activation checkpointing; under
    Lightning DeepSpeed only configures its own checkpoint function, which HF models never call.
    Turn on the model's gradient checkpointing instead (recompute in backward, same math), non-reentrant,
    through models/grad_ckpt.py so the grad_checkpointing check sees which blocks and which mode. A net
    that ``model.gradient_checkpointing`` already checkpoints keeps the user's mode."""
    if not isinstance((config or {}).get("activation_checkpointing"), dict) or module is None:
        return
    from dsdebug.models.grad_ckpt import checkpointed_blocks, enable_gradient_checkpointing

    net = getattr(module, "net", module)
    done = checkpointed_blocks(net)
    if done:
        if is_global_zero:
            modes = sorted({mode for _, mode in done.values()})
            log.info("ds_config activation_checkpointing: %d blocks of %s are checkpointed already "
                     "(model.gradient_checkpointing=%s): kept", len(done), type(net).__name__, "/".join(modes))
        return
    try:
        names = enable_gradient_checkpointing(net, "non_reentrant")
    except ConfigError:
        names = []
    if not is_global_zero:
        return
    if names:
        log.info("ds_config activation_checkpointing: gradient checkpointing on for %d blocks of %s (non-reentrant; "
                 "activations are recomputed in backward: less memory, about a third more compute)", len(names),
                 type(net).__name__)
    else:
        log.warning("ds_config activation_checkpointing is ignored: %s has no gradient checkpointing "
                    "(gradient_checkpointing_enable) and no nn.ModuleList of blocks; call "
                    "deepspeed.checkpointing.checkpoint in its forward", type(net).__name__)


def cache_cpu_device_count() -> None:
    """DeepSpeed's CPU accelerator answers ``device_count()`` by running ``numactl --hardware`` in a
    subprocess, and ZeRO-3 asks at every gradient reduction: a fork+exec per step, and each
    subprocess start resets Python's warning registry (``os.get_exec_path`` enters
    ``warnings.catch_warnings``), so every third-party warning printed again at every step on
    every rank. The answer cannot change while the process runs: ask once, keep it."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not hasattr(accelerator, "_dsdebug_device_count"):
        count = accelerator.device_count()
        accelerator._dsdebug_device_count = count
        accelerator.device_count = lambda: count
