"""Finding checkpoints to resume from, and exporting the final weights.

A Lightning checkpoint is a file (DDP) or, under DeepSpeed, a directory of shards with a
``latest`` tag file that DeepSpeed writes after the shards. Only complete ones count.

Exports (rank 0, after fit):
- ``export/model_fp32.pt``: one consolidated fp32 state dict of the LightningModule, made
  with DeepSpeed's zero_to_fp32 (through Lightning's wrapper) from sharded checkpoints.
- ``export/hf/``: the network as a HF ``save_pretrained`` directory plus the tokenizer, so
  ``AutoModelForCausalLM.from_pretrained(run_dir/"export/hf")`` loads it back.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from src.errors import ConfigError

log = logging.getLogger(__name__)


def is_complete_checkpoint(path: Path) -> bool:
    if path.is_file():
        return path.stat().st_size > 0
    return path.is_dir() and (path / "latest").is_file() and (path / "checkpoint").is_dir()


def list_checkpoints(root: Path, exclude: Path | None = None) -> list[Path]:
    """Complete checkpoints under ``root/**/checkpoints/``, oldest first."""
    found = []
    for ckpt_dir in root.glob("**/checkpoints"):
        if exclude is not None and exclude.resolve() in ckpt_dir.resolve().parents:
            continue
        found += [p for p in ckpt_dir.iterdir() if p.name.endswith(".ckpt") and is_complete_checkpoint(p)]
    return sorted(found, key=lambda p: (p / "latest").stat().st_mtime if p.is_dir() else p.stat().st_mtime)


def resolve_ckpt_path(cfg: Any, output_dir: Path) -> str | None:
    if cfg.get("ckpt_path"):
        path = Path(str(cfg.ckpt_path)).expanduser().resolve()
        if not is_complete_checkpoint(path):
            raise ConfigError(f"ckpt_path={cfg.ckpt_path}: not a complete checkpoint (file, or DeepSpeed dir with 'latest')")
        return str(path)
    if cfg.get("resume") == "latest":
        root = Path(cfg.paths.log_dir) / cfg.task_name
        candidates = list_checkpoints(root, exclude=output_dir)
        if not candidates:
            raise ConfigError(f"resume=latest: no complete checkpoint under {root}; train first or pass ckpt_path=<path>")
        log.info("resume=latest -> %s", candidates[-1])
        return str(candidates[-1])
    return None


class FinalCheckpoint(Callback):
    """Makes sure the final weights are in a checkpoint when fit ends.

    Reuses the periodic checkpoint if one was written at the last step, else writes
    ``checkpoints/last.ckpt``. Runs on every rank: saving is a collective under ZeRO.
    """

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)
        self.path: Path | None = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        cb = trainer.checkpoint_callback
        # with monitor=step (conf/callbacks/model_checkpoint.yaml) the "best" is the newest
        if (cb is not None and cb.monitor == "step" and cb.best_model_path
                and getattr(cb, "_last_global_step_saved", -1) == trainer.global_step):
            self.path = Path(cb.best_model_path)
            return
        self.path = self.dirpath / "last.ckpt"
        trainer.save_checkpoint(self.path)


def export_final(ckpt: Path, out_dir: Path, net_factory: Any, tokenizer: Any, hf: bool) -> dict[str, str]:
    """Rank 0 only: consolidate ``ckpt`` to fp32, and optionally write a HF directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fp32_path = out_dir / "model_fp32.pt"
    if ckpt.is_dir():
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(fp32_path))
        state = torch.load(fp32_path, map_location="cpu", weights_only=False)["state_dict"]
    else:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
        torch.save({"state_dict": state}, fp32_path)
    exports = {"fp32": str(fp32_path)}
    if hf:
        net_state = {k[len("net."):]: v.float() for k, v in state.items() if k.startswith("net.")}
        net = net_factory()
        if not hasattr(net, "save_pretrained"):
            log.warning("export.hf skipped: %s has no save_pretrained (not a HF model)", type(net).__name__)
            return exports
        from src.models.deepseek import save_pretrained_dir

        hf_dir = out_dir / "hf"
        save_pretrained_dir(net, hf_dir, tokenizer=tokenizer, state_dict=net_state)
        exports["hf"] = str(hf_dir)
    return exports
