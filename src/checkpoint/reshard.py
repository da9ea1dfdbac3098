"""Resume under another world size or ZeRO stage.

A DeepSpeed checkpoint stores the optimizer state as per-rank partitions, so it loads only at
the world size and ZeRO stage that wrote it. When the manifest says they differ from this run:

- DeepSpeed -> DeepSpeed (ZeRO-1 <-> ZeRO-2, or ZeRO-3 -> ZeRO-3; any world size): rank 0 converts it once to a
  *universal checkpoint* (DeepSpeed's ``ds_to_universal``: one file per parameter with its
  fp32 weight and Adam moments) under ``<run_dir>/resume/<name>``, and the engine loads it
  with ``checkpoint.load_universal``. Step, schedulers, data position and model weights carry
  over; the data position is rescaled to the new world size (``LMDataModule.load_state_dict``).
- ZeRO-3 <-> ZeRO-1/2: DeepSpeed's ZeRO-3 universal loader reads a ZeRO-3 optimizer layout only
  (and applies group 0's hyper-parameters to every group), so this is refused, as is
- DDP <-> DeepSpeed (the optimizer layouts differ): a one-line error says how to go on instead.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dsdebug.checkpoint.integrity import CheckpointError, has_manifest, read_manifest, write_manifest

__all__ = ["current_layout", "enable_universal_loading", "plan_resume", "to_universal"]

log = logging.getLogger(__name__)

try:
    from importlib.metadata import version as _version

    _DS_VERSION = _version("deepspeed")
except Exception:  # noqa: BLE001
    _DS_VERSION = "this"


def current_layout(cfg: Any, world_size: int) -> tuple[str, int | None]:
    """(strategy kind, ZeRO stage) of this run, from the composed config."""
    target = str(cfg.strategy.get("_target_", ""))
    if not target.endswith("DeepSpeedStrategy"):
        return "ddp", None
    stage = cfg.strategy.get("stage")
    config = cfg.strategy.get("config")
    if isinstance(config, str):
        from dsdebug.config.ds_config import load_ds_config

        stage = load_ds_config(config).get("zero_optimization", {}).get("stage", stage)
    elif config is not None and "zero_optimization" in config:
        stage = config["zero_optimization"].get("stage", stage)
    return "deepspeed", int(stage) if stage is not None else 2


def plan_resume(cfg: Any, ckpt: str | None, output_dir: Path, world_size: int) -> tuple[str | None, bool]:
    """The path to load and whether it is a universal checkpoint."""
    if ckpt is None:
        return None, False
    if not has_manifest(Path(ckpt)):  # a checkpoint from elsewhere: at least the right kind?
        kind, stage = current_layout(cfg, world_size)
        if kind == "deepspeed" and Path(ckpt).is_file():
            raise CheckpointError(
                f"ckpt_path={ckpt} is a single-file (DDP) checkpoint but this run's DeepSpeed ZeRO-{stage} loads "
                "checkpoint directories; resume it with strategy=ddp"
            )
        if kind == "ddp" and Path(ckpt).is_dir():
            raise CheckpointError(
                f"ckpt_path={ckpt} is a DeepSpeed checkpoint directory but strategy=ddp loads single files; resume "
                "it with the DeepSpeed strategy that wrote it (strategy=zero1|zero2|zero3)"
            )
        return ckpt, False
    saved = read_manifest(Path(ckpt))
    saved_kind = "deepspeed" if "DeepSpeed" in str(saved.get("strategy")) else "ddp"
    saved_ws, saved_stage = saved.get("world_size"), saved.get("zero_stage")
    kind, stage = current_layout(cfg, world_size)
    if (saved_kind, saved_ws, saved_stage) == (kind, world_size, stage) or (saved_kind == kind == "ddp"):
        return ckpt, False  # DDP checkpoints hold the full state: any world size loads them
    was = f"{saved_kind} zero_stage={saved_stage} world_size={saved_ws}"
    now = f"{kind} zero_stage={stage} world_size={world_size}"
    if saved_kind != kind:
        raise CheckpointError(
            f"checkpoint {ckpt} was written by {was}, this run is {now}: optimizer state cannot move between "
            "DDP and DeepSpeed; resume with the original strategy, or start from its weights: finish or "
            "export that run (export/hf) and train with model=hf_pretrained model.net.name_or_path=<run>/export/hf"
        )
    if (saved_stage == 3) != (stage == 3):
        raise CheckpointError(
            f"checkpoint {ckpt} was written by {was}, this run is {now}: DeepSpeed {_DS_VERSION}'s universal "
            "checkpoint loads ZeRO-3 state only from a ZeRO-3 checkpoint and ZeRO-1/2 state only from ZeRO-1/2; "
            f"resume with strategy={'zero3' if saved_stage == 3 else f'zero{saved_stage}'} (any world size), "
            "or start from its weights: export that run (export/hf) and train with model=hf_pretrained "
            "model.net.name_or_path=<run>/export/hf"
        )
    if cfg.get("resume_reshard", True) is False:
        raise CheckpointError(
            f"checkpoint {ckpt} was written by {was}, this run is {now}; set resume_reshard=true to convert it "
            f"with DeepSpeed's universal checkpoint, or run: python -m deepspeed.checkpoint.ds_to_universal "
            f"--input_folder {ckpt}/checkpoint --output_folder <dir>/checkpoint --inject_missing_state"
        )
    out = output_dir / "resume" / Path(ckpt).name
    if os.environ.get("LOCAL_RANK", "0") == "0":
        if not has_manifest(out):
            log.info("resume: %s -> %s: converting %s to a universal checkpoint in %s", was, now, ckpt, out)
            to_universal(Path(ckpt), out)
            write_manifest(out, {**{k: saved.get(k) for k in ("global_step", "epoch", "world_size", "strategy",
                                                           "zero_stage", "precision")},
                                 "universal_from": str(ckpt)})
    else:  # rank 0 converted before it launched us
        deadline = time.time() + 600
        while not has_manifest(out):
            if time.time() > deadline:
                raise CheckpointError(f"universal checkpoint {out} did not appear (rank 0 converts it)")
            time.sleep(0.5)
    return str(out), True


def to_universal(ckpt: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(ckpt / "checkpoint"), "--output_folder", str(out / "checkpoint"),
           "--num_extract_workers", "1", "--num_merge_workers", "1",
           # Lightning modules carry no Megatron-style universal_checkpoint_info: let DeepSpeed add it
           "--inject_missing_state"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-1:])[:300]
        raise CheckpointError(f"converting {ckpt} to a universal checkpoint failed: {tail}")
    # latest_universal names the tag; Lightning's loader also wants the "latest" file of a DS dir
    (out / "latest").write_text("checkpoint")
    # the engine looks for the client state (Lightning's loops, schedulers, callbacks) under the
    # name its own stage would write: mp_rank_00_* (ZeRO-1/2) or zero_pp_rank_0_mp_rank_00_* (ZeRO-3)
    tag = out / "checkpoint"
    names = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    have = [n for n in names if (tag / n).is_file()]
    if not have:
        raise CheckpointError(f"converting {ckpt}: {tag} has no model-states file")
    for name in names:
        if not (tag / name).exists():
            os.link(tag / have[0], tag / name)


def enable_universal_loading(strategy: Any) -> None:
    config = strategy.config if strategy.config is not None else {}
    config.setdefault("checkpoint", {})["load_universal"] = True
    strategy.config = config
