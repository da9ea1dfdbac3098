"""Shared benchmark machinery: compose a run's config, fit it in this process, time every step.

A benchmark "cell" (ZeRO stage x ranks) is one process group that fits many variants in turn,
each a fresh Trainer/model/data built exactly as ``train.py`` builds them (``entry.build``),
so the process start (~8 s of imports, the gloo rendezvous) is paid once per cell instead of
once per variant. With 2 ranks Lightning's launcher re-runs the same command line for rank 1;
both ranks walk the same variant list, so their fits pair up.

Timing: ``StepTimer`` stamps ``time.perf_counter()`` at the start of fit (``setup``), at
``on_train_start`` and at the end of every training batch (one optimizer step: no gradient
accumulation here). Step ``i`` takes ``end[i] - end[i-1]``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dsdebug.callbacks import is_debug_check

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# What every benchmark fit turns off because it is not what is measured: validation (no
# sanity pass, no val loop inside the window), the progress bar (a terminal cost), the final
# checkpoint/export (seconds of I/O after the window).
QUIET = [
    "trainer.limit_val_batches=0",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "~callbacks.rich_progress_bar",
    "export.fp32=false",
    "export.hf=false",
    "preemption.enabled=true",
]


def compose(overrides: list[str], output_dir: Path) -> Any:
    """The config ``train.py <overrides>`` would run, with its run dir set to ``output_dir``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    os.environ.setdefault("PROJECT_ROOT", str(REPO))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("train", overrides=[*overrides, f"paths.output_dir={output_dir}",
                                                 f"paths.work_dir={REPO}"])


class StepTimer:
    """A Lightning callback recording wall-clock stamps (perf_counter) around training steps, and
    the process's CPU time (user + sys of all its threads, ``time.process_time``) at the same
    points; at the end of fit every rank's CPU step times are gathered (``cpu_by_rank``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # build the Callback subclass lazily
        from lightning.pytorch.callbacks import Callback

        class _StepTimer(Callback):
            def __init__(self) -> None:
                self.t_setup = self.t_train_start = self.cpu_train_start = None
                self.ends: list[float] = []
                self.cpu_ends: list[float] = []
                self.cpu_by_rank: list[list[float]] = []

            def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
                self.t_setup = time.perf_counter()

            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                self.t_train_start = time.perf_counter()
                self.cpu_train_start = time.process_time()

            def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
                self.ends.append(time.perf_counter())
                self.cpu_ends.append(time.process_time())

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                import torch.distributed as dist

                stamps = [self.cpu_train_start, *self.cpu_ends]
                mine = [b - a for a, b in zip(stamps, stamps[1:])]
                if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
                    gathered: list[Any] = [None] * trainer.world_size
                    dist.all_gather_object(gathered, mine)  # COLLECTIVE: every rank, once, after the timed steps
                    self.cpu_by_rank = gathered
                else:
                    self.cpu_by_rank = [mine]

            def step_times(self) -> list[float]:
                stamps = [self.t_train_start, *self.ends]
                return [b - a for a, b in zip(stamps, stamps[1:])]

        return _StepTimer()


def time_hooks(callbacks: list[Any], timer: Any) -> dict[str, list[float]]:
    """Wrap every hook the debug callbacks (``dsdebug.callbacks.*``) override with a stopwatch.

    Returns callback name -> seconds spent in its hooks per training step (the step in progress
    when the hook ran, from ``timer``). Hook time and step time come from the same steps of the
    same fit, so their ratio -- the callbacks' direct cost -- does not move when the machine
    gets slower or faster between fits. Indirect costs (deterministic kernels, a wrapped
    collective, a log handler) are not in it; the A/B step-time comparison has those.
    """
    from lightning.pytorch.callbacks import Callback

    hooks = [n for n, f in vars(Callback).items() if callable(f) and not n.startswith("_")
             and n not in ("state_key", "state_dict", "load_state_dict")]
    spent: dict[str, list[float]] = {}
    for cb in callbacks:
        if not is_debug_check(type(cb).__module__):
            continue
        per_step = spent.setdefault(getattr(cb, "name", type(cb).__name__), [])
        for name in hooks:
            if getattr(type(cb), name, None) is getattr(Callback, name):
                continue  # not overridden: Lightning's no-op

            def timed(*args: Any, _fn: Any = getattr(cb, name), _acc: list = per_step, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    step = len(timer.ends)
                    _acc.extend([0.0] * (step + 1 - len(_acc)))
                    _acc[step] += time.perf_counter() - start

            setattr(cb, name, timed)
    return spent


def fit(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Fit one variant in this process, as train.py would build it; return its step timings."""
    import lightning as L

    from dsdebug.findings import configure_channel
    from dsdebug.checkpoint.checkpoints import FinalCheckpoint
    from dsdebug.config.prepare import prepare
    from dsdebug.trainer.entry import bind_config, build

    started = time.perf_counter()
    cfg = compose([*QUIET, *overrides], run_dir)
    plan = prepare(cfg)
    configure_channel(run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule, module, trainer, _, plan = build(plan)
    bind_config(trainer, plan)  # as trainer/entry.py _train, last before fit
    timer = StepTimer()
    # the final checkpoint is I/O after the timed window: leave it out of every variant alike
    trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, FinalCheckpoint)] + [timer]
    hook_s = time_hooks(trainer.callbacks, timer)
    trainer.fit(module, datamodule=datamodule)
    return {
        "wall_s": time.perf_counter() - started,
        "build_s": timer.t_setup - started,
        "setup_s": timer.t_train_start - timer.t_setup,
        "step_s": timer.step_times(),
        "cpu_step_s": timer.cpu_by_rank,  # per rank, CPU seconds of each step (same steps as step_s)
        # per debug callback, seconds inside its hooks per step (index 0 = setup .. step 0)
        "hook_s": {name: per_step for name, per_step in hook_s.items()},
        "world_size": trainer.world_size,
        "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len * trainer.world_size,
        "rank": trainer.global_rank,
        "callbacks": sorted({type(c).__name__ for c in trainer.callbacks} - {type(timer).__name__}),
    }


def window_stats(step_s: list[float], warmup: int, window: int, cadences: tuple[int, ...] = ()) -> dict[str, float]:
    """Steady-state numbers of one fit: the window is steps [warmup, warmup + window).

    ``steady_s`` = the window's median step + the excess of its periodic steps (steps that are a
    multiple of one of ``cadences``) over that median, spread over the window: periodic work is
    charged at its real rate, while a random slow step (another process on the machine) is
    not charged at all unless it lands on a periodic step. ``mean_s`` charges everything.
    """
    steps = step_s[warmup:warmup + window]
    if len(steps) < window:
        raise ValueError(f"fit ran {len(step_s)} steps, the window needs {warmup + window}")
    median = statistics.median(steps)
    periodic = [t for i, t in enumerate(steps, start=warmup) if any(i % c == 0 for c in cadences)]
    return {
        "steady_s": median + sum(max(0.0, t - median) for t in periodic) / len(steps),
        "mean_s": statistics.fmean(steps),
        "median_s": median,
        "warmup_s": sum(step_s[:warmup]),
    }


def rotated(items: list[str], k: int) -> list[str]:
    """Round ``k``'s order: the list rotated by k, so no variant always runs first or last."""
    k %= len(items)
    return items[k:] + items[:k]


def machine_info() -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "lightning", "deepspeed", "hydra-core", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "git": rev,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
