"""`CausalLMModule`: next-token training for ANY network given as ``net``.

``net`` is any ``nn.Module`` whose forward takes ``input_ids`` and returns logits
``[B, T, V]`` or an object with ``.logits`` (every HF causal LM does). Users plug their own
network in with ``model.net._target_=my_pkg.MyNet``.

Skip policy: a debug check with ``on_error=skip`` sets ``skip_optimizer_step``; this module then
asks the strategy to drop that step's update (weights, optimizer moments and loss scale unchanged;
the step counter and LR schedule advance), at the last point before it. How is the strategy's
business (``skip_update``: src/trainer/skip_step.py, DeepSpeed's overflow path for ZeRO and BF16);
a strategy without one and without an engine of its own gets its gradients dropped.

MoE load balancing (``src/models/moe_balance.py``): ``moe_aux_loss_coef`` is ``auto`` (default:
the model's own ``router_aux_loss_coef`` for HF MoE models that compute their own loss -- Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE --, else 0.01 for the project's loss, used for DeepSeek V2/V3), a
number >= 0 (replaces the coefficient; 0 = no balancing). Exactly one aux term is back-propagated.
``moe_metrics`` (default true) logs the ``moe/*`` keys whenever the net has routers, also at
coefficient 0; coefficient 0 with ``moe_metrics=false`` adds no hooks at all.

Document rows (``data.packing`` / ``data.token_budget``: the batch carries ``doc_ids``): ``net_inputs`` adds
``position_ids`` and the 4-D document mask; the training loss is the mean over every rank's counted tokens
(one all-reduce per step); ``data.token_budget_lr`` scales each update's LR by the step's tokens.

``gradient_checkpointing``: false (default) | true (= non_reentrant) | reentrant | non_reentrant --
recompute each block's activations in backward (``src/models/grad_ckpt.py``; the
``grad_checkpointing`` check verifies it).

Logged metrics:

| key | meaning |
|---|---|
| ``train/loss`` | next-token cross-entropy (without the MoE aux term) |
| ``train/aux_loss`` | MoE load-balancing loss, if the net is MoE: the model's own (HF ``load_balancing_loss_func``: ``top_k`` = balanced) or the project's (1.0 = balanced) |
| ``train/loss_total`` | what is back-propagated: loss + coef * aux_loss |
| ``moe/load_imbalance`` | busiest expert's share x num_experts, max over MoE layers (1 = balanced, E/k = collapsed) |
| ``moe/load/L<i>/E<e>`` | share of routed tokens of expert e in decoder layer i (logged at log_every_n_steps) |
| ``train/lr_scale`` | ``data.token_budget_lr`` linear or sqrt: the factor on the scheduled LR of this step (its tokens / the reference, or its square root) |
| ``val/loss`` | validation cross-entropy, mean over ranks; also recorded at step 0 (sanity check) and after the last step |
| ``val/ppl`` | exp(val/loss) |
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, Callable

import lightning as L
import torch

from dsdebug.errors import ConfigError
from dsdebug.models.document_mask import document_mask
from dsdebug.models.compile_blocks import compile_blocks
from dsdebug.models.grad_ckpt import checkpointing_mode, enable_gradient_checkpointing
from dsdebug.models.kernel_options import cross_entropy_mode
from dsdebug.models.lm_loss import IGNORE_INDEX, next_token_loss
from dsdebug.models.moe_balance import MoEBalance, MoEStep
from dsdebug.models.optim import param_groups, warmup_clamped, warmup_length

__all__ = ["CausalLMModule"]

log = logging.getLogger(__name__)


class CausalLMModule(L.LightningModule):
    #: the loss shifts labels itself (labels == input_ids); read by data_inspector's label check
    shifts_labels = True

    def __init__(
        self,
        net: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        moe_aux_loss_coef: float | str = "auto",
        moe_metrics: bool = True,
        gradient_checkpointing: bool | str = False,
        adapter: Any = None,
        compile: bool = False,
        cross_entropy: str = "full",
    ) -> None:
        super().__init__()
        self.net = net
        # false | true (= non_reentrant) | reentrant | non_reentrant: src/models/grad_ckpt.py
        self.checkpointed_blocks = enable_gradient_checkpointing(net, gradient_checkpointing)
        if self.checkpointed_blocks:
            log.info("gradient checkpointing (%s): %d blocks (%s ... %s)", checkpointing_mode(gradient_checkpointing),
                     len(self.checkpointed_blocks), self.checkpointed_blocks[0], self.checkpointed_blocks[-1])
        # LoRA/QLoRA (+model/adapter=lora, src/models/adapter.py): the base frozen, the adapters train;
        # `net` stays the base for MoEBalance (it reads the HF class), its modules are the same objects
        self.adapter = adapter
        if adapter is not None:
            self.net = adapter.apply(net)
        # kernel switches (src/models/kernel_options.py): the loss's implementation; torch.compile per block, last,
        # so it compiles the blocks as checkpointing and the adapter left them
        self.cross_entropy = cross_entropy_mode(cross_entropy)
        self.compiled_blocks = compile_blocks(self.net, compile)
        if self.compiled_blocks:
            log.info("model.compile: torch.compile of %d blocks (%s ... %s); the first step compiles",
                     len(self.compiled_blocks), self.compiled_blocks[0], self.compiled_blocks[-1])
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer", "scheduler", "adapter"])
        self.moe = MoEBalance(net, moe_aux_loss_coef, moe_metrics)
        self.moe_aux_loss_coef = self.moe.coef  # resolved: "auto" -> the model's own or 0.01
        self.val_loss_at_start: float | None = None
        self._val_losses: list[torch.Tensor] = []
        self.skip_optimizer_step = False  # set by a check with on_error=skip (src/callbacks/base.py)
        # document rows (data.packing / data.token_budget): what the net's forward takes, the tokens of the
        # optimizer step being accumulated (all ranks), the last step's, and the LR rule (token budget)
        self._takes: frozenset[str] | None = None
        self._global_loss: torch.Tensor | None = None
        self.step_tokens = 0
        self._micro_tokens = 0  # this micro-batch's tokens, counted into step_tokens after its backward
        self.last_step_tokens: int | None = None
        self.last_lr_scale: float | None = None
        self._skip_undo: Callable[[], None] | None = None

    @property
    def intended_frozen(self) -> frozenset[str]:
        """Parameters frozen on purpose (the adapter's base), as ``named_parameters`` names them:
        freeze_verify holds them to not moving instead of reporting them frozen by model code."""
        if self.adapter is None:
            return frozenset()
        return frozenset(f"net.{n}" for n in self.adapter.intended_frozen)

    # ---- forward / loss -------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.net(input_ids=input_ids)
        return out.logits if hasattr(out, "logits") else out

    def net_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the net is called with. Document rows (``data.packing``/``data.token_budget``: the batch
        has ``doc_ids``) add ``position_ids`` (restarting per document) and the 4-D document mask (causal
        within a document only), each only if the net's forward takes it (said once in the log; the
        packing check's probe measures whether documents still see each other)."""
        inputs = {"input_ids": batch["input_ids"]}
        if "doc_ids" not in batch:
            return inputs
        takes = self._net_takes()
        if "position_ids" in takes:
            inputs["position_ids"] = batch["position_ids"]
        if "attention_mask" in takes:
            inputs["attention_mask"] = document_mask(batch["doc_ids"])
        return inputs

    def _net_takes(self) -> frozenset[str]:
        if self._takes is None:
            params = inspect.signature(self.net.forward).parameters.values()
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
                self._takes = frozenset({"position_ids", "attention_mask"})
            else:
                self._takes = frozenset({"position_ids", "attention_mask"} & {p.name for p in params})
            missing = sorted({"position_ids", "attention_mask"} - self._takes)
            if missing:
                log.warning("document rows: %s.forward takes no %s; documents stay apart only if the net mixes no "
                            "tokens across positions (the packing check's probe measures it)",
                            type(self.net).__name__, " / ".join(missing))
        return self._takes

    def _losses(self, batch: dict[str, torch.Tensor], training: bool = False) -> tuple[torch.Tensor, MoEStep | None]:
        input_ids = batch["input_ids"]
        labels = batch.get("labels", input_ids)
        # no labels to the net: HF MoE models would add their own coef * aux to out.loss
        out = self.net(**self.net_inputs(batch), **self.moe.forward_kwargs(training))
        logits = out.logits if hasattr(out, "logits") else out
        moe = self.moe.measure(out, training)
        # next-token prediction: position t predicts token t+1; fp32 softmax (model.cross_entropy: lm_loss.py)
        if training and "doc_ids" in batch:
            total = next_token_loss(logits, labels, self.cross_entropy, reduction="sum")
            counted = (labels[:, 1:] != IGNORE_INDEX).sum()
            return self._global_token_mean(total, counted, batch["doc_ids"]), moe
        return next_token_loss(logits, labels, self.cross_entropy), moe

    def _global_token_mean(self, total: torch.Tensor, counted: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """Document rows carry a different number of counted tokens on each rank (padding, token budget):
        the step's loss is (sum of token losses) / (tokens counted on ALL ranks), not a mean of the ranks'
        means. EVERY rank, every training step: ONE all-reduce of 3 numbers (sum, counted, non-padding).
        The gradient averaging over ranks (DDP, DeepSpeed) divides by the world size: x world undoes it.
        Logged train/loss: the global mean. With accumulation (Lightning's or DeepSpeed's) each micro-batch is
        its own global mean and the k micro-batches are averaged: a micro-batch with fewer tokens weighs more
        per token (the exact step mean would need every micro-batch's count before the first backward)."""
        local = torch.stack([total.detach(), counted.to(total.dtype), (doc_ids >= 0).sum().to(total.dtype)])
        world = self.trainer.world_size if self._trainer is not None else 1
        glob = self.trainer.strategy.reduce(local, reduce_op="sum") if world > 1 else local
        self._micro_tokens = int(glob[2])  # set, not added: a check's replayed forward must not count twice
        self._global_loss = glob[0] / glob[1].clamp(min=1)
        return total * world / glob[1].clamp(min=1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, moe = self._losses(batch, training=True)
        aux = moe.aux if moe is not None else None
        total = loss if aux is None or self.moe.coef <= 0 else loss + self.moe.coef * aux.to(loss.device)
        shown = self._global_loss if "doc_ids" in batch else loss.detach()  # document rows: the global mean
        self.log("train/loss", shown, on_step=True, prog_bar=True)
        # the logged train/loss of this step, for the checks (trainer.callback_metrics would make Lightning read
        # every progress-bar metric on the host: a device sync per access on a GPU)
        self.last_train_loss = shown
        if aux is not None:
            self.log("train/aux_loss", aux.detach(), on_step=True)
            # document rows: `loss` is this rank's share x world (see _global_token_mean), not a loss
            shown_total = shown + self.moe.coef * aux.detach().to(shown.device) if "doc_ids" in batch else total.detach()
            self.log("train/loss_total", shown_total, on_step=True)
        if moe is not None and moe.load is not None:
            self.log("moe/load_imbalance", moe.imbalance, on_step=True)
            if self._logs_this_step():  # per decoder layer and expert, for the report's heatmap
                self.log_dict({f"moe/load/L{layer}/E{e}": share for layer, row in zip(moe.layers, moe.load.tolist())
                               for e, share in enumerate(row)}, on_step=True)
        return total

    def _logs_this_step(self) -> bool:
        trainer = self._trainer
        return trainer is not None and bool(getattr(trainer._logger_connector, "should_update_logs", False))

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, _ = self._losses(batch, training=False)
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

    # ---- skip policy: drop this step's update when a check asked for it --------------
    def on_after_backward(self) -> None:
        # a micro-batch that trains has a backward; a check's replayed forward (reproducibility) has none
        self.step_tokens += self._micro_tokens
        self._micro_tokens = 0

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # Lightning calls this after every callback's on_before_optimizer_step and before
        # clipping and the update (inside optimizer.step): the last point where a skip can act.
        pending = self.__dict__.pop("_pending_lr_scale", None)
        if pending is not None:
            pending.apply()  # data.token_budget_lr: this step's tokens are counted by now
        if self.skip_optimizer_step and self._skip_undo is None:
            self._skip_undo = _arm_skip(self.trainer, optimizer)  # None: not at DeepSpeed's boundary yet

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        # DeepSpeed accumulates inside its engine: Lightning calls this every micro-batch, the update
        # happens at the boundary only; the step's tokens add up until then
        boundary = _at_update(self._trainer)
        scaled = self._scale_lr_for_tokens(optimizer) if boundary else []  # the tokens are counted in the closure
        try:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        finally:
            for group, lr in scaled:
                group["lr"] = lr  # the schedule's value back: the rule scales one step, never the schedule
            if self.step_tokens and boundary:
                self.last_step_tokens, self.step_tokens = self.step_tokens, 0
            if self._skip_undo is not None:
                undo, self._skip_undo = self._skip_undo, None
                undo()
                self.skip_optimizer_step = False

    def _scale_lr_for_tokens(self, optimizer: Any) -> list[tuple[dict, float]]:
        """data.token_budget_lr=linear|sqrt: wrap the closure so that, once this step's forward/backward
        have counted its tokens (all ranks), every group's LR is scaled by lr_for_tokens before the
        update. Returns the (group, scheduled lr) pairs to put back."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if getattr(dm, "token_budget_lr", "none") == "none" or not hasattr(dm, "lr_scale_for"):
            return []
        return _TokenLRScale(self, optimizer, dm.lr_scale_for).groups

    # ---- optimizers -----------------------------------------------------------------
    def configure_model(self) -> None:
        """After every ``setup`` hook (a callback or user code may have frozen parameters), before the strategy
        wraps the net: a net with nothing to train is refused here, every rank alike, in one line (DDP raised
        "DistributedDataParallel is not needed ...", DeepSpeed's ZeRO an IndexError)."""
        if not any(p.requires_grad for p in self.net.parameters()):
            n = sum(1 for _ in self.net.parameters())
            raise ConfigError(f"model.net: none of its {n} parameters requires grad, so there is nothing to train "
                              "(something froze them all: a callback, a setup hook, a loaded adapter config); valid: "
                              "leave at least one trainable (callbacks.freeze_verify.train_only=[<regex>] says which), "
                              "or +model/adapter=lora to train adapters on a frozen base")

    def configure_optimizers(self) -> Any:
        groups = param_groups(self.net.named_parameters())
        optimizer = self.optimizer_factory(groups)
        if getattr(self.trainer.strategy, "offloads_optimizer", False):
            optimizer = _as_cpu_adam(optimizer, groups)
        scheduler = self.lr_scheduler_for(optimizer)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_for(self, optimizer: torch.optim.Optimizer) -> Any:
        """The project's schedule (optim.scheduler) over the run's optimizer steps, None without one.
        The DeepSpeed strategy also hands it an optimizer that a ds_config.json built."""
        if self.scheduler_factory is None:
            return None
        total = self.trainer.estimated_stepping_batches
        total = int(total) if math.isfinite(total) else 1000
        self._say_warmup_clamped(total)
        return self.scheduler_factory(optimizer, total_steps=total)

    def _say_warmup_clamped(self, total: int) -> None:
        """A warmup_steps longer than the run is shortened to fit (``warmup_length``): a warning naming the key,
        once per run (rank 0), never a silent change of the user's value."""
        keywords = getattr(self.scheduler_factory, "keywords", None) or {}
        text = warmup_clamped(total, keywords.get("warmup_steps"))
        if text is None or getattr(self, "_warned_warmup", None) == text:
            return
        self._warned_warmup = text
        log.warning(text)
        if self.trainer.global_rank == 0:
            from dsdebug.findings import Finding, get_channel

            get_channel().report(Finding(
                "config", "warning", "value_adjusted", text,
                "set optim.scheduler.warmup_steps below trainer.max_steps (or use optim.scheduler.warmup_ratio, a "
                "share of the run)", details={"key": "optim.scheduler.warmup_steps",
                                              "asked": int(keywords["warmup_steps"]),
                                              "used": warmup_length(total, 0.0, keywords["warmup_steps"])}))


class _TokenLRScale:
    """Scales each param group's LR by the data's rule (``LMDataModule.lr_scale_for``) for one step. The
    tokens are counted in training_step, which runs inside the optimizer closure, so the scaling happens
    in a hook on the LightningModule's ``on_before_optimizer_step`` path: after backward, before the
    update (also at DeepSpeed's accumulation boundary)."""

    def __init__(self, module: CausalLMModule, optimizer: Any, scale_for: Callable[[int], float]) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        self.groups = [(g, g["lr"]) for g in inner.param_groups]
        self.module, self.scale_for = module, scale_for
        module._pending_lr_scale = self

    def apply(self) -> None:
        tokens = self.module.step_tokens
        if not tokens:
            return
        scale = self.scale_for(tokens)
        for group, lr in self.groups:
            group["lr"] = lr * scale
        self.module.last_lr_scale = scale
        self.module.log("train/lr_scale", scale, on_step=True)  # the LR actually used = the schedule's x this


def _at_update(trainer: Any) -> bool:
    """Whether this optimizer_step call updates the weights (False: a DeepSpeed micro-batch before its
    accumulation boundary). Local: no collective."""
    engine = getattr(getattr(trainer, "strategy", None), "deepspeed_engine", None) if trainer is not None else None
    return engine is None or bool(engine.is_gradient_accumulation_boundary())


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


def _arm_skip(trainer: Any, optimizer: Any) -> Callable[[], None] | None:
    """Make the coming update a no-op (see the module docstring). The strategy that knows its engine's
    internals does it (``skip_update``: trainer/skip_step.py, this framework's DDP and DeepSpeed strategies).
    Any other strategy without an engine of its own (Lightning's single-device/DDP): the gradients are
    dropped, so the torch optimizer leaves weights and state alone. Returns the undo for after the step;
    None = not at the accumulation boundary yet (the request waits for it)."""
    skip = getattr(trainer.strategy, "skip_update", None)
    if skip is not None:
        return skip(optimizer)
    if hasattr(trainer.strategy, "deepspeed_engine"):  # Lightning's own DeepSpeedStrategy: no verified way
        from dsdebug.findings import Finding, get_channel

        finding = Finding(check="optimizer_step", severity="error", code="skip_unsupported", step=trainer.global_step,
                          rank=None, message=f"a check asked to skip step {trainer.global_step}, but "
                          f"{type(trainer.strategy).__name__} cannot drop an update: it IS applied and the run stops",
                          advice="use dsdebug.trainer.strategy.DebugDeepSpeedStrategy (strategy=zero1|2|3), or "
                                 "on_error=stop")
        channel = get_channel()
        if trainer.global_rank == 0:
            channel.report(finding)
        channel.stop_request = channel.stop_request or finding
        trainer.should_stop = True
        return _noop
    log.warning("step %d: dropping this optimizer update (a check asked to skip it)", trainer.global_step)
    for group in optimizer.param_groups:  # torch optimizers leave parameters without .grad untouched
        for p in group["params"]:
            p.grad = None
    return _noop


def _noop() -> None:
    return None

