"""Sweeps through Hydra's submitit launchers (src/distributed/submitit_job.py): a submitit_local multirun
(one job preempted, checkpointed and requeued by submitit; W&B offline groups the jobs), the sbatch
script submitit_slurm submits (rendered by the real launcher, caught by a stand-in ``sbatch``), a
2-task SLURM job run by stand-in sbatch/srun as one 2-rank run, and the job shapes refused in one
line before anything is submitted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsdebug.trainer.cli import precheck_overrides
from tests.helpers import fake_slurm
from tests.helpers.runs import CONF, SMOKE, TINY_NET, assert_ok, run_train
from tests.helpers.findings import read_findings, wandb_records

JOB = SMOKE + [
    "trainer.max_steps=6", "trainer.val_check_interval=6", "trainer.limit_val_batches=1", "logger=wandb",
    "export.hf=false", "export.fp32=false", *TINY_NET,
]


def _sweep_dir(log_dir: Path) -> Path:
    dirs = list((log_dir / "train" / "multiruns").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


@pytest.mark.slow
def test_submitit_local_sweep_with_a_preempted_and_requeued_job(tmp_path, shared_cache):
    # job 0 is signalled at step 2 as submitit's controller signals a job near its time limit;
    # job 1 runs straight through. Both are submitit processes; W&B runs offline.
    args = ["-m", "hydra/launcher=submitit_local", *JOB, "+callbacks.plant._target_=tests.planted.submitit.SignalJobAtStep",
            "+callbacks.plant.step=2,-1"]
    proc = run_train(args, tmp_path, shared_cache, timeout=900, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert_ok(proc)
    sweep = _sweep_dir(tmp_path)
    assert not (tmp_path / "train" / "runs").exists(), "a job created a run dir of its own"
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert [(r["job"], r["status"]) for r in summary] == [(0, "completed"), (1, "completed")]
    assert all(isinstance(r["value"], float) for r in summary)
    job_ids = [r["job_id"] for r in summary]  # submitit's: each job was a submitit process
    assert len(set(job_ids)) == 2 and all((sweep / ".submitit" / i / f"{i}_0_result.pkl").is_file() for i in job_ids)
    for r in summary:
        job = sweep / str(r["job"])
        m = json.loads((job / "metrics.json").read_text())
        assert (m["status"], m["global_step"], m["world_size"]) == ("completed", 6, 1)
        assert (job / "report.md").is_file() and (job / "train.log").is_file()

    # job 0: the training got the signal from the job process, checkpointed at the step boundary,
    # then (only then) submitit requeued the job, which ran again in the same job dir
    job0 = sweep / "0"
    assert (job0 / "checkpoints" / "preempt_step_000002.ckpt" / "manifest.json").is_file()
    pre = [f for f in read_findings(job0) if f["code"] == "preempted"]
    assert len(pre) == 1 and pre[0]["details"]["signal"] == "SIGUSR2", pre
    submitit_log = "".join((sweep / ".submitit" / job_ids[0] / f"{job_ids[0]}_0_log.{s}").read_text() for s in ("out", "err"))
    assert "this job is preempted" in submitit_log and "Requeued job" in submitit_log, submitit_log[-3000:]
    assert not list((sweep / "1" / "checkpoints").glob("preempt_*")) and not (sweep / "1" / "planted_signal_sent").exists()

    # W&B: every run of the sweep in one group named after the sweep, one name per job
    groups, names = set(), {}
    for job in ("0", "1"):
        for run_file in (sweep / job / "wandb").glob("offline-run-*/run-*.wandb"):
            run = next(r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run")
            groups.add(run.run_group)
            names.setdefault(job, set()).add(run.display_name)
    assert groups == {f"train-{sweep.name}"}, groups
    assert names == {"0": {f"train-{sweep.name}-0"}, "1": {f"train-{sweep.name}-1"}}, names


@pytest.mark.slow  # a launcher (submitit's sbatch call)
def test_submitit_slurm_submits_one_job_array_of_multi_process_jobs(tmp_path, shared_cache):
    # a typical sweep: 3 learning rates, concurrent: 3 -> one array of 4 jobs, 3 at a time; each
    # job 2 nodes x 2 processes (its SLURM tasks are the ranks of one run)
    env, caught = fake_slurm.install(tmp_path)  # sbatch keeps the script and refuses it
    args = ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=30",
            "trainer.devices=2", "trainer.num_nodes=2", "optim.lr=1e-4,5e-5,1e-5,2e-5"]
    proc = run_train(args, tmp_path / "logs", shared_cache, timeout=300, env=env)
    assert proc.returncode != 0 and "sbatch: error: no cluster here" in proc.stderr, proc.stderr[-3000:]
    scripts = list(caught.glob("*.sh"))
    assert len(scripts) == 1, "one sbatch call for the whole sweep"
    text = scripts[0].read_text()
    flags = fake_slurm.sbatch_flags(text)
    expected = {"array": "0-3%3", "nodes": "2", "ntasks-per-node": "2", "partition": "debug", "time": "30",
                "signal": "USR2@90", "job-name": "train"}
    assert {k: flags.get(k) for k in expected} == expected, flags
    sweep = _sweep_dir(tmp_path / "logs")
    assert flags["output"].startswith(str(sweep / ".submitit"))
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and srun[0].endswith(f"-m submitit.core._submit {sweep / '.submitit' / '%j'}"), srun
    # every job's pickled call is there, waiting for its array task
    assert len(list((sweep / ".submitit").rglob("*.pkl"))) == 4


@pytest.mark.parametrize("overrides,message", [
    (["hydra/launcher=slurm", "trainer.devices=1,2"],
     "trainer.devices=2 x trainer.num_nodes=1 does not match hydra.launcher.tasks_per_node=1 x hydra.launcher.nodes=1"),
    (["hydra/launcher=submitit_slurm", "trainer=ddp_sim", "optim.lr=1e-3,2e-3"],
     "trainer.devices=2 x trainer.num_nodes=1 does not match hydra.launcher.tasks_per_node=1"),
    (["hydra/launcher=slurm", "trainer=multi_gpu", "optim.lr=1e-3,2e-3"], "trainer.devices=auto: under hydra/launcher=submitit_slurm"),
    (["hydra/launcher=slurm", "trainer=gpu", "optim.lr=1e-3,2e-3"], "hydra.launcher.gpus_per_node is not set"),
    (["hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "optim.lr=1e-3,2e-3"],
     "hydra.launcher.tasks_per_node=2: submitit_local would start that many independent copies"),
])
def test_job_shapes_the_launcher_cannot_run_are_one_line_before_submission(overrides, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        precheck_overrides(["-m", *overrides], CONF, "train")
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.slow
def test_the_tasks_of_a_slurm_job_are_the_ranks_of_one_run(tmp_path, shared_cache):
    # submitit_slurm on a stand-in sbatch/srun that run the job here: srun starts the job's 2 tasks
    # (submitit processes), each starts train.py with its SLURM_PROCID; Lightning's SLURM environment
    # makes them ranks 0 and 1 of ONE run, in the job's dir
    env, caught = fake_slurm.install(tmp_path, run=True)
    args = ["-m", "hydra/launcher=slurm", "trainer=ddp_sim", "strategy=ddp", "optim.lr=1e-3",
            *[a for a in JOB if a != "logger=wandb"], "logger=csv", "trainer.max_steps=3", "trainer.val_check_interval=3"]
    proc = run_train(args, tmp_path / "logs", shared_cache, timeout=600, env=env)
    assert_ok(proc)
    flags = fake_slurm.sbatch_flags(next(caught.glob("*.sh")).read_text())
    assert (flags["ntasks-per-node"], flags["nodes"]) == ("2", "1"), flags
    sweep = _sweep_dir(tmp_path / "logs")
    assert [p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")] == ["0"]
    job = sweep / "0"
    m = json.loads((job / "metrics.json").read_text())
    assert (m["status"], m["world_size"], m["global_step"]) == ("completed", 2, 3)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in (job / "rank1.log").read_text()  # the second task, in the same dir
    status = json.loads((job / "job_status.json").read_text())
    assert status["status"] == "completed" and len(list((sweep / ".submitit" / status["job_id"]).glob("*_result.pkl"))) == 2


def test_shapes_that_fit_pass(capsys):
    for overrides in (["hydra/launcher=slurm", "trainer=ddp_sim", "trainer.num_nodes=2", "optim.lr=1e-3,2e-3"],
                      ["hydra/launcher=slurm", "trainer=gpu", "hydra.launcher.gpus_per_node=1", "optim.lr=1e-3,2e-3"],
                      ["hydra/launcher=submitit_local", "trainer=ddp_sim", "optim.lr=1e-3,2e-3"]):
        precheck_overrides(["-m", *overrides], CONF, "train")
    assert capsys.readouterr().err == ""
