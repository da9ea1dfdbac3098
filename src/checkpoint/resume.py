"""A resumed run: is its checkpoint from the same experiment, and does it continue in place.

``src/checkpoint/checkpoints.py`` picks the checkpoint (``resume=auto|latest|latest_valid``, this
run dir first). Here, for a checkpoint a resume mode picked:

**Same experiment?** (rank 0, after the config is final) The checkpoint's run dir has the
``config_resolved.yaml`` it was written with; its ``model``, ``data`` and ``strategy`` sections and
the trainer's layout keys are compared with this run's:

- a ``model.*`` or ``data.*`` key differs (another architecture, tokenizer, corpus, sequence
  length, ...): refused, one line naming the keys, before anything is loaded. The weights or the
  data position would belong to another experiment; ``ckpt_path=<that checkpoint>`` loads it
  anyway (an explicit path is the user's choice and is not compared);
- only layout keys differ (``strategy.*``, ``trainer.devices|num_nodes|accelerator|precision|
  accumulate_grad_batches``, ``data.batch_size``): a ``resume_config_differs`` warning naming them.
  Changing the world size or ZeRO stage is what the universal-checkpoint path is for
  (``reshard.py``), but it must never happen silently.
- ``data.num_workers``, ``data.pin_memory`` and ``data.cache_dir`` are not compared (where, not what).

**A run dir with a previous attempt** (a requeued job, an explicit ``hydra.run.dir``): that
attempt's ``metrics.json``, ``crash.json`` and comm_debug's hang flags move to ``attempts/<n>/``,
so this attempt's report and hang watchdog do not see the last one's end.

**In place** (the checkpoint lies in this run dir: ``resume=auto``, or ``latest`` in its own dir):

- ``history.jsonl`` and the CSV logger's ``metrics.csv`` keep their rows before the checkpoint's
  step (Lightning's CSVLogger deletes an existing ``metrics.csv``); rows at or after it are dropped,
  since this attempt logs those steps again;
- TensorBoard writes into the same directory (our config pins ``version: ""``; an auto version is
  pinned to the newest ``version_<n>``) with ``purge_step`` = the checkpoint's step, so TensorBoard
  hides what a crashed attempt logged after it;
- W&B continues the same run: its id is kept in ``wandb_run_id`` and given back to
  ``WandbLogger(id=...)`` (Lightning passes ``resume="allow"``). Offline, each attempt leaves an
  ``offline-run-*-<id>`` dir with that id.
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dsdebug.checkpoint.integrity import CheckpointError, has_manifest, read_manifest
from dsdebug.findings.secrets import redact

__all__ = ["LAYOUT", "NOT_COMPARED", "SECTIONS", "TRAINER_KEYS", "WANDB_ID_FILE", "check_resume_config",
           "config_differences", "in_place_step", "prepare_loggers", "settle_run_dir"]

log = logging.getLogger(__name__)

SECTIONS = ("model", "data", "strategy")
TRAINER_KEYS = ("devices", "num_nodes", "accelerator", "precision", "accumulate_grad_batches")
LAYOUT = ("strategy.", "trainer.", "data.batch_size")
# how the same model runs, not which model: a resumed run may switch kernels (src/models/kernel_options.py)
NOT_COMPARED = ("data.num_workers", "data.pin_memory", "data.cache_dir", "model.compile", "model.cross_entropy",
                "model.net.attn_implementation")
WANDB_ID_FILE = "wandb_run_id"
_ATTEMPT_FILES = ("metrics.json", "crash.json", "comm_debug/hang.flag", "comm_debug/hang.reported")


# --------------------------------------------------------------------- same experiment?
def _compared(config: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    for section in SECTIONS:
        walk(section, config.get(section) or {})
    for key in TRAINER_KEYS:
        flat[f"trainer.{key}"] = (config.get("trainer") or {}).get(key)
    return {k: v for k, v in flat.items() if not k.startswith(NOT_COMPARED)}


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (checkpoint's value, this run's) for every compared key that differs."""
    a, b = _compared(saved), _compared(current)
    missing = "<absent>"
    return {k: (a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)}


def _describe(diffs: dict[str, tuple[Any, Any]], limit: int = 4) -> str:
    def short(v: Any) -> str:
        text = str(v)
        return text if len(text) <= 40 else text[:37] + "..."

    parts = [f"{k} ({short(was)} -> {short(now)})" for k, (was, now) in list(diffs.items())[:limit]]
    more = f" and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return ", ".join(parts) + more


def _run_dir_of(ckpt: Path) -> Path | None:
    for parent in list(ckpt.parents)[:3]:
        if (parent / "config_resolved.yaml").is_file():
            return parent
    return None


def check_resume_config(cfg: DictConfig | dict, ckpt: str | None) -> None:
    """Rank 0, after the config is final and before this run writes its own config_resolved.yaml. ``cfg``: the
    run's config, or its resolved form (trainer/entry.py resolved_config: with what the build learnt)."""
    mode = cfg.get("resume")
    if ckpt is None or not mode or cfg.get("ckpt_path"):
        return
    run_dir = _run_dir_of(Path(ckpt))
    if run_dir is None:
        log.warning("resume=%s: %s has no config_resolved.yaml beside it: its config cannot be compared with this run's",
                    mode, ckpt)
        return
    saved_file = run_dir / "config_resolved.yaml"
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_file))
    except Exception as e:  # noqa: BLE001 - a file we cannot read is reported, not fatal
        log.warning("resume=%s: %s is unreadable (%s): the configs cannot be compared", mode, saved_file, e)
        return
    now = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    diffs = config_differences(saved, redact(now))
    if not diffs:
        return
    identity = {k: v for k, v in diffs.items() if not k.startswith(LAYOUT)}
    if identity:
        raise CheckpointError(
            f"resume={mode}: {ckpt} was written with another model/data config: {_describe(identity)}; resume with "
            f"the config it was written with ({saved_file}), or load it anyway with ckpt_path={ckpt}"
        )
    from dsdebug.findings import Finding, get_channel

    get_channel().report(Finding(
        check="checkpoint", severity="warning", code="resume_config_differs",
        message=f"resume={mode}: {Path(ckpt).name} was written with other settings: {_describe(diffs)}",
        advice="expected when you changed the world size, ZeRO stage or precision on purpose (the checkpoint is "
               f"converted or loaded as such); otherwise resume with the settings in {saved_file}",
        details={"checkpoint": str(ckpt), "keys": {k: [str(a), str(b)] for k, (a, b) in diffs.items()}},
    ))


# --------------------------------------------------------------------------- in place
def in_place_step(ckpt: str | None, output_dir: Path) -> int | None:
    """The checkpoint's global step when it lies in this run dir (the run continues in place)."""
    if ckpt is None or Path(output_dir).resolve() not in Path(ckpt).resolve().parents or not has_manifest(Path(ckpt)):
        return None  # (a checkpoint without a manifest does not say its step)
    return int(read_manifest(Path(ckpt)).get("global_step") or 0)


def prepare_loggers(cfg: DictConfig, ckpt: str | None, output_dir: Path) -> tuple[int | None, dict[str, dict]]:
    """Every rank, before the loggers are built: in place, the same W&B run and TensorBoard dir.
    Returns the step the run continues from in place (None: not in place) and, per logger name, the
    arguments that continue it (passed when the logger is built; the config is not written)."""
    output_dir = Path(output_dir)
    step = in_place_step(ckpt, output_dir)
    if step is None:
        return None, {}
    overrides: dict[str, dict] = {}
    for name, conf in (cfg.get("logger") or {}).items():
        target = str(conf.get("_target_", "")) if isinstance(conf, DictConfig) else ""
        args = overrides.setdefault(str(name), {})
        if target.endswith(("TensorBoardLogger", "CSVLogger")):
            args.update(_pinned_version(conf))
        if target.endswith("TensorBoardLogger"):
            args["purge_step"] = step  # SummaryWriter: hide events at or after it from the last attempt
        if target.endswith("WandbLogger") and not conf.get("id") and (output_dir / WANDB_ID_FILE).is_file():
            args["id"] = (output_dir / WANDB_ID_FILE).read_text().strip()
            log.info("resume: continuing W&B run %s", args["id"])
    return step, {name: args for name, args in overrides.items() if args}


def settle_run_dir(loggers: list[Any], output_dir: Path, step: int | None) -> None:
    """Rank 0, after the resume was accepted and before the loggers' first write: the previous
    attempt's end moves aside; in place, logged rows from the checkpoint's step on go (the CSV's
    too, which Lightning would delete whole); the W&B run's id is written down for the next attempt."""
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    output_dir = Path(output_dir)
    _archive_previous_attempt(output_dir)
    if step is not None:
        _trim_jsonl(output_dir / "history.jsonl", step)
    for logger in loggers:
        if isinstance(logger, CSVLogger) and step is not None:
            _continue_csv(logger, step)
        if isinstance(logger, WandbLogger):
            run_id = logger.experiment.id  # creates the run now, as log_hyperparams would
            (output_dir / WANDB_ID_FILE).write_text(f"{run_id}\n")


def _archive_previous_attempt(output_dir: Path) -> None:
    found = [output_dir / f for f in _ATTEMPT_FILES if (output_dir / f).is_file()]
    if not found:
        return
    dest = output_dir / "attempts" / str(1 + len(list((output_dir / "attempts").glob("*"))))
    dest.mkdir(parents=True, exist_ok=True)
    for path in found:
        shutil.move(str(path), dest / path.name)
    log.info("run dir %s had a previous attempt: its %s moved to %s", output_dir,
             ", ".join(p.name for p in found), dest)


def _trim_jsonl(path: Path, step: int) -> None:
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if row_step is None or row_step < step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def _pinned_version(conf: DictConfig) -> dict[str, int]:
    """An auto version (None) would start version_<n+1> in a resumed run: keep the newest."""
    if conf.get("version", None) is not None:
        return {}
    name = conf.get("name", "lightning_logs") or ""
    versions = [int(p.name.split("_")[1]) for p in Path(str(conf.save_dir), name).glob("version_*")
                if p.name.split("_")[1].isdigit()]
    return {"version": max(versions)} if versions else {}


def _continue_csv(logger: Any, step: int) -> None:
    path = Path(logger.log_dir) / "metrics.csv"
    if not path.is_file():
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or []), [r for r in reader if _csv_step(r) < step]
    with warnings.catch_warnings():  # "Previous log files ... will be deleted": not here, they are put back
        warnings.filterwarnings("ignore", message="Experiment logs directory")
        writer = logger.experiment  # Lightning's _ExperimentWriter deletes an existing metrics.csv here
    keys = sorted(header)  # the order Lightning writes
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=keys)
        out.writeheader()
        out.writerows(rows)
    writer.metrics_keys = keys  # later rows append under this header (or rewrite it with new keys)
    log.info("resume: %s keeps its %d rows before step %d", path, len(rows), step)


def _csv_step(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or -1)
    except ValueError:
        return -1
