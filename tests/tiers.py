"""The slow tests CI runs (``make test-all``): every other ``slow`` test is ``extended`` (``make test-extended``).

CI has 90 minutes on 2 cores for setup and every test of ``make test-all``. Measured in a fresh clone on 2026-11-28
(this machine, 2 cores): the fast tier takes ~40 min of it, and the slow tests together ~100 min more (that day's
CI stopped at 66 % of them); a first list of 147 slow tests took 78 min of pytest (+4 min setup) in a fresh clone. So CI runs the slow
tests below (the 70 it dropped took >= 22 min of that run: ~56 min of pytest projected) and ``make test-extended`` the rest. Chosen per property, the cheapest test that holds it
where several do:

- the runs-that-go-wrong matrix's covering cells at 1 rank (every (case, preset), (case, strategy), (preset,
  strategy) pair; a check never kills the run it watches, issue 32); the 2-rank covering cells are extended, the
  cases that differ per rank run at 2 ranks in make test;
- one 200-step healthy run with every check on (Llama under ZeRO-3, ~90 s; the other families: extended);
- weight_norm's collapse named through ZeRO-3's partitions and DeepSpeed's param groups at 2 ranks (~80 s);
- layer_health's lost update (a clip 1e-7) named through ZeRO-3's partitions and DeepSpeed's clip at 2 ranks (~50 s);
- real DeepSpeed fp16: the scaler's overflows are not alarms, the planted NaN is named;
- the gradient scale under accumulation named when doubled;
- the rank rules: a check failing on one rank or inside a block of collectives, nan_triage's rerun on every rank;
- a public project with the checks installed (lightning-hydra-template); the ds_config corpus's settled values;
- launch: contradicting launcher variables are one line; a killed rank ends the job; two nodes' findings,
  timeline and secrets (one shared run); preemption resumes bitwise;
- the doctor on the default model at 2 ranks; LoRA under ZeRO-3 at 2 ranks; the console and a Ctrl-C report;
  an OOM as one line.

A pattern is an ``fnmatch`` pattern of node ids; tests/conftest.py refuses a pattern that matches no slow test
when the whole suite is collected (a renamed test would silently leave CI)."""

from __future__ import annotations

from fnmatch import fnmatch

TEST_ALL_SLOW = (
    "tests/trainer/test_runs_that_go_wrong.py::test_one_rank_every_preset_and_strategy*",
    "tests/callbacks/test_forensics_healthy.py::*[[]llama_zero3[]]",
    "tests/callbacks/test_fp16_loss_scale.py::test_real_deepspeed_fp16_overflows_*",
    "tests/trainer/test_accumulation.py::test_grad_scale_check_names_double_scaling",
    "tests/callbacks/test_cb_nan_triage.py::test_two_processes_zero2_all_ranks_rerun_together",
    "tests/callbacks/test_isolation.py::*",
    "tests/callbacks/test_plain_project.py::test_hydra_template_ddp_names_a_planted_nan",
    "tests/callbacks/test_cb_memory.py::test_planted_oom_is_one_error_line_*",
    "tests/config/test_ds_config_corpus.py::test_corpus_settles_batch_precision_and_deprecations",
    "tests/distributed/test_launch_env.py::*",
    "tests/distributed/test_rank_death.py::*[[]zero2-1[]]",
    "tests/distributed/test_multinode_consistency.py::*",
    "tests/doctor/test_doctor_runs.py::test_the_default_model_at_2_ranks_is_healthy",
    "tests/checkpoint/test_preemption.py::*[[]SIGTERM-0[]]",
    "tests/models/test_lora.py::test_lora_two_processes[[]zero3[]]",
    "tests/trainer/test_console.py::test_default_run_console_prints_each_line_once",
    "tests/report/test_report_runs.py::test_ctrl_c_run_report",
    "tests/callbacks/test_cb_weight_norm_runs.py::*[[]zero3-*",
    "tests/callbacks/test_cb_layer_update_lost_runs.py::*[[]zero3-*",
)


def in_test_all(nodeid: str) -> bool:
    """Whether a ``slow`` test runs in CI (``make test-all``)."""
    return any(fnmatch(nodeid, pattern) for pattern in TEST_ALL_SLOW)


def unmatched(slow_nodeids: list[str]) -> list[str]:
    """The patterns that match none of ``slow_nodeids``."""
    return [p for p in TEST_ALL_SLOW if not any(fnmatch(n, p) for n in slow_nodeids)]
