"""The Hydra config tree (package data of dsdebug: ``dsdebug-train`` composes it from any directory)."""
