"""Checkpoints: manifests and integrity, resume and reshard, the final export."""

__all__ = []
