"""The training step the doctor's probes drive (optimizer coverage, overfit one batch, checkpoint
round trip), two ways:

- ``TorchStepper``: a plain ``nn.Module`` + torch optimizer (+ scheduler, clipping), no Lightning;
- ``StrategyStepper``: the run's own Lightning strategy (DDP or DeepSpeed ZeRO 0-3): forward via
  ``strategy.training_step``, ``strategy.backward``, ``strategy.optimizer_step`` (clipping, the
  precision plugin, DeepSpeed's engine), then the run's LR scheduler, as a fit step does.

Rank rules (StrategyStepper): ``step``, ``snapshot``, ``save``, ``load`` and ``perturb`` are
COLLECTIVE under DDP/DeepSpeed (gradient reduction, ZeRO-3 gathers, checkpoint barriers): every
rank calls them in the same order. ``TorchStepper`` is local."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = ["StepInfo", "TorchStepper", "StrategyStepper", "saved_tensor_bytes"]


@dataclass
class StepInfo:
    loss: float
    grad_norm: float | None = None  # global, before clipping
    lr: float | None = None  # the LR this step used (first param group)
    grads: dict[str, float | None] = field(default_factory=dict)  # name -> max |grad| (None: no grad)


def _norm(values: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(v.float().pow(2).sum()) for v in values)) if values else 0.0


@contextmanager
def saved_tensor_bytes(out: list[int]) -> Iterator[None]:
    """Bytes autograd saves for backward inside the block (activations; unique storages), added to out[0]."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen and not isinstance(t, torch.nn.Parameter):
                seen.add(key)
                out[0] += storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _peak(optimizer: Any) -> None:
    """Each param group at its peak LR (``initial_lr``, which torch schedulers record)."""
    for group in optimizer.param_groups:
        group["lr"] = group.get("initial_lr", group["lr"])


class TorchStepper:
    """A plain training step: ``loss_fn(model, batch) -> loss``; clipping by global norm at ``clip``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor], scheduler: Any = None,
                 clip: float | None = None) -> None:
        self.model, self.optimizer, self.loss_fn, self.scheduler, self.clip = model, optimizer, loss_fn, scheduler, clip
        self.activation_bytes = [0]
        self.hold_peak_lr = False  # True: every step at each group's peak LR, the schedule paused (overfit)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.model.named_parameters())

    def owned(self) -> set[int]:
        return {id(p) for g in self.optimizer.param_groups for p in g["params"]}

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, batch: dict, grads: bool = False, measure: bool = False) -> StepInfo:
        self.model.train()
        if self.hold_peak_lr:
            _peak(self.optimizer)
        lr = self.lr()
        self.optimizer.zero_grad(set_to_none=True)
        if measure:
            with saved_tensor_bytes(self.activation_bytes):
                loss = self.loss_fn(self.model, batch)
        else:
            loss = self.loss_fn(self.model, batch)
        loss.backward()
        named = self.named_parameters()
        info = StepInfo(float(loss.detach()), _norm([p.grad for _, p in named if p.grad is not None]), lr)
        if grads:
            info.grads = {n: (float(p.grad.abs().max()) if p.grad is not None else None) for n, p in named}
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        if self.scheduler is not None and not self.hold_peak_lr:
            self.scheduler.step()
        return info

    @torch.no_grad()
    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def perturb(self, seed: int = 1) -> None:
        """Move every frozen parameter a little (trainable ones move by training)."""
        g = torch.Generator().manual_seed(seed)
        for _, p in self.model.named_parameters():
            if not p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g).to(p) * 1e-2)

    def save(self, path: str) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        torch.save(state, path)

    def load(self, path: str) -> None:
        state = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def gradient_clip(self) -> float | None:
        return self.clip

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds (one process: itself)."""
        return bool(flag)


class StrategyStepper:
    """The run's step through its Lightning strategy (see the module docstring). ``prefix`` is
    stripped from parameter names (the LightningModule's ``net.``)."""

    def __init__(self, trainer: Any, pl_module: Any, prefix: str = "net.") -> None:
        self.trainer, self.module, self.prefix = trainer, pl_module, prefix
        self.activation_bytes = [0]
        from dsdebug.models.model_states import layout_of

        self.layout, self.stage = layout_of(trainer.strategy)
        self.deepspeed = hasattr(trainer.strategy, "deepspeed_engine")
        self.steps = 0  # optimizer steps taken by the probes
        self.hold_peak_lr = False  # True: every step at each group's peak LR, the schedule paused (overfit)

    def _name(self, n: str) -> str:
        return n[len(self.prefix):] if self.prefix and n.startswith(self.prefix) else n

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(self._name(n), p) for n, p in self.module.named_parameters()]

    def owned(self) -> set[int]:
        """The parameters the optimizer updates: DeepSpeed's ZeRO optimizers keep the original
        parameters in ``bit16_groups`` (stage 1/2) or ``fp16_groups`` (stage 3)."""
        opt = self.trainer.optimizers[0]
        if self.deepspeed:
            opt = self.trainer.strategy.deepspeed_engine.optimizer
            for attr in ("bit16_groups", "fp16_groups"):
                groups = getattr(opt, attr, None)
                if groups:
                    return {id(p) for g in groups for p in g}
            opt = getattr(opt, "optimizer", opt) if not getattr(opt, "param_groups", None) else opt
        return {id(p) for g in opt.param_groups for p in g["params"]}

    def lr(self) -> float:
        return float(self.trainer.optimizers[0].param_groups[0]["lr"])

    def gradient_clip(self) -> float | None:
        if self.deepspeed:
            value = (self.trainer.strategy.config or {}).get("gradient_clipping")
            return float(value) if value else None
        value = self.trainer.gradient_clip_val
        return float(value) if value else None

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank. COLLECTIVE."""
        return bool(self.trainer.strategy.reduce_boolean_decision(bool(flag), all=True))

    @contextmanager
    def _quiet_logging(self) -> Iterator[None]:
        # self.log in training_step is refused outside the loop (on_fit_start): the probes' steps log nothing
        module = self.module
        saved = {k: module.__dict__.get(k) for k in ("log", "log_dict")}
        module.log = lambda *a, **k: None
        module.log_dict = lambda *a, **k: None
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    module.__dict__.pop(k, None)
                else:
                    module.__dict__[k] = v

    def step(self, batch: dict, grads: bool = False, measure: bool = False) -> StepInfo:
        """One optimizer step on ``batch``. COLLECTIVE (every rank, same order). Under DeepSpeed with
        gradient accumulation the engine updates at its accumulation boundary only: the step is that
        many micro-steps on ``batch`` (as the fit loop calls ``engine.step()`` after every micro-batch)."""
        strategy = self.trainer.strategy
        optimizer = self.trainer.optimizers[0]
        self.module.train()
        if self.hold_peak_lr:
            _peak(optimizer)
        lr = self.lr()
        batch = strategy.batch_to_device(batch)
        micro = int(strategy.deepspeed_engine.gradient_accumulation_steps()) if self.deepspeed else 1
        with self._quiet_logging():
            for m in range(micro):
                if measure and m == 0:
                    with saved_tensor_bytes(self.activation_bytes):
                        out = strategy.training_step(batch, 0)
                else:
                    out = strategy.training_step(batch, 0)
                loss = out["loss"] if isinstance(out, dict) else out
                strategy.backward(loss, optimizer)
                if m == micro - 1:  # the gradients are complete (DeepSpeed: at its boundary)
                    info = StepInfo(float(loss.detach()), lr=lr)
                    if grads or not self.deepspeed:
                        info.grads = self._grads() if grads else {}  # COLLECTIVE under DeepSpeed
                        if not self.deepspeed:
                            info.grad_norm = _norm([p.grad for _, p in self.module.named_parameters()
                                                    if p.grad is not None])
                strategy.optimizer_step(optimizer, closure=lambda loss=loss: loss)
        if self.deepspeed:
            norm = strategy.deepspeed_engine.get_global_grad_norm()
            info.grad_norm = float(norm) if norm is not None else None
        else:
            optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        total = self.trainer.estimated_stepping_batches
        if self.steps < total and not self.hold_peak_lr:  # a run never steps its schedule past its end
            for config in self.trainer.lr_scheduler_configs:
                if config.interval == "step":
                    config.scheduler.step()
        return info

    def _grads(self) -> dict[str, float | None]:
        """name -> max |full gradient| (None: no gradient). COLLECTIVE under DeepSpeed
        (``safe_get_full_grad`` reduces/gathers): every rank, every parameter, same order."""
        out: dict[str, float | None] = {}
        if self.deepspeed:
            from deepspeed.utils import safe_get_full_grad

            for n, p in self.named_parameters():
                g = safe_get_full_grad(p) if p.requires_grad else None
                out[n] = float(g.abs().max()) if g is not None else None
            return out
        for n, p in self.named_parameters():
            out[n] = float(p.grad.abs().max()) if p.grad is not None else None
        return out

    @contextmanager
    def _gathered(self, params: list, modify: bool = False) -> Iterator[None]:
        if self.stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
                yield
        else:
            yield

    @torch.no_grad()
    def snapshot(self) -> dict[str, torch.Tensor]:
        """Every parameter, full (ZeRO-3: gathered). COLLECTIVE under ZeRO-3."""
        named = self.named_parameters()
        with self._gathered([p for _, p in named]):
            return {n: p.detach().float().clone() for n, p in named}

    @torch.no_grad()
    def perturb(self, seed: int = 1) -> None:
        """Move every frozen parameter a little, alike on every rank (trainable ones move by training).
        COLLECTIVE under ZeRO-3."""
        g = torch.Generator().manual_seed(seed)
        frozen = [p for _, p in self.named_parameters() if not p.requires_grad]
        with self._gathered(frozen, modify=True):
            for p in frozen:
                noise = torch.randn(p.shape, generator=g).to(p)
                if self.stage != 3 or self.trainer.global_rank == 0:
                    p.add_(noise * 1e-2)

    def save(self, path: str) -> None:
        self.trainer.save_checkpoint(path)  # COLLECTIVE

    def load(self, path: str) -> None:
        connector = self.trainer._checkpoint_connector  # the same path a resume takes
        connector.resume_start(path)
        connector.restore_model()
        connector.restore_optimizers_and_schedulers()
        connector.resume_end()
