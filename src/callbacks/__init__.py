"""The debug checks: one Lightning Callback per check, each reporting into the findings channel.

Layout (held by tests/callbacks/test_layout.py): this folder holds the base (``base``), the helpers
several checks share (``SHARED``), and one module or package per check; a check with helpers is a
package whose ``__init__`` exports the class and whose ``check.py`` holds it.

Facade: ``from dsdebug.callbacks import GradMonitor`` (imported on first use, so importing the
package costs nothing and a check's module is loaded only when asked for). Each class docstring
carries its config example and its metric/finding table; docs/debugging.md indexes them.
Used outside the framework (a plain ``L.Trainer``): docs/standalone.md.

| class | module | preset |
|---|---|---|
| Reproducibility | reproducibility | light, full, repro |
| CommDebug | comm_debug | light, full, comm |
| GradMonitor | grad_monitor | light, full, grads |
| DataInspector | data_inspector | light, full, data |
| Profiler | profiler | full, profile |
| FreezeVerify | freeze_verify | full, freeze |
| GradCheckpointing | grad_checkpointing | (add with +callbacks=grad_checkpointing) |
| ModelGraph | model_graph | (add with +callbacks=model_graph) |
| PackingCheck | packing | (add with +callbacks=packing) |
| LogSync | log_sync | light, full, logs |
| ReplicaParity | replica_parity | full |
| LossSpike | loss_spike | light, full |
| LayerHealth | layer_health | full |
| WeightNorm | weight_norm | full |
| MoERouter | moe_router | light, full |
| MemoryMonitor | memory | light, full |
| Throughput | throughput | light, full |
| MixedPrecisionCheck | mixed_precision | light, full |
| NaNTriage | nan_triage | full |
| OutcomeMonitor | outcome_monitor | light, full |
| Preflight | preflight | light, full |
| TrainMode | train_mode | light, full |
| OptimizerCoverage | optimizer_coverage | light, full |
| GradScaleCheck | grad_scale | always on |
| ConsistencyCheck | consistency | always on |
| DeepSpeedWallClock | ds_wall_clock | added under DeepSpeed |
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "DebugCallback": "base",
    "Reproducibility": "reproducibility",
    "CommDebug": "comm_debug",
    "GradMonitor": "grad_monitor",
    "DataInspector": "data_inspector",
    "Profiler": "profiler",
    "FreezeVerify": "freeze_verify",
    "GradCheckpointing": "grad_checkpointing",
    "ModelGraph": "model_graph",
    "PackingCheck": "packing",
    "LogSync": "log_sync",
    "ReplicaParity": "replica_parity",
    "LossSpike": "loss_spike",
    "LayerHealth": "layer_health",
    "WeightNorm": "weight_norm",
    "OutcomeMonitor": "outcome_monitor",
    "Preflight": "preflight",
    "TrainMode": "train_mode",
    "OptimizerCoverage": "optimizer_coverage",
    "MoERouter": "moe_router",
    "MemoryMonitor": "memory",
    "Throughput": "throughput",
    "MixedPrecisionCheck": "mixed_precision",
    "NaNTriage": "nan_triage",
    "GradScaleCheck": "grad_scale",
    "ConsistencyCheck": "consistency",
    "DeepSpeedWallClock": "ds_wall_clock",
}
# modules every check may use: the base class, gradient access, the fp16 loss scale, the step clock
SHARED = ("base", "isolation", "grad_access", "loss_scale", "step_clock", "arg_table")
SEVEN = ("Reproducibility", "CommDebug", "GradMonitor", "DataInspector", "Profiler", "FreezeVerify", "LogSync")
# checks every run has (conf/callbacks/default.yaml), not selected by a debug= preset
ALWAYS_ON_MODULES = ("dsdebug.callbacks.grad_scale", "dsdebug.callbacks.consistency")
__all__ = sorted(_MODULES)


def is_debug_check(module_or_target: str) -> bool:
    """A check a debug= preset selects (a class path or module name under dsdebug.callbacks)."""
    return (module_or_target.startswith("dsdebug.callbacks.")
            and not module_or_target.startswith(tuple(m + "." for m in ALWAYS_ON_MODULES) + ALWAYS_ON_MODULES))


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULES))
