"""How gpu_check.py runs train.py (and the raw loop) and reads what a run wrote.

Each command runs in a session of its own under a time limit; its whole process group is stopped after (also
on timeout). A train.py run gets its own log dir and data cache (runs side by side must not share a tokenizer
cache); its run dir is read with ``dsdebug.report.load.load_run`` (findings, history, metrics) and its
checkpoints are deleted (a 0.6B model's are ~9 GB). ``write_logs`` packs every run's output and small run-dir
files into one archive: the device tool brings back at most 8 files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_command(name: str, cmd: list[str], work: Path, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` in its own session with a time limit; stop its whole process group after."""
    import signal

    log = work / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        full_env.pop(key, None)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=max(1.0, timeout)), False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    continue
    return {"name": name, "exit": rc, "timed_out": timed_out, "wall_s": round(time.monotonic() - started, 1),
            "log": str(log), "command": " ".join(cmd[1:])}


def train(name: str, overrides: list[str], work: Path, timeout: float, env: dict[str, str] | None = None) -> dict:
    log_dir = work / "runs" / name
    shutil.rmtree(log_dir, ignore_errors=True)
    cache = {"DSDEBUG_CACHE_DIR": str(work / "cache" / name)}  # side-by-side runs: no shared tokenizer cache
    result = run_command(name, [sys.executable, str(REPO / "train.py"), *overrides, f"paths.log_dir={log_dir}"],
                         work, timeout, {**cache, **(env or {})})
    dirs = sorted((log_dir / "train" / "runs").glob("*"))
    result["run_dir"] = str(dirs[-1]) if dirs else None
    if dirs:
        result.update(read_run(dirs[-1]))
        shutil.rmtree(dirs[-1] / "checkpoints", ignore_errors=True)  # a big model's are GBs, never read
    result["log_warnings"] = log_warnings(Path(result["log"]))
    return result


def read_run(run_dir: Path) -> dict[str, Any]:
    from dsdebug.report.load import load_run

    run = load_run(run_dir)
    loud = [{"check": f.get("check"), "code": f.get("code"), "severity": f.get("severity"), "step": f.get("step"),
             "message": str(f.get("message", ""))[:300]} for f in run.findings
            if f.get("severity") in ("warning", "error")]
    return {"status": run.status, "loud_findings": loud, "findings": run.findings, "history": run.history,
            "crash": run.crash}


# a log level or a Python warning class, not a config key ('on_error': 'warn', nccl_debug: WARN)
_WARN = re.compile(r"\bWARNING\b|[A-Z][A-Za-z]*Warning\b")
_STAMP = re.compile(r"^\[?[\d\-: ,.T]+\]?\s*")


def log_warnings(log: Path, limit: int = 15) -> list[str]:
    """Distinct lines of a run's output that say 'warning' (Python warnings, library log lines)."""
    seen: dict[str, None] = {}
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        if _WARN.search(line):
            seen.setdefault(_STAMP.sub("", line.strip())[:240], None)
        if len(seen) >= limit:
            break
    return list(seen)


def ok(run: dict) -> bool:
    return run.get("exit") == 0 and not run.get("timed_out")


def run_line(run: dict) -> str:
    if run.get("error"):
        return str(run["error"])
    if run.get("timed_out"):
        return f"timed out after {run['wall_s']} s"
    return f"exit {run.get('exit')} in {run.get('wall_s')} s"


def findings_of(run: dict, check: str, code: str | None = None) -> list[dict]:
    return [f for f in run.get("findings") or [] if f.get("check") == check and (code is None or f.get("code") == code)]


def series(run: dict, key: str) -> list[tuple[int, float]]:
    return list((run.get("history") or {}).get(key, []))


def write_logs(path: Path, work: Path, runs: dict[str, dict], limit: int = 12 * 2 ** 20) -> None:
    """The runs' outputs and small run-dir files in one archive (the device tool brings back 8 files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, run in runs.items():
            files = [Path(run["log"])] if run.get("log") else []
            if run.get("run_dir"):
                rd = Path(run["run_dir"])
                files += [rd / f for f in ("findings.jsonl", "metrics.json", "config_resolved.yaml", "train.log",
                                           "history.jsonl", "crash.json", "report.md")]
            for f in files:
                if f.is_file() and f.stat().st_size < 4 * 2 ** 20 and path.stat().st_size < limit:
                    tar.add(f, arcname=f"{name}/{f.name}")
