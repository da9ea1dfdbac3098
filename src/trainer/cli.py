"""The command line's errors: the composition precheck (one line for a bad override), and what an exception
that ended a run means (``classify``: status, exit code, one line) and leaves behind (``record_crash``:
crash.json, the report). The entry that uses them: src/train.py.

Exit codes: see dsdebug.errors (0 ok, 1 crashed or a failed sweep job, 2 bad input, 3 stopped by a check).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

from dsdebug.errors import ConfigError, fail, is_out_of_memory, missing_extra
from dsdebug.errors import is_rank_zero as _is_rank_zero

__all__ = ["classify", "composition_error", "find_config_error", "precheck_overrides", "record_crash",
           "reported_a_death"]

log = logging.getLogger(__name__)

_HYDRA_FLAGS_WITHOUT_VALUE = {"-m", "--multirun"}


def precheck_overrides(argv: list[str], config_dir: Path, config_name: str) -> None:
    """Compose the config with Hydra's compose API before ``@hydra.main`` runs, so an unknown
    group option, a misspelt key or a syntax error becomes one line naming it (Hydra's own
    report is several lines). The command line runs it for a sweep (``-m``): every job of a basic sweep is composed,
    before any runs; a single run is composed once, by ``@hydra.main``, its errors turned into the same line
    (src/train.py main, ``composition_error``)."""
    if any(a.startswith("-") and a not in _HYDRA_FLAGS_WITHOUT_VALUE for a in argv):
        return  # --cfg, --help, -cn ...: Hydra's own business
    overrides = [a for a in argv if not a.startswith("-")]
    multirun = any(a in _HYDRA_FLAGS_WITHOUT_VALUE for a in argv)
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        jobs = [overrides]
        if multirun:
            from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

            try:
                jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
            except Exception:  # sweeps a basic sweeper can't expand (interval, ...): check the rest
                jobs = [[o.input_line for o in parsed if not o.is_sweep_override()]]
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(config_dir), version_base="1.3"):
            composed = [compose(config_name, overrides=list(job), return_hydra_config=True) for job in jobs]
            from dsdebug.distributed.submitit_job import check_sweep, launcher_kind

            if multirun and launcher_kind(composed[0].hydra):  # each job's ranks vs the SLURM tasks asked for
                master = [o.input_line for o in parsed if not o.is_sweep_override()]  # what the launcher is built from
                check_sweep(compose(config_name, overrides=master, return_hydra_config=True), composed)
    except Exception as e:  # noqa: BLE001 - any composition failure is bad input
        fail(composition_error(e, argv, config_dir, config_name))
    finally:
        GlobalHydra.instance().clear()


def composition_error(e: BaseException, argv: list[str], config_dir: Path, config_name: str) -> str:
    """The one line for a config that did not compose (an unknown group option, a misspelt key, a syntax error):
    Hydra's message flattened, with the closest valid key when one is close."""
    overrides = [a for a in argv if not a.startswith("-")]
    text, hint = _flatten_hydra_error(e), _did_you_mean(str(e), overrides, config_dir, config_name)
    return text.rstrip(".") + hint if hint else text


_MISSING_KEY = re.compile(r"Could not (?:override|delete from config\.) '?([\w.\-]+)'")


def _did_you_mean(error: str, overrides: list[str], config_dir: Path, config_name: str) -> str:
    """'; did you mean trainer.max_steps?' for a key that is not in the config: the closest valid key
    (same section first, else any), from the config composed without that override. '' when none is close."""
    import difflib

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import DictConfig, OmegaConf

    match = _MISSING_KEY.search(error)
    if not match:
        return ""
    bad = match.group(1)
    rest = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != bad]
    try:
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(config_dir), version_base="1.3"):
            cfg = compose(config_name, overrides=rest)
    except Exception:  # noqa: BLE001 - another override is bad too: no suggestion
        return ""

    def keys(node: object, prefix: str = "") -> list[str]:
        if not isinstance(node, dict):
            return []
        out = []
        for k, v in node.items():
            full = f"{prefix}{k}"
            out += [full, *keys(v, f"{full}.")]
        return out

    container = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else {}
    valid = keys(container)
    parent, _, leaf = bad.rpartition(".")
    siblings = [k for k in valid if k.rpartition(".")[0] == parent] if parent else []
    close = [f"{parent}.{m}" for m in difflib.get_close_matches(leaf, [s.rpartition(".")[2] for s in siblings],
                                                                n=1, cutoff=0.6)] if siblings else []
    close = close or difflib.get_close_matches(bad, valid, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _flatten_hydra_error(e: Exception) -> str:
    text = str(e)
    text = text.replace("\n\t", ", ").replace(":,", ":")
    return " ".join(text.split())


def find_config_error(exc: BaseException | None) -> ConfigError | None:
    """The ConfigError behind an exception (Hydra's instantiate wraps them)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ConfigError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _summarize_findings_after_crash() -> None:
    """On a crash rank 0 still prints what the checks found (often the cause)."""
    if not _is_rank_zero():
        return
    from dsdebug.findings import get_channel

    channel = get_channel()
    if channel.read_all():
        channel.print_summary(status="crashed")  # never "healthy": the error line follows


def _unsafe_pickle(exc: BaseException) -> str | None:
    """A checkpoint file that torch.load(weights_only=True) refused: it carries code, not tensors."""
    import pickle

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, pickle.UnpicklingError):
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # torch bolds part of it
            first = text.splitlines()[0][:200] if text else ""
            return (f"checkpoint refused by torch.load(weights_only=True): it holds objects other than tensors "
                    f"and plain containers ({first}); load it only if you trust its source")
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _zero3_late_parameter(exc: BaseException) -> str | None:
    """DeepSpeed ZeRO-3 met a parameter it never partitioned (``'Parameter' object has no attribute 'ds_status'``,
    or ``ds_id``/``ds_tensor``...): one registered after the engine was built (a layer made on the first forward, a
    parameter replaced in a callback)."""
    if not isinstance(exc, AttributeError):
        return None
    found = re.search(r"'(?:Parameter|Tensor)' object has no attribute '(ds_(?:status|id|tensor|numel|shape|persist|"
                      r"active_sub_modules|process_group))'", str(exc))
    if found is None:
        return None
    return (f"DeepSpeed ZeRO-3 met a parameter it never partitioned (no '{found.group(1)}'): a parameter registered "
            "after the engine was built -- a layer made on the first forward, a parameter replaced after "
            "configure_optimizers; build every layer and parameter in __init__ (crash.json: the traceback)")


def _dead_rank(exc: BaseException) -> str | None:
    """After an exception: did a rank die? Rank 0 polls its children, a child checks its
    parent (our launcher); under any launcher the store's heartbeats name the dead rank and its
    host. If so, that is the story, not our traceback."""
    if "dsdebug.distributed.liveness" not in sys.modules:
        return None  # no rank was launched yet (e.g. a bad config caught by prepare)
    from dsdebug.distributed.liveness import dead_rank_message, parent_gone_message, peer_dead_message

    local = dead_rank_message() if _is_rank_zero() else parent_gone_message(wait_s=2.0)
    return local or peer_dead_message(exc)


def reported_a_death() -> bool:
    """This rank wrote the rank_died finding (e.g. rank 1 when rank 0 died): it says so too."""
    from dsdebug.distributed.liveness import state

    return bool(state.reported)


def classify(e: Exception) -> tuple[str, int, str | None]:
    """(status, exit code, one-line message; None = a bug: let the traceback out)."""
    if type(e).__name__ == "StoppedByCheck":
        return "stopped_by_check", e.exit_code, str(e)
    dead = _dead_rank(e)
    _summarize_findings_after_crash()
    if dead is not None:
        log.debug("stopped after a rank died", exc_info=True)
        return "rank_died", 1, f"{dead}; this rank stopped too ({' '.join(str(e).split())[:160]})"
    unsafe = _unsafe_pickle(e)
    if unsafe is not None:
        return "bad_input", 2, unsafe
    config_error = find_config_error(e) or missing_extra(e, "this run")
    if config_error is not None:
        log.debug("bad input", exc_info=True)
        return "bad_input", 2, str(config_error)
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if isinstance(e, MisconfigurationException):
        return "bad_input", 2, f"{type(e).__name__}: {e}"
    late = _zero3_late_parameter(e)
    if late is not None:  # a user-code fault with a known cause: one line (crash.json keeps the traceback)
        return "crashed", 1, late
    if is_out_of_memory(e):  # a resource limit, not a bug: one line (crash.json keeps the traceback)
        return "out_of_memory", 1, (f"out of memory ({' '.join(str(e).split())[:160]}); try a smaller data.batch_size, "
                                    "gradient checkpointing, a shorter data.seq_len, a higher ZeRO stage or offload "
                                    "(+callbacks=memory orders them for this run: findings.jsonl, code oom)")
    return "crashed", 1, None


def record_crash(status: str, code: int, error: str, exc: BaseException) -> None:
    """Rank 0 leaves ``crash.json`` in the run dir, then the report of the failed run."""
    if not _is_rank_zero():
        return
    try:
        import json
        import traceback

        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if not run_dir.is_dir():
            return
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
        record = {"status": status, "exit_code": code, "error": " ".join(error.split()),
                  "exception": type(exc).__name__, "traceback_tail": tb}
        (run_dir / "crash.json").write_text(json.dumps(record, indent=1))
    except Exception:  # noqa: BLE001 - never hide the original error
        log.debug("could not write crash.json", exc_info=True)
        return
    if status != "bad_input" and "dsdebug.trainer.entry" in sys.modules:  # a run that got going
        from dsdebug.report.finish import finish_run

        finish_run(run_dir)
