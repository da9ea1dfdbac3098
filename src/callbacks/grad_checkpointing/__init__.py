"""`GradCheckpointing` (``callbacks.grad_checkpointing``), one check in a package:

- ``check``: the callback (reentrant blocks without input grad, MoE routing that differs in the recompute,
  activation memory with vs without);
- ``saved_bytes``: counting the activations autograd keeps for backward (``saved_tensors_hooks``).

``from dsdebug.callbacks.grad_checkpointing import GradCheckpointing`` and the config target
``dsdebug.callbacks.grad_checkpointing.GradCheckpointing`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.grad_checkpointing.check import GradCheckpointing

__all__ = ["GradCheckpointing"]
