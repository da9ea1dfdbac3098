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

Both strategies launch child ranks with `HydraAwareLauncher` (see launcher.py).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.fabric.utilities.seed import reset_seed

from src.trainer.ds_config import load_ds_config, resolve_auto_values
from src.trainer.launcher import HydraLauncherMixin

log = logging.getLogger(__name__)


class DebugDDPStrategy(HydraLauncherMixin, DDPStrategy):
    """Lightning's DDP with Hydra-aware child launching."""


class DebugDeepSpeedStrategy(HydraLauncherMixin, DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy on CUDA, and on CPU through DeepSpeed's CPU accelerator.

    ``config`` may be a dict or a path to a user's ds_config.json, passed through verbatim
    except that HF-style ``"auto"`` values are resolved from the trainer/model at setup.
    """

    def __init__(self, config: str | dict | None = None, **kwargs: Any) -> None:
        self._ds_config_source = config if isinstance(config, str) else None
        if isinstance(config, str):
            config = load_ds_config(config)
        super().__init__(config=config, **kwargs)

    @property
    def _on_cuda(self) -> bool:
        return self.root_device.type == "cuda"

    @property
    def offloads_optimizer(self) -> bool:
        zero = (self.config or {}).get("zero_optimization", {})
        return (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")

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
        self._init_deepspeed_distributed()

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

    def _format_config(self) -> None:
        resolve_auto_values(self.config, self.lightning_module, source=self._ds_config_source)
        super()._format_config()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model) -> None:
        if self._on_cuda:
            return super()._initialize_deepspeed_inference(model)
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
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
        return None
