"""`GradCheckpointing`: gradient checkpointing that silently stops training, or changes the maths.

The config example and the table of metrics and findings: the class docstring (`GradCheckpointing`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, ClassVar

import torch

from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_checkpointing.saved_bytes import SavedBytes
from dsdebug.config.args import Rule, boolean, integer
from dsdebug.models.grad_ckpt import checkpointed_blocks, checkpointing_suspended
from dsdebug.models.moe_aux import find_routers

__all__ = ["GradCheckpointing"]
log = logging.getLogger(__name__)
MB = 1e6


class GradCheckpointing(DebugCallback):
    """`GradCheckpointing`: gradient checkpointing that silently stops training, or changes the maths.

    ``model.gradient_checkpointing`` (src/models/grad_ckpt.py) recomputes each block's forward in
    backward. Two ways it goes wrong without an error:

    - **reentrant checkpointing, inputs without grad**: torch's reentrant checkpoint gives a gradient
      only through inputs that require grad. When none of a checkpointed block's tensor inputs does
      (frozen embeddings: adapters/LoRA, a frozen vocabulary), the block and every block after it get
      NO gradient -- torch only warns once ("None of the inputs have requires_grad=True"). Detected
      where it happens: a forward pre-hook on every checkpointed block reads its inputs' ``requires_grad``.
      (Hugging Face models make the embedding output require grad when checkpointing is turned on,
      transformers >= 5; a net of your own does not.)
    - **reentrant checkpointing and the MoE balancing loss**: the module's load-balancing loss is built
      from router outputs captured in the forward, which the reentrant checkpoint runs under no_grad:
      the loss is a constant, the routers are not balanced (measured: the loss curve moved from step 1).
      Reported at setup when reentrant blocks hold routers and ``model.moe_aux_loss_coef`` > 0.
    - **routing that differs in the recompute**: an MoE router with state or randomness the recompute
      does not replay (a balancing bias/EMA updated inside forward, jitter noise drawn outside the
      checkpoint's RNG replay, capacity drop depending on call order) chooses other experts in
      backward than in forward: the gradients belong to another computation. Forward hooks on the
      routers inside checkpointed blocks record the chosen experts in the forward and in the
      recompute (between ``on_before_backward`` and ``on_after_backward``) and compare them per token.

    It also measures what checkpointing saves, on the first micro-batch of each rank: the bytes of
    activations kept for backward (``saved_tensors_hooks``, one count per storage, weights excluded;
    on CPU and GPU alike) with checkpointing -- what the step really kept, plus each block's input --
    against without -- each block's forward run once more without checkpointing on the same input,
    under a forked RNG and with the block's module hooks detached (so nothing records it and training
    is unchanged: the loss curve is bitwise the one without the check); rank 0 reports it. Not under ZeRO-3: the second
    forward needs ZeRO-3's gathering hooks, and running them outside the step broke its backward (a
    size-0 weight, measured); the activations are the same under ddp or ZeRO-1/2, so measure there. Hooks live for ``check_steps``
    micro-batches, then are removed. No collective: every rank judges its own batches.

    Example::

        python train.py model.gradient_checkpointing=reentrant +callbacks=grad_checkpointing \\
            trainer=ddp_sim strategy=zero3

    It logs no metrics.

    | finding code | severity | meaning |
    |---|---|---|
    | ``checkpointing_off`` | info | the model has no checkpointed block: nothing to check (no hooks added) |
    | ``reentrant_no_input_grad`` | error | reentrant checkpointing and no input of the named blocks requires grad: they get no gradient |
    | ``reentrant_aux_loss_no_grad`` | error | reentrant checkpointing of MoE blocks while the module trains a load-balancing loss: it gets no gradient |
    | ``routing_recompute_mismatch`` | error | the named router chose other experts in the recompute than in the forward (share of tokens) |
    | ``activation_memory`` | info | bytes kept for backward on one micro-batch with vs without checkpointing, and the saving (ZeRO-3: not measured, says so) |

    Resume: nothing is carried over (``state_attrs`` is empty): each fit checks its own first micro-batches.
    """
    name = "grad_checkpointing"
    state_attrs = ()

    # each rank judges its own tokens' routes: a skip or stop decided on one rank alone would leave the
    # others in the step's collectives (a hang), so the findings warn and name the rank
    policies = ("warn",)
    policy_note = "skip and stop would be decided on one rank alone"

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "check_steps": integer(1),
        "routing": boolean(),
        "memory": boolean(),
    }

    def __init__(self, check_steps: int = 3, routing: bool = True, memory: bool = True, on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(check_steps=check_steps, routing=routing, memory=memory)
        self.check_steps, self.routing, self.memory = check_steps, routing, memory
        self._handles: list[Any] = []
        self._phase: str | None = None  # "forward" | "backward" | None (validation, outside training steps)
        self._seen = 0
        self._reported: set[str] = set()

    # ---- setup: every rank ---------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._remove_hooks()
        self._seen, self._phase, self._reported = 0, None, set()
        net = getattr(pl_module, "net", pl_module)
        self._blocks = checkpointed_blocks(net)
        if not self._blocks:
            self.report_capped(trainer, "info", "checkpointing_off", "the model has no checkpointed block: nothing to "
                               "check", "turn it on with model.gradient_checkpointing=true|reentrant|non_reentrant")
            return
        self._no_grad_blocks: dict[str, int] = {}
        self._routes: dict[str, dict[str, list[torch.Tensor]]] = {}
        self._measure: dict[str, Any] | None = None
        self._suspended = False
        # ZeRO-3: the measurement's second forward needs ZeRO-3's parameter-gathering hooks (detached, nothing is
        # gathered), and with them its backward met a still-partitioned weight (a size-0 matmul in DeepSpeed's
        # LinearFunctionForZeroStage3; CPU, DeepSpeed 0.19.8): no measurement there
        self._partitioned = bool(getattr(trainer.strategy, "zero_stage_3", False))
        if self.memory and self._partitioned:
            self.report_capped(trainer, "info", "activation_memory", "activation memory is not measured under ZeRO-3 "
                               "(the second forward it takes disturbs ZeRO-3's parameter gathering)",
                               "measure it with the same model under ddp or ZeRO-1/2 (the activations are the same)")
        self._aux_loss_check(trainer, pl_module)
        for name, (block, _) in self._blocks.items():
            self._handles.append(block.register_forward_pre_hook(self.guarded(
                lambda m, args, kwargs, name=name: self._block_pre(name, m, args, kwargs), f"forward hook on {name}"),
                with_kwargs=True))
            if self.routing:
                for router_name, router in find_routers(block).items():
                    full = f"{name}.{router_name}"
                    self._handles.append(router.register_forward_hook(self.guarded(
                        lambda m, args, out, full=full: self._router_out(full, out), f"forward hook on {full}")))

    def _aux_loss_check(self, trainer: Any, pl_module: Any) -> None:
        """The MoE load-balancing loss is computed from router outputs captured in the forward; a reentrant
        checkpoint runs that forward under no_grad, so the loss is a constant and balances nothing."""
        coef = getattr(pl_module, "moe_aux_loss_coef", 0)
        routers = [f"{name}.{r}" for name, (block, mode) in self._blocks.items() if mode == "reentrant"
                   for r in find_routers(block)]
        if routers and isinstance(coef, (int, float)) and coef > 0:
            self.report_capped(
                trainer, "error", "reentrant_aux_loss_no_grad",
                f"reentrant gradient checkpointing runs the forward of {_span(routers)} ({len(routers)} routers) "
                f"under no_grad: the MoE load-balancing loss (coef {coef}) built from their outputs gets no gradient "
                "and balances nothing (the loss curve differs from the run without checkpointing)",
                "use model.gradient_checkpointing=non_reentrant (or true), which keeps the aux-loss gradient",
                details={"routers": routers, "aux_coef": coef})

    # ---- one micro-batch: forward, then backward -------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._handles:
            return
        if self._measure is not None and self._phase == "forward":  # the last batch had no backward
            self._measure["with"].exit()
            self._measure = None
        self._phase = "forward"
        self._routes = {}
        if self.memory and self._seen == 0 and not self._partitioned:
            self._measure = {"with": SavedBytes(), "inputs": SavedBytes(), "inside": []}
            self._measure["with"].enter()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if not self._handles or self._phase != "forward":
            return
        self._phase = "backward"
        if self._measure is not None:
            self._measure["with"].exit()
        if self._no_grad_blocks and "no_input_grad" not in self._reported:
            self._reported.add("no_input_grad")
            names = list(self._no_grad_blocks)
            self.report_capped(
                trainer, "error", "reentrant_no_input_grad",
                f"reentrant gradient checkpointing: no tensor input of {_span(names)} requires grad, so these "
                f"{len(names)} blocks ({sum(self._no_grad_blocks.values()):,} trainable parameters) get NO gradient "
                "and do not train (torch only warns 'None of the inputs have requires_grad=True')",
                "use model.gradient_checkpointing=non_reentrant (or true), or make the embedding output require "
                "grad (HF: model.enable_input_require_grads()) when the embeddings are frozen",
                details={"blocks": self._no_grad_blocks})

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if not self._handles or self._phase != "backward":
            return
        self._phase = None
        if self._measure is not None:
            self._report_memory(trainer)
            self._measure = None
        self._compare_routes(trainer)
        self._seen += 1
        if self._seen >= self.check_steps:
            self._remove_hooks()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._remove_hooks()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.release(trainer)

    def release(self, trainer: Any) -> None:
        """The saved-tensor counting context closed, the block hooks removed (base.py)."""
        if self._measure is not None:
            self._measure["with"].exit()
            self._measure = None
        self._remove_hooks()

    # ---- hooks -------------------------------------------------------------------------------
    def _block_pre(self, name: str, block: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._phase != "forward" or self._suspended or not (block.training and torch.is_grad_enabled()):
            return
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        mode = self._blocks[name][1]
        if mode == "reentrant" and not any(t.requires_grad for t in tensors):
            trainable = sum(getattr(p, "ds_numel", p.numel()) for p in block.parameters() if p.requires_grad)
            if trainable:
                self._no_grad_blocks[name] = trainable
        if self._measure is not None:
            for t in tensors:
                if t.is_floating_point():
                    self._measure["inputs"].add(t)  # what the checkpoint keeps for the block
            self._measure["inside"].append(self._saved_without_checkpointing(block, args, kwargs))

    def _saved_without_checkpointing(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> int:
        """Bytes ``block`` would keep for backward without checkpointing: its forward once more, on the same
        inputs (detached), RNG forked so the real forward draws what it would have drawn."""
        def fresh(t: Any) -> Any:
            return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        # no module hook may see this forward: HF's output capture and the MoE aux-loss capture record router
        # outputs through hooks, and an extra record changed the aux loss (measured: the loss curve moved)
        modules = list(block.modules())
        saved_hooks = [(m._forward_pre_hooks, m._forward_hooks) for m in modules]
        # a stateful forward (BatchNorm's running stats, an in-forward bias/EMA update) must not run twice
        # in what is trained: its buffers are put back as they were
        buffers = [(b, b.detach().clone()) for b in block.buffers()]
        self._suspended = True
        try:
            for m in modules:
                m._forward_pre_hooks, m._forward_hooks = OrderedDict(), OrderedDict()
            with torch.random.fork_rng(devices=devices), checkpointing_suspended(block) as forward, \
                    SavedBytes() as counter:
                out = forward(*[fresh(a) for a in args], **{k: fresh(v) for k, v in kwargs.items()})
                del out
        finally:
            for m, (pre, post) in zip(modules, saved_hooks):
                m._forward_pre_hooks, m._forward_hooks = pre, post
            with torch.no_grad():
                for b, before in buffers:
                    b.copy_(before)
            self._suspended = False
        return counter.bytes

    def _router_out(self, name: str, out: Any) -> None:
        if self._phase is None or self._suspended or not isinstance(out, tuple) or len(out) < 3:
            return
        chosen = out[2]
        if isinstance(chosen, torch.Tensor) and not chosen.is_floating_point():
            self._routes.setdefault(name, {}).setdefault(self._phase, []).append(chosen.detach().clone())

    # ---- judging -----------------------------------------------------------------------------
    def _compare_routes(self, trainer: Any) -> None:
        for name, phases in self._routes.items():
            forward, recompute = phases.get("forward", []), phases.get("backward", [])
            for a, b in zip(forward, recompute):  # one forward and one recompute per micro-batch
                if a.shape != b.shape:
                    share = 1.0
                else:
                    share = float((a.sort(-1).values != b.sort(-1).values).any(-1).float().mean())
                if share > 0 and name not in self._reported:
                    self._reported.add(name)
                    self.report(
                        trainer, "error", "routing_recompute_mismatch",
                        f"router {name} chose other experts in the backward recompute than in the forward for "
                        f"{share:.1%} of this rank's tokens: the gradients are those of another computation",
                        "the router has state or randomness the recompute does not replay: move bias/EMA updates out "
                        "of forward (after the optimizer step), draw jitter noise inside the checkpoint with "
                        "preserve_rng_state, make capacity drops deterministic -- or do not checkpoint MoE layers",
                        details={"router": name, "share_tokens": share})

    def _report_memory(self, trainer: Any) -> None:
        m = self._measure
        kept = SavedBytes()
        kept.storages = {**m["with"].storages, **m["inputs"].storages}
        with_ckpt = kept.bytes
        outside = sum(v for k, v in m["with"].storages.items() if k not in m["inputs"].storages)
        without = outside + sum(m["inside"])
        details = {"bytes_with": with_ckpt, "bytes_without": without, "bytes_saved": without - with_ckpt,
                   "blocks": len(self._blocks), "rank": trainer.global_rank}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            details["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        compared = (f" vs {without / MB:.2f} MB without ({(without - with_ckpt) / MB:.2f} MB, "
                    f"{(without - with_ckpt) / without if without else 0.0:.0%} saved)")
        log.info("grad_checkpointing: rank %d keeps %.2f MB of activations with checkpointing%s",
                 trainer.global_rank, with_ckpt / MB, compared)
        if trainer.global_rank == 0:
            self.report(trainer, "info", "activation_memory",
                        f"activations kept for backward on rank 0's first micro-batch, {len(self._blocks)} "
                        f"checkpointed blocks: {with_ckpt / MB:.2f} MB with checkpointing{compared}",
                        details=details, rank=None)

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
