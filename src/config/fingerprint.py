"""The run's config as facts to compare across ranks and over time: flat dotted keys, secrets
redacted, paths shown relative to ``paths.*`` (each node has its own run dir), and a short hash.

Used by the ``consistency`` check (every rank composed the same run) and ``replica_parity``
(the config did not change under a resume)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dsdebug.findings.secrets import redact

__all__ = ["config_facts", "config_hash"]


def config_facts(cfg: Any) -> dict[str, Any]:
    """The resolved config, flat, without ``paths``/``seed``; path values relative to ``paths.*``."""
    from omegaconf import OmegaConf

    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation that only resolves under Hydra
        resolved = OmegaConf.to_container(cfg, resolve=False)
    paths = {k: str(v) for k, v in (resolved.pop("paths", None) or {}).items() if isinstance(v, str) and v}
    resolved.pop("seed", None)
    resolved.pop("hydra", None)
    flat = _flatten(redact(resolved))
    for key, value in flat.items():
        if isinstance(value, str):
            for name, path in sorted(paths.items(), key=lambda kv: -len(kv[1])):
                value = value.replace(path, f"<paths.{name}>")
            flat[key] = value
    return flat


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: json.dumps(node, sort_keys=True, default=str) if isinstance(node, list) else node}


def config_hash(config: dict[str, Any]) -> str:
    """Short sha256 of a flat config (``config_facts``): equal on every rank that composed the same run."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
