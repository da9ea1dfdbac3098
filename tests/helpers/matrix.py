"""The matrix of runs that go wrong (issue 32): every preset x strategy x 1 and 2 ranks x a run that
diverges, goes non-finite or is degenerate, and each case resumed from its last checkpoint once. Strict
mode is on (tests/conftest.py): a check that raises ends its run, and the cell fails naming it.

The runs are many and short, so they do not each pay a process start: one *worker* process (``python
tests/helpers/matrix.py``; under ``torch.distributed.run --nproc_per_node 2`` for 2 ranks) trains every
cell it is given one after the other through the real ``train(cfg)`` (the same process group for all of
them), and writes one JSON line per cell and rank: how the run ended, the exception if ``train`` raised,
the findings. The tests (tests/trainer/test_runs_that_go_wrong.py) start a worker per tier and rank count
once per session and read its lines. The report's figures are not drawn in the worker (matplotlib is the
slowest part of a short run's end, and what is tested is the checks); the rules and the report text are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script (the worker)
    sys.path.insert(0, str(REPO))

from tests.helpers.runs import SMOKE, TINY_NET  # noqa: E402

PRESETS = ("none", "light", "full")
STRATEGIES = ("ddp", "zero2", "zero3")
_PLANT = "+callbacks.plant._target_=tests.planted.degenerate."
# 4 steps, a checkpoint every 2 (the resume restarts from step 4 and trains to 6), validation at the end;
# 4 sequences of 32 tokens: a step costs ~20 ms, the run's time is the framework's and the checks'
BASE = SMOKE + TINY_NET + ["data.seq_len=32", "data.batch_size=4", "trainer.max_steps=4", "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
                           "callbacks.model_checkpoint.every_n_train_steps=2", "export.hf=false",
                           "export.fp32=false"]
# case -> (overrides, what a check must have said with debug=light/full: a (check, code) prefix match over the
# warnings and errors, or None when the run is healthy or the case is about surviving only). {last} is the
# last rank.
CASES: dict[str, tuple[list[str], str | None]] = {
    "lr_3": (["optim.lr=3.0"], "advisor/lr_too_high"),
    "lr_1e3": (["optim.lr=1e3"], "advisor/lr_too_high"),
    "nan_loss_step0": ([_PLANT + "LossAt", "+callbacks.plant.kind='nan'", "+callbacks.plant.step=0",
                        "+callbacks.plant.through=times"], "nonfinite"),  # loss and gradients NaN
    "inf_loss_step2": ([_PLANT + "LossAt", "+callbacks.plant.kind='inf'", "+callbacks.plant.step=2"],
                       "nonfinite"),  # the loss alone: its gradients stay finite
    "nan_in_one_ranks_batch": ([_PLANT + "NaNInBatch", "+callbacks.plant.step=1", "+callbacks.plant.rank={last}"],
                               "nonfinite"),
    "all_frozen": ([_PLANT + "FreezeAll"], None),
    "all_labels_ignored": ([_PLANT + "AllLabelsIgnored"], "data_inspector/labels_all_ignored"),
    "eval_mode_left": ([_PLANT + "EvalAt", "+callbacks.plant.step=1"], "train_mode/eval_mode_in_training"),
    "param_outside_optimizer": ([_PLANT + "WeightOutsideOptimizer"], "optimizer_coverage/not_in_optimizer"),
    "zero_loss": ([_PLANT + "LossAt", "+callbacks.plant.kind=zero", "+callbacks.plant.every=true"],
                  "outcome_monitor/loss_implausibly_low"),
    "batch_of_one": (["data.batch_size=1"], None),
    "seq_len_2": (["data.seq_len=2"], None),
    "no_validation": (["trainer.limit_val_batches=0"], None),
    "one_step": (["trainer.max_steps=1", "trainer.val_check_interval=1"], None),
    # every check's cadence (every_n_steps, windows, warm-ups: 5..50 steps) is longer than the run
    "shorter_than_every_cadence": (["trainer.max_steps=2", "trainer.val_check_interval=2"], None),
}
ENDINGS = ("completed", "bad_input")  # a run ends as trained, or refused with one line before training


def cell_id(case: str, preset: str, strategy: str, resume: bool = False) -> str:
    return f"{case}-{preset}-{strategy}" + ("-resume" if resume else "")


def overrides(case: str, preset: str, strategy: str, world: int) -> list[str]:
    args, _ = CASES[case]
    world_args = ["trainer=ddp_sim"] if world > 1 else []
    return [*BASE, *world_args, f"debug={preset}", f"strategy={strategy}",
            *(a.replace("{last}", str(world - 1)) for a in args)]


def resume_overrides(case: str, preset: str, strategy: str, world: int, first_run: Path) -> list[str] | None:
    """The same run again from the first run's newest checkpoint, 2 more steps; None without a checkpoint."""
    folder = first_run / "checkpoints"
    ckpts = sorted(folder.glob("step_*.ckpt")) or sorted(folder.glob("last.ckpt"))  # every 2 steps, else the final
    if not ckpts:
        return None
    steps = 1 if case == "one_step" else 2 if case == "shorter_than_every_cadence" else 4
    return [*overrides(case, preset, strategy, world), f"ckpt_path={ckpts[-1]}", f"trainer.max_steps={steps + 2}",
            f"trainer.val_check_interval={steps + 2}"]


# ---- the worker -----------------------------------------------------------------------------------
def _run_cell(args: list[str], run_dir: Path, cache: Path) -> dict[str, Any]:
    import logging

    from dsdebug.errors import ConfigError
    from tests.helpers.runs import train_in_process

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:  # the report's rules/sections that failed
            if record.levelno >= logging.WARNING and record.name.startswith("dsdebug.report"):
                warnings.append(record.getMessage())

    handler = Keep()
    logging.getLogger("dsdebug.report").addHandler(handler)
    started = time.time()
    out: dict[str, Any] = {}
    try:
        metrics = train_in_process(args, run_dir, cache)
        out.update(status=metrics.get("status"), global_step=metrics.get("global_step"),
                   resumed_from=metrics.get("resumed_from"))
    except ConfigError as e:
        out.update(status="bad_input", error=str(e))
    except BaseException as e:  # noqa: BLE001 - recorded: the test names the cell and the exception
        out.update(status="crashed", error=f"{type(e).__name__}: {e}",
                   traceback="".join(traceback.format_exception(type(e), e, e.__traceback__)[-12:]))
    finally:
        logging.getLogger("dsdebug.report").removeHandler(handler)
    path = run_dir / "findings.jsonl"
    findings = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    out.update(seconds=round(time.time() - started, 2), findings=len(findings), report_warnings=warnings,
               loud=sorted({(f["check"], f["code"], f["severity"]) for f in findings
                            if f["severity"] in ("warning", "error")}))
    return out


def work(plan: list[dict[str, Any]], out_dir: Path, cache: Path) -> None:
    """Train every cell of ``plan`` in this process (one rank of the worker), a JSON line per cell."""
    import torch

    from dsdebug.report import plots

    plots.FIGURES = {}  # see the module docstring
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.set_num_threads(1)
    results = out_dir / f"results_rank{rank}.jsonl"
    first_runs: dict[str, Path] = {}
    for cell in plan:
        case, preset, strategy, resume = cell["case"], cell["preset"], cell["strategy"], cell.get("resume", False)
        name = cell_id(case, preset, strategy, resume)
        run_dir = out_dir / name
        with open(out_dir / f"progress_rank{rank}.txt", "a") as f:
            f.write(name + "\n")
        if resume:
            first = first_runs.get(cell_id(case, preset, strategy))
            args = resume_overrides(case, preset, strategy, world, first) if first is not None else None
            if args is None:
                record = {"status": "no_checkpoint"}
            else:
                record = _run_cell(args, run_dir, cache)
        else:
            record = _run_cell(overrides(case, preset, strategy, world), run_dir, cache)
            first_runs[name] = run_dir
        record.update(cell=name, rank=rank, world=world)
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")


# ---- what the tests call -----------------------------------------------------------------------------
def run_worker(plan: list[dict[str, Any]], world: int, out_dir: Path, cache: Path, timeout: int) -> dict[str, dict]:
    """Start a worker over ``plan`` (``world`` ranks), wait, and return {cell id: rank 0's record, with every
    rank's status under ``ranks``}. A worker that hangs is killed; the cells it did not finish are missing
    and the one it was in is named under ``"_hung"``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "DSDEBUG_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", "DSDEBUG_STRICT": "1",
           "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    script = [str(Path(__file__).resolve()), str(out_dir), str(cache)]
    if world > 1:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(port), *script]
    else:
        cmd = [sys.executable, *script]
    log = open(out_dir / "worker.log", "w")
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        hung = None
    except subprocess.TimeoutExpired:
        proc, hung = None, True
    finally:
        log.close()
    records: dict[str, dict] = {}
    for rank in range(world):
        path = out_dir / f"results_rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.is_file() else []:
            r = json.loads(line)
            if rank == 0:
                records[r["cell"]] = {**r, "ranks": {}}
            records.setdefault(r["cell"], {"cell": r["cell"], "ranks": {}})["ranks"][rank] = r["status"]
    if hung or (proc is not None and proc.returncode != 0):
        progress = out_dir / "progress_rank0.txt"
        last = progress.read_text().split()[-1] if progress.is_file() and progress.read_text().split() else "?"
        records["_hung"] = {"cell": last, "returncode": None if proc is None else proc.returncode,
                            "log": (out_dir / "worker.log").read_text()[-4000:]}
    return records


if __name__ == "__main__":
    _out, _cache = Path(sys.argv[1]), Path(sys.argv[2])
    work(json.loads((_out / "plan.json").read_text()), _out, _cache)
