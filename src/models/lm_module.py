"""`CausalLMModule`: next-token training for ANY network given as ``net``.

``net`` is any ``nn.Module`` whose forward takes ``input_ids`` and returns logits
``[B, T, V]`` or an object with ``.logits`` (every HF causal LM does). Users plug their own
network in with ``model.net._target_=my_pkg.MyNet``.

Logged metrics:

| key | meaning |
|---|---|
| ``train/loss`` | next-token cross-entropy (without the MoE aux term) |
| ``train/aux_loss`` | MoE load-balancing loss (1.0 = perfectly balanced), if the net has routers |
| ``train/loss_total`` | what is back-propagated: loss + coef * aux_loss |
| ``moe/load_imbalance`` | busiest expert's share x num_experts (1 = balanced, E/k = collapsed) |
| ``val/loss`` | validation cross-entropy, mean over ranks; also recorded at step 0 (sanity check) |
| ``val/ppl`` | exp(val/loss) |
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F

from src.models.moe_aux import RouterCapture, expert_load_fractions, find_routers, load_balancing_loss
from src.trainer.optim import param_groups

log = logging.getLogger(__name__)


class CausalLMModule(L.LightningModule):
    def __init__(
        self,
        net: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        moe_aux_loss_coef: float = 0.01,
    ) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.moe_aux_loss_coef = float(moe_aux_loss_coef)
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer", "scheduler"])
        self.router_capture = _make_router_capture(net, self.moe_aux_loss_coef)
        self.val_loss_at_start: float | None = None
        self._val_losses: list[torch.Tensor] = []

    # ---- forward / loss -------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.net(input_ids=input_ids)
        return out.logits if hasattr(out, "logits") else out

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_ids = batch["input_ids"]
        labels = batch.get("labels", input_ids)
        logits, aux = self(input_ids), None
        if self.router_capture is not None:
            records = self.router_capture.collect()
            if records:
                experts, top_k = self.router_capture.num_experts, self.router_capture.top_k
                aux = load_balancing_loss(records, experts, top_k)
                # max expert share x E: 1.0 = perfectly balanced, E/k = collapsed
                self._load_imbalance = expert_load_fractions(records, experts).max() * experts
        # next-token prediction: position t predicts token t+1; fp32 softmax for stability
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)).float(),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
        )
        return loss, aux

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, aux = self._losses(batch)
        total = loss if aux is None else loss + self.moe_aux_loss_coef * aux
        self.log("train/loss", loss.detach(), on_step=True, prog_bar=True)
        if aux is not None:
            self.log("train/aux_loss", aux.detach(), on_step=True)
            self.log("train/loss_total", total.detach(), on_step=True)
            self.log("moe/load_imbalance", self._load_imbalance, on_step=True)
        return total

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, _ = self._losses(batch)
        self._val_losses.append(loss.detach())

    def on_validation_epoch_end(self) -> None:
        # every rank runs this (the reduce is a collective)
        local = torch.stack(self._val_losses).mean() if self._val_losses else torch.tensor(float("nan"))
        self._val_losses.clear()
        val_loss = self.trainer.strategy.reduce(local.to(self.device), reduce_op="mean")
        if self.trainer.sanity_checking:
            # Lightning drops metrics logged during the sanity check; keep the step-0 value.
            self.val_loss_at_start = float(val_loss)
            for logger in self.loggers:
                logger.log_metrics({"val/loss": float(val_loss)}, step=0)
            return
        # already reduced above; sync_dist only silences Lightning's epoch-level warning
        self.log("val/loss", val_loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(val_loss.clamp(max=20.0)), sync_dist=True)

    # ---- optimizers -----------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        groups = param_groups(self.net.named_parameters())
        optimizer = self.optimizer_factory(groups)
        if getattr(self.trainer.strategy, "offloads_optimizer", False):
            optimizer = _as_cpu_adam(optimizer, groups)
        if self.scheduler_factory is None:
            return optimizer
        total = self.trainer.estimated_stepping_batches
        total = int(total) if math.isfinite(total) else 1000
        scheduler = self.scheduler_factory(optimizer, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _as_cpu_adam(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """ZeRO-Offload needs DeepSpeedCPUAdam (DeepSpeed refuses a torch optimizer there)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if isinstance(optimizer, DeepSpeedCPUAdam):
        return optimizer
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(
            f"optimizer offload needs an Adam-family optimizer (got {type(optimizer).__name__}); "
            "use optim.optimizer._target_=torch.optim.AdamW or a strategy without offload"
        )
    d = optimizer.defaults
    log.info("optimizer offload: using DeepSpeedCPUAdam with the %s hyper-parameters", type(optimizer).__name__)
    return DeepSpeedCPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                            weight_decay=d["weight_decay"], adamw_mode=isinstance(optimizer, torch.optim.AdamW))


def _make_router_capture(net: torch.nn.Module, coef: float) -> RouterCapture | None:
    if coef <= 0:
        return None  # off means zero cost: no hooks
    if not find_routers(net):
        log.info("moe_aux_loss_coef=%s ignored: %s has no MoE routers", coef, type(net).__name__)
        return None
    return RouterCapture(net).attach()
