"""Hydra task entry, preflight, launch, liveness and checkpoints (see docs/architecture.md)."""

__all__ = []
