"""A one-machine stand-in for ``sbatch`` and ``srun``: `install` puts both on a PATH for a test.

``sbatch FILE``: keeps a copy of FILE in ``$FAKE_SBATCH_DIR``; with ``FAKE_SLURM_RUN=1`` it answers
"Submitted batch job N" and runs the job (every array task, one after the other) in the background
as SLURM would: the batch script with SLURM_JOB_ID, SLURM_ARRAY_*, SLURM_NNODES, ... set. Otherwise
it refuses the job. ``srun [--unbuffered] --output O --error E CMD...``: starts nodes x
ntasks-per-node copies of CMD with SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID, as srun does inside a job.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def sbatch_flags(script: str) -> dict[str, str]:
    return dict(line[len("#SBATCH --"):].split("=", 1) for line in script.splitlines() if line.startswith("#SBATCH --"))


def sbatch(path: str) -> int:
    shutil.copy(path, os.environ["FAKE_SBATCH_DIR"])
    if os.environ.get("FAKE_SLURM_RUN") != "1":
        print("sbatch: error: no cluster here", file=sys.stderr)
        return 1
    job_id = 4000 + os.getpid() % 1000
    print(f"Submitted batch job {job_id}", flush=True)
    subprocess.Popen([sys.executable, __file__, "--run-job", path, str(job_id)], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return 0


def run_job(path: str, job_id: int) -> int:
    flags = sbatch_flags(Path(path).read_text())
    nodes, per_node = int(flags.get("nodes", 1)), int(flags.get("ntasks-per-node", 1))
    env = {**os.environ, "SLURM_JOB_NAME": flags.get("job-name", "fake"), "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_NTASKS": str(nodes * per_node),
           "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost"}
    array = re.match(r"0-(\d+)", flags.get("array", ""))
    tasks = range(int(array.group(1)) + 1) if array else [None]
    for task in tasks:
        task_env = {**env, "SLURM_JOB_ID": str(job_id if task is None else job_id + 1 + task)}
        if task is not None:
            task_env.update(SLURM_ARRAY_JOB_ID=str(job_id), SLURM_ARRAY_TASK_ID=str(task))
        subprocess.run(["bash", path], env=task_env)
    return 0


def srun(argv: list[str]) -> int:
    out = err = None
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag in ("--output", "--error"):
            value = argv.pop(0)
            out, err = (value, err) if flag == "--output" else (out, value)
    env = os.environ
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    job = env["SLURM_JOB_ID"]
    per_node, ntasks = int(env["SLURM_NTASKS_PER_NODE"]), int(env["SLURM_NTASKS"])

    def path(pattern: str, rank: int) -> str:
        return (pattern.replace("%A", array_job or job).replace("%a", array_task or "").replace("%j", job)
                .replace("%t", str(rank)))

    procs = []
    for rank in range(ntasks):
        task_env = {**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node),
                    "SLURM_NODEID": str(rank // per_node)}
        Path(path(out, rank)).parent.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen(argv, env=task_env, stdout=open(path(out, rank), "a"),
                                      stderr=open(path(err or out, rank), "a")))
    return max(p.wait() for p in procs)


def install(tmp_path: Path, run: bool = False) -> tuple[dict[str, str], Path]:
    """(env with ``sbatch``/``srun`` first on PATH, the folder where submitted scripts are kept)."""
    bin_dir, caught = tmp_path / "fake_slurm_bin", tmp_path / "sbatch_scripts"
    bin_dir.mkdir()
    caught.mkdir()
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).write_text(f'#!/bin/sh\nexec "{sys.executable}" "{__file__}" {tool} "$@"\n')
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SBATCH_DIR": str(caught),
           "FAKE_SLURM_RUN": "1" if run else "0"}
    return env, caught


if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    if tool == "--run-job":
        sys.exit(run_job(args[0], int(args[1])))
    sys.exit(sbatch(args[0]) if tool == "sbatch" else srun(args))
