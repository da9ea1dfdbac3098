"""Parameter shapes and dtypes users write, and what each engine does with them.

DDP takes any tensor a module registers; DeepSpeed's engine assumes more. Measured with
DeepSpeed 0.19.8 and Lightning 2.6.6 on CPU (tests/trainer/test_param_shapes.py, docs/debugging.md
"Parameter shapes the engines choke on"):

| what the net registers | DDP | DeepSpeed ZeRO-1/2/3 as it comes | here |
|---|---|---|---|
| a 0-dim parameter (ReZero/LayerScale gate, ``nn.Parameter(torch.ones(()))``) | trains | ``RuntimeError: self.dim() cannot be 0 to view Float as Byte`` in the engine's start-up broadcast | held as shape [1] while the engine starts, 0-dim again to the net, the optimizer and checkpoints (`EngineLayout`) |
| a non-contiguous parameter (a transposed tensor made a Parameter) | trains | ``self.stride(-1) must be 1 to view Float as Byte`` in the same broadcast | made contiguous before the engine starts (same shape and values) |
| a parameter with no elements (``torch.empty(0)``) | trains | ZeRO-3: AssertionError at the first forward (it cannot gather it); ZeRO-1: trains, but the checkpoint's fp32 weights (zero_to_fp32) lose it; ZeRO-2: trains | refused under ZeRO-1 and ZeRO-3 (`refuse_unheld`) |
| a float64 or complex parameter among float32 ones | trains | every parameter is cast to the run's dtype (trainer.precision 32-true: float64 -> float32, complex -> float32 with the imaginary part dropped, a torch warning only) | refused |
| a parameter shared by two modules, a module called twice, a non-float buffer | trains | trains, the same values as DDP | nothing to do |
| a parameter forward never uses | stops at the next step (``find_unused_parameters: false``), a traceback | trains (AdamW still decays it: DeepSpeed gives it a zero gradient) | DDP: one line naming it (`unused_parameter_error`, from the strategy's ``on_exception``) |

ZeRO stage 0 (a ds_config.json) with gradient clipping in fp32 scales each gradient by a
shape-[1] factor in place, which a 0-dim gradient refuses: refused as well.

Rank awareness: everything here is local to a rank (no collective); each rank decides the same
from the same model and config.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

from dsdebug.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["EngineLayout", "refuse_unheld", "unused_parameter_error", "zero_stage"]


def zero_stage(config: dict | None) -> int:
    return int(((config or {}).get("zero_optimization") or {}).get("stage", 0) or 0)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _named_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Each parameter once (a tied one under its first name), as the checkpoint names it."""
    yield from module.named_parameters(remove_duplicate=True)


def refuse_unheld(module: torch.nn.Module, config: dict | None, precision: str | None,
                  gradient_clip_val: float | None = None) -> None:
    """Before DeepSpeed's engine starts: one ConfigError for the first parameter it cannot hold
    (no elements under ZeRO-1/3, float64 or complex, 0-dim under stage-0 fp32 gradient clipping),
    naming it with its shape and dtype, the strategy, and what works. ``gradient_clip_val``: the
    trainer's, which Lightning writes into the config as "gradient_clipping" only when the engine is set
    up (a ds_config.json's own value wins). Local, every rank."""
    stage = zero_stage(config)
    clip = (config or {}).get("gradient_clipping", gradient_clip_val)
    if isinstance(clip, str):  # an HF-style "auto": the trainer's value fills it in (config/ds_config.py)
        clip = gradient_clip_val
    clip = float(clip or 0.0)
    engine = f"DeepSpeed ZeRO-{stage}" if stage else "DeepSpeed (ZeRO stage 0)"
    for name, p in _named_parameters(module):
        what = f"parameter {name} (shape {_shape(p)}, {_dtype(p)})"
        if p.is_complex() or p.dtype == torch.float64:
            run_dtype = "float32" if precision in (None, "32", "32-true") else f"the dtype of trainer.precision={precision}"
            if p.is_complex():
                lost, instead = ("the imaginary part is dropped", "hold it as a real float32 tensor of shape "
                                 "[..., 2] (torch.view_as_complex inside forward)")
            else:
                lost, instead = "its float64 precision is lost", "keep it float32 (cast to float64 inside forward)"
            raise ConfigError(
                f"{what}: {engine} holds every parameter in the run's dtype, so it would train as {run_dtype} "
                f"and {lost}; valid: {instead}, or strategy=ddp")
        if p.numel() == 0 and stage in (1, 3):
            harm = ("cannot gather it and stops at the first forward" if stage == 3
                    else "leaves it out of the checkpoint's fp32 weights (zero_to_fp32), so a strict load of the "
                    "exported weights fails")
            raise ConfigError(
                f"{what} has no elements: {engine} {harm}; valid: register it as a buffer "
                f"(register_buffer) or leave it out, or strategy=zero2 or strategy=ddp")
        if p.ndim == 0 and stage == 0 and clip > 0 and not _low_precision(config):
            raise ConfigError(
                f"{what} is 0-dim: {engine}'s fp32 gradient clipping (gradient_clipping={clip:g}) multiplies each gradient by a shape-[1] factor in place, "
                f"which a 0-dim gradient refuses; valid: a ZeRO stage 1-3 (strategy=zero1|zero2|zero3), "
                f"trainer.gradient_clip_val=0, shape [1], or strategy=ddp")


def _low_precision(config: dict | None) -> bool:
    """fp16/bf16: DeepSpeed clips inside its own (flat) optimizer, not tensor by tensor."""
    return any(((config or {}).get(k) or {}).get("enabled") for k in ("fp16", "bf16", "amp"))


class EngineLayout:
    """What the net's parameters look like while ``deepspeed.initialize`` runs.

    DeepSpeed's start-up broadcast views every parameter as bytes (``p.data.view(torch.uint8)``),
    which a 0-dim or a non-contiguous tensor refuses. Inside ``with EngineLayout(module):`` a 0-dim
    parameter's data is the same storage seen as shape [1] and a non-contiguous one is a contiguous
    copy (same values). ``settle(engine)`` (right after initialize, still inside) gives each 0-dim
    parameter its shape back everywhere DeepSpeed recorded [1]: the parameter itself, ZeRO-1/2's
    per-parameter shape record (the flat buffer is re-viewed from it at every step) and ZeRO-3's
    ``ds_shape`` (every gather views to it; checkpoints write it as the shape). The storage DeepSpeed
    trains (flat buffers, partitions) is unchanged: one element either way. Leaving the block without
    ``settle`` (initialize raised) puts the 0-dim views back.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.scalars: list[tuple[str, torch.nn.Parameter]] = []
        self.strided: list[str] = []

    def __enter__(self) -> "EngineLayout":
        for name, p in _named_parameters(self.module):
            if hasattr(p, "ds_id"):  # already ZeRO-3 partitioned (built under zero.Init): not ours to reshape
                continue
            if p.ndim == 0:
                p.data = p.data.reshape(1)  # a view of the same element
                self.scalars.append((name, p))
            elif not p.is_contiguous():
                p.data = p.data.contiguous()
                self.strided.append(name)
        return self

    def settle(self, engine: Any) -> None:
        """After ``deepspeed.initialize``: every held parameter 0-dim again, also in DeepSpeed's records."""
        groups = getattr(engine.optimizer, "round_robin_bit16_groups", None)  # ZeRO-1/2
        metas = getattr(engine.optimizer, "round_robin_bit16_meta", None)
        for name, p in self.scalars:
            if hasattr(p, "ds_shape"):  # ZeRO-3: gathers view the full tensor as ds_shape
                p.ds_shape = torch.Size([])
            if groups is not None:
                for g, group in enumerate(groups):
                    for i, q in enumerate(group):
                        if q is p:
                            if metas is None:
                                raise RuntimeError(f"{name}: this DeepSpeed keeps no round_robin_bit16_meta; "
                                                   "param_layout.EngineLayout knows DeepSpeed 0.19's ZeRO-1/2 only")
                            metas[g][i] = metas[g][i].reshape(())
            self._as_scalar(p)
            shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
            if tuple(shape) != ():
                raise RuntimeError(f"{name} was not given back its 0-dim shape after deepspeed.initialize ({tuple(shape)})")
        self._report()
        self.scalars = []

    def __exit__(self, *exc: Any) -> None:
        for _, p in self.scalars:  # initialize raised: put the views back
            self._as_scalar(p)

    @staticmethod
    def _as_scalar(p: torch.nn.Parameter) -> None:
        if p.data.ndim == 1 and p.data.numel() == 1:  # a partitioned ZeRO-3 parameter holds no data here
            p.data = p.data.view(())

    def _report(self) -> None:
        parts = []
        if self.scalars:
            names = ", ".join(n for n, _ in self.scalars[:4]) + (", ..." if len(self.scalars) > 4 else "")
            parts.append(f"{len(self.scalars)} 0-dim parameter(s) ({names}) held as shape [1] while the DeepSpeed "
                         f"engine started; 0-dim to the model, the optimizer and checkpoints")
        if self.strided:
            names = ", ".join(self.strided[:4]) + (", ..." if len(self.strided) > 4 else "")
            parts.append(f"{len(self.strided)} non-contiguous parameter(s) ({names}) made contiguous (same values)")
        if parts:
            from lightning.pytorch.utilities.rank_zero import rank_zero_only

            if rank_zero_only.rank == 0:
                log.info("param layout: %s", "; ".join(parts))


def unused_parameter_error(message: str, module: torch.nn.Module) -> ConfigError | None:
    """DDP with ``find_unused_parameters=false`` and a parameter that got no gradient stops at the next
    step with torch's "Expected to have finished reduction in the prior iteration ... Parameter indices
    which did not receive grad for rank 0: 8 9" (Lightning replaces it by a generic hint): the same as one
    line naming the parameters. The indices count the trainable parameters in ``named_parameters`` order,
    as DDP's reducer does. None for any other error."""
    import re

    if "Expected to have finished reduction in the prior iteration" not in message:
        return None
    names: list[str] = []
    indices = re.search(r"Parameter indices which did not receive grad for rank \d+:\s*([\d\s]+)", message)
    named = re.search(r"Parameters which did not receive grad for rank \d+:\s*([^\n]+)", message)
    if indices:
        trainable = [n for n, p in _named_parameters(module) if p.requires_grad]
        names = [trainable[int(i)] if int(i) < len(trainable) else f"#{i}" for i in indices.group(1).split()]
    elif named:  # TORCH_DISTRIBUTED_DEBUG=DETAIL names them (without the wrapper's prefix)
        names = [n.strip() for n in named.group(1).split(",") if n.strip()]
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    return ConfigError(
        f"parameters got no gradient in a training step under strategy=ddp with strategy.find_unused_parameters=false: "
        f"{shown or 'not named by torch'}; DDP waits for every gradient, so the next step stops; valid: "
        f"strategy.find_unused_parameters=true, use them in forward, or freeze them (requires_grad=False)")
