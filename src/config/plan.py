"""The run plan: what ``prepare(cfg)`` settled, frozen, for the builders and checks to read.

``prepare`` (config/prepare.py) validates the composed config, derives every value that follows from
others into it, then makes it read-only and returns a :class:`RunPlan`: the typed derived values
(world, per-rank and global batch, scaled LR, vocab, tokenizer, fused, the loggers' sweep identity), the
composed config as the user asked for it, and every value that differs between the two with the
reason (``adjustments``). Nothing writes the config after that: a write raises
(``omegaconf.errors.ReadonlyConfigError``). A value only known later (a hub tokenizer's vocabulary,
read when the datamodule is built) gives a new plan, :func:`replace_plan`, never a config write.

``run_plan.json`` lies next to ``config_resolved.yaml`` in the run dir.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["PLAN_FILE", "Adjustment", "RunPlan", "adjustments_between", "is_prepared", "mark_prepared", "replace_plan"]

PLAN_FILE = "run_plan.json"

# why prepare changes a key (the steps in config/prepare.py; one reason per key it may write)
_WHY = {
    "trainer.devices": "fitted to the world the launcher started (distributed/launch_env.py)",
    "trainer.num_nodes": "fitted to the world the launcher started (distributed/launch_env.py)",
    "data.tokenizer": "the tokenizer in use (config/tokenizer_check.py)",
    "data.vocab_size": "follows the tokenizer's id range",
    "data.batch_size": "per rank, from data.global_batch_size or the ds_config's batch keys",
    "trainer.accumulate_grad_batches": "from the ds_config's batch keys",
    "trainer.gradient_clip_val": "the ds_config's gradient_clipping",
    "trainer.precision": "the ds_config's fp16/bf16 section",
    "optim.optimizer.lr": "optim.lr scaled to the global batch (optim.scale_lr_base_batch_size)",
    "optim.optimizer.fused": "fused: auto, settled for this precision and strategy (models/optim.py resolve_fused)",
}


@dataclass(frozen=True)
class Adjustment:
    """One value the run uses that differs from the composed config: ``key``, what was ``asked``,
    what is ``used``, and ``why``."""

    key: str
    asked: Any
    used: Any
    why: str


@dataclass(frozen=True)
class RunPlan:
    """Read by ``build``/``train``/the doctor; ``cfg`` is the prepared config (read-only), ``asked``
    the composed one before any derivation (read-only)."""

    cfg: DictConfig = field(repr=False, compare=False)
    asked: DictConfig = field(repr=False, compare=False)
    world_size: int
    devices: Any
    num_nodes: int
    per_rank_batch: int
    accumulate: int
    global_batch: int
    lr_asked: float
    lr: float
    vocab_size: int | None
    tokenizer: str | None
    fused: Any
    precision: str = ""
    gradient_clip: float | None = None
    logger_arguments: dict = field(default_factory=dict)  # per logger: a sweep job's W&B group/name the user left unset
    adjustments: tuple[Adjustment, ...] = ()
    # the resume plan, settled by the trainer right after prepare (checkpoint/ sits above config/): the checkpoint
    # chosen, the path loaded, universal (resharded) loading, the step a run continues from in place, the loggers'
    # arguments that continue them; {} before that, and for a fresh run {"checkpoint": None}
    resume: dict = field(default_factory=dict)

    def used(self, key: str) -> Any:
        """The value the run uses for a dotted key (the prepared config)."""
        return OmegaConf.select(self.cfg, key, default=None)

    def asked_for(self, key: str) -> Any:
        """The value the composed config had for a dotted key, before prepare."""
        return OmegaConf.select(self.asked, key, default=None)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("cfg", "asked")}
        out["adjustments"] = [dataclasses.asdict(a) for a in self.adjustments]
        return out

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / PLAN_FILE
        path.write_text(json.dumps(self.to_dict(), indent=1, default=str) + "\n")
        return path


def adjustments_between(asked: DictConfig, used: DictConfig) -> tuple[Adjustment, ...]:
    """Every leaf whose resolved value differs between the two configs (an interpolation compared by
    what it resolves to), with the reason prepare has for it ("changed by prepare" when it has none)."""
    before, after = _leaves(_container(asked)), _leaves(_container(used))
    keys = [k for k in after if before.get(k, _ABSENT) != after[k]]
    keys += [k for k in before if k not in after]
    return tuple(Adjustment(k, _shown(before.get(k, _ABSENT)), _shown(after.get(k, _ABSENT)),
                            _WHY.get(k, "changed by prepare")) for k in keys)


_PREPARED_FLAG = "dsdebug_prepared"  # an OmegaConf node flag: set on the config prepare returned a plan for


def mark_prepared(cfg: DictConfig) -> None:
    """Flag ``cfg`` as prepared (on the object itself: no registry holding configs alive)."""
    cfg._set_flag(_PREPARED_FLAG, True)


def is_prepared(cfg: Any) -> bool:
    """Whether ``prepare`` ran on this config object (not one equal to it)."""
    return isinstance(cfg, DictConfig) and cfg._get_node_flag(_PREPARED_FLAG) is True


def replace_plan(plan: RunPlan, adjustment: Adjustment, **values: Any) -> RunPlan:
    """A value known only after prepare (a hub tokenizer's vocabulary): a new frozen plan with ``values`` and the
    adjustment recorded; the config itself stays as it was."""
    kept = tuple(a for a in plan.adjustments if a.key != adjustment.key)
    return dataclasses.replace(plan, adjustments=(*kept, adjustment), **values)


_ABSENT = "<absent>"


def _container(cfg: DictConfig) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - an interpolation only Hydra's runtime resolves: compare unresolved
        return OmegaConf.to_container(cfg, resolve=False)


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}} if prefix else out
    return {prefix[:-1]: node}


def _shown(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None), list)) else str(value)
