"""Finding checkpoints to resume from, and exporting the final weights.

A Lightning checkpoint is a file (DDP) or, under DeepSpeed, a directory of shards. It counts
as complete once its manifest exists (``src/checkpoint/integrity.py``), and is verified against it
before a resume.

Exports (rank 0, after fit):
- ``export/model_fp32.pt``: one consolidated fp32 state dict of the LightningModule, made
  with DeepSpeed's zero_to_fp32 (through Lightning's wrapper) from sharded checkpoints.
- ``export/hf/``: the network as a HF ``save_pretrained`` directory plus the tokenizer, so
  ``AutoModelForCausalLM.from_pretrained(run_dir/"export/hf")`` loads it back. A pretrained
  tokenizer's files are copied byte for byte; config.json's eos/bos/pad ids are the tokenizer's.
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from dsdebug.checkpoint.integrity import CheckpointError, has_manifest, manifest_path, save_verified, verify_checkpoint

__all__ = ["FinalCheckpoint", "RESUME_MODES", "align_special_token_ids", "export_final", "is_complete_checkpoint",
           "is_legacy_checkpoint", "list_checkpoints", "resolve_ckpt_path"]

log = logging.getLogger(__name__)


def is_complete_checkpoint(path: Path) -> bool:
    """Complete = its manifest exists (written last, after every rank's shards)."""
    return has_manifest(path) and (path.is_file() or path.is_dir())


def is_legacy_checkpoint(path: Path) -> bool:
    """A checkpoint from elsewhere (no manifest): a file, or a DeepSpeed dir with its tag file."""
    if path.is_file():
        return path.stat().st_size > 0
    return path.is_dir() and (path / "latest").is_file() and (path / "checkpoint").is_dir()


def list_checkpoints(root: Path, exclude: Path | None = None) -> list[Path]:
    """Checkpoints with a manifest under ``root/**/checkpoints/``, oldest first (by manifest time)."""
    found = []
    for ckpt_dir in root.glob("**/checkpoints"):
        if exclude is not None and exclude.resolve() in ckpt_dir.resolve().parents:
            continue
        for p in ckpt_dir.iterdir():
            if not p.name.endswith(".ckpt"):
                continue
            if is_complete_checkpoint(p):
                found.append(p)
            else:
                log.info("skipping %s: no manifest (its save did not finish)", p)
    return sorted(found, key=lambda p: manifest_path(p).stat().st_mtime)


RESUME_MODES = ("auto", "latest", "latest_valid")


def resolve_ckpt_path(cfg: Any, output_dir: Path) -> str | None:
    """The checkpoint to resume from, verified against its manifest.

    ``ckpt_path=<path>``: that one (a checkpoint without a manifest, e.g. from another tool,
    loads with a warning). The resume modes look in this run dir first:

    - ``resume=auto``: the newest checkpoint of *this* run dir that verifies; none = start fresh
      (the same command can be requeued forever: SLURM requeue, Composer's autoresume);
    - ``resume=latest``: this run dir's newest checkpoint when it has one, else the newest under
      ``${paths.log_dir}/${task_name}/``; it must verify;
    - ``resume=latest_valid``: the same places, the newest that verifies, each skipped one reported.
    """
    if cfg.get("ckpt_path"):
        path = Path(str(cfg.ckpt_path)).expanduser().resolve()
        if has_manifest(path):
            verify_checkpoint(path)
        elif is_legacy_checkpoint(path):
            if path.is_file() and not zipfile.is_zipfile(path):
                raise CheckpointError(f"ckpt_path={cfg.ckpt_path}: not a torch checkpoint (not a torch.save archive)")
            log.warning("ckpt_path=%s has no manifest: loading it unverified", path)
        else:
            raise CheckpointError(
                f"ckpt_path={cfg.ckpt_path}: not a complete checkpoint (no {manifest_path(path).name}, "
                "and not a file or a DeepSpeed dir with 'latest')"
            )
        return str(path)
    mode = cfg.get("resume")
    if mode not in RESUME_MODES:
        return None
    # this run dir first: a requeued job continues its own run, never a newer one beside it
    candidates, where = list_checkpoints(output_dir), f"this run dir {output_dir}"
    if not candidates and mode == "auto":
        log.info("resume=auto: no complete checkpoint in %s: starting fresh", output_dir / "checkpoints")
        return None
    if not candidates:
        root = Path(cfg.paths.log_dir) / cfg.task_name
        candidates, where = list_checkpoints(root, exclude=output_dir), f"another run under {root}"
        if not candidates:
            raise CheckpointError(f"resume={mode}: no complete checkpoint under {root}; train first or pass ckpt_path=<path>")
    if mode == "latest":
        verify_checkpoint(candidates[-1])
        log.info("resume=latest -> %s (verified; %s)", candidates[-1], where)
        return str(candidates[-1])
    for path in reversed(candidates):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            _report_skipped(path, e)
            continue
        log.info("resume=%s -> %s (verified; %s)", mode, path, where)
        return str(path)
    raise CheckpointError(f"resume={mode}: none of the {len(candidates)} checkpoints in {where} verifies")


def _report_skipped(path: Path, error: Exception) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank != 0:
        return
    from dsdebug.findings import Finding, get_channel

    get_channel().report(Finding(
        check="checkpoint", severity="warning", code="checkpoint_corrupt",
        message=f"skipped {path.name}: {error}",
        advice="the checkpoint's files differ from its manifest (disk error, partial copy, or edited); "
               "delete it or restore it from a backup",
        details={"checkpoint": str(path)},
    ))


class FinalCheckpoint(Callback):
    """Makes sure the final weights are in a checkpoint when fit ends.

    Reuses the periodic checkpoint if one was written at the last step, else writes
    ``checkpoints/last.ckpt``. Runs on every rank: saving is a collective under ZeRO.
    """

    def __init__(self, dirpath: str | Path, preemption: Any = None) -> None:
        self.dirpath = Path(dirpath)
        self.path: Path | None = None
        self.preemption = preemption

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        pre = self.preemption
        if pre is not None and pre.before_first_step:
            return  # preempted while starting: nothing trained, nothing to save (self.path stays None)
        if pre is not None and pre.path is not None and pre.step == trainer.global_step:
            self.path = pre.path  # preempted: that checkpoint is the final one, don't spend grace time
            return
        cb = trainer.checkpoint_callback
        # with monitor=step (conf/callbacks/model_checkpoint.yaml) the "best" is the newest
        if (cb is not None and cb.monitor == "step" and cb.best_model_path
                and getattr(cb, "_last_global_step_saved", -1) == trainer.global_step):
            self.path = Path(cb.best_model_path)
            return
        self.path = self.dirpath / "last.ckpt"
        save_verified(trainer, self.path)


def export_final(ckpt: Path, out_dir: Path, net_factory: Any, tokenizer: Any, hf: bool,
                 tokenizer_dir: Path | None = None, adapter: Any = None,
                 int8_batches: list | None = None) -> dict[str, str]:
    """Rank 0 only: consolidate ``ckpt`` to fp32, and optionally write a HF directory with the
    tokenizer (``tokenizer_dir``: a pretrained tokenizer's files, copied as they are). With an
    ``adapter`` (model.adapter): also ``export/adapter/`` (verified: non-empty, reloads to the same
    logits) and the HF directory holds the merged net. With ``int8_batches`` (export.int8): also
    ``export/model_int8.pt``, the net's Linear layers in int8, its size and validation perplexity
    against fp32 measured on those batches (``export/int8.json`` and a finding)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fp32_path = out_dir / "model_fp32.pt"
    if ckpt.is_dir():
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(fp32_path))
        saved = torch.load(fp32_path, map_location="cpu", weights_only=False)
        state = saved["state_dict"]
        if _complete_frozen(ckpt, state):
            torch.save(saved, fp32_path)
    else:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
        torch.save({"state_dict": state}, fp32_path)
    exports = {"fp32": str(fp32_path)}
    net_state = {k[len("net."):]: v.float() for k, v in state.items() if k.startswith("net.")}
    if adapter is not None:
        from dsdebug.models.adapter import export_adapter, load_adapted

        net = load_adapted(adapter, net_factory(), net_state)
        merged, facts = export_adapter(net, out_dir / "adapter", getattr(tokenizer, "vocab_size", None))
        log.info("export/adapter: %d tensors, %d elements, reload max |diff| %s", facts["tensors"],
                 facts["elements"], facts.get("reload_max_abs_diff"))
        exports["adapter"] = str(out_dir / "adapter")
        net_factory, net_state = (lambda: merged), merged.state_dict()  # noqa: E731
    if int8_batches is not None:
        import json

        from dsdebug.models.int8_export import export_int8

        net = net_factory()
        if adapter is None:  # the merged net already holds its weights
            net.load_state_dict(net_state)
        facts = export_int8(net, out_dir / "model_int8.pt", int8_batches)
        (out_dir / "int8.json").write_text(json.dumps(facts, indent=2))
        exports["int8"] = facts["path"]
    if hf:
        net = net_factory()
        if not hasattr(net, "save_pretrained"):
            log.warning("export.hf skipped: %s has no save_pretrained (not a HF model)", type(net).__name__)
            return exports
        from dsdebug.models.deepseek import save_pretrained_dir

        hf_dir = out_dir / "hf"
        align_special_token_ids(net, tokenizer)
        save_pretrained_dir(net, hf_dir, tokenizer=None if tokenizer_dir else tokenizer, state_dict=net_state)
        if tokenizer_dir is not None:
            from dsdebug.data.pretrained_tokenizer import copy_tokenizer_files

            copy_tokenizer_files(tokenizer_dir, hf_dir)
        exports["hf"] = str(hf_dir)
    return exports


def _complete_frozen(ckpt_dir: Path, state: dict[str, Any]) -> list[str]:
    """Put back the frozen parameters zero_to_fp32 leaves out under ZeRO-1: DeepSpeed records frozen
    parameters' shapes only when it partitions gradients (stage >= 2), so a ZeRO-1 consolidation
    drops them (a LoRA base, a freeze_verify train_only run). Stage 1/2 model states hold every
    parameter whole (ZeRO-3's are empty and skipped): the missing ones are taken from there."""
    tag_file = ckpt_dir / "latest"
    tag = tag_file.read_text().strip() if tag_file.is_file() else None
    name = "mp_rank_00_model_states.pt"
    files = [ckpt_dir / tag / name] if tag else sorted(ckpt_dir.glob(f"*/{name}"))
    if not files or not files[0].is_file():
        return []
    module = torch.load(files[0], map_location="cpu", weights_only=False).get("module") or {}
    added = []
    for key, value in module.items():
        key = key[len("_forward_module."):] if key.startswith("_forward_module.") else key
        if key not in state and torch.is_tensor(value) and value.numel() > 0:
            state[key] = value.float() if value.is_floating_point() else value
            added.append(key)
    if added:
        log.warning("export: zero_to_fp32 left out %d frozen parameters (%s ...; ZeRO-1 records no frozen-parameter "
                    "shapes); taken whole from the checkpoint's model states", len(added), added[0])
    return added


def align_special_token_ids(net: Any, tokenizer: Any) -> None:
    """config.json (and generation_config.json) name the tokenizer's eos/bos/pad ids, so the export
    stops generating where the tokenizer ends a document. A random-init model's config carries its
    class defaults (DeepSeek-V3: eos 1, which is the BPE's pad); a pretrained model's already agree
    (checked before training, src/config/tokenizer_check.py) and are left as they are."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return
    configs = [c for c in (getattr(net, "config", None), getattr(net, "generation_config", None)) if c is not None]
    for role in ("eos", "bos", "pad"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is None:
            continue
        for config in configs:
            current = getattr(config, f"{role}_token_id", None)
            if token_id in current if isinstance(current, list) else token_id == current:
                continue
            setattr(config, f"{role}_token_id", token_id)
