"""The slow tests CI runs (``make test-all``): every other ``slow`` test is ``extended`` (``make test-extended``).

CI has 90 minutes on 2 cores for setup and every test of ``make test-all``. The fast tier (``make test``) takes
~35 min of it; the slow tests all together took ~100 min more (the 2026-11-28 CI stopped at 66 % of them), so CI
runs the slow tests below (~30 min measured, docs/testing.md) and ``make test-extended`` the rest. Chosen per
property, the cheapest test that holds it where several do:

- the runs-that-go-wrong matrix's covering cells (a check never kills the run it watches; issue 32);
- 200-step healthy runs with every check on: three HF families under three strategies (Mixtral ZeRO-2, GPT-2 DDP,
  Llama ZeRO-3: 70-90 s each); the default DeepSeek model's (250-340 s each) are extended, its short healthy
  2-process runs are in make test (tests/callbacks/test_presets.py);
- real DeepSpeed fp16: the scaler's overflows are not alarms, the planted NaN is named;
- gradient accumulation k x b = one batch of k*b at 2 ranks under every strategy, and the double scaling named;
- the rank rules of the checks that make collectives (grad_monitor, loss_spike, nan_triage, replica_parity,
  moe_router under ZeRO at 2 ranks; a check failing on one rank or inside a block of collectives);
- a public project with the checks installed (lightning-hydra-template), one ds_config of the corpus at 2 ranks;
- launch: contradicting launcher variables are one line; a killed rank ends the job; two nodes' findings,
  timeline and secrets (one shared run); same seed, same curve at 2 ranks; preemption resumes bitwise;
- the doctor on the default model at 2 ranks; LoRA under ZeRO-3 at 2 ranks; the console and a Ctrl-C report;
  an OOM as one line.

A pattern is an ``fnmatch`` pattern of node ids; tests/conftest.py refuses a pattern that matches no slow test
when the whole suite is collected (a renamed test would silently leave CI)."""

from __future__ import annotations

from fnmatch import fnmatch

TEST_ALL_SLOW = (
    "tests/trainer/test_runs_that_go_wrong.py::*",
    "tests/callbacks/test_forensics_healthy.py::*[[]mixtral_zero2[]]",
    "tests/callbacks/test_forensics_healthy.py::*[[]gpt2_ddp[]]",
    "tests/callbacks/test_forensics_healthy.py::*[[]llama_zero3[]]",
    "tests/callbacks/test_fp16_loss_scale.py::test_real_deepspeed_fp16_overflows_*",
    "tests/trainer/test_accumulation.py::test_accumulation_equals_one_big_batch[[]*-2[]]",
    "tests/trainer/test_accumulation.py::test_grad_scale_check_names_double_scaling",
    "tests/callbacks/test_cb_grad_monitor.py::test_zero3_two_processes_*",
    "tests/callbacks/test_cb_loss_spike.py::test_two_ranks_take_the_same_decision",
    "tests/callbacks/test_cb_nan_triage.py::test_two_processes_zero2_all_ranks_rerun_together",
    "tests/callbacks/test_cb_replica_parity.py::test_zero3_silent_while_healthy_*",
    "tests/callbacks/test_cb_moe_router.py::test_two_processes_zero3_*",
    "tests/callbacks/test_isolation.py::*",
    "tests/callbacks/test_plain_project.py::test_hydra_template_ddp_names_a_planted_nan",
    "tests/callbacks/test_cb_memory.py::test_planted_oom_is_one_error_line_*",
    "tests/config/test_ds_config_corpus.py::test_corpus_config_trains_two_processes[[]hf_zero3.json[]]",
    "tests/config/test_ds_config_corpus.py::test_corpus_settles_batch_precision_and_deprecations",
    "tests/distributed/test_launch_env.py::*",
    "tests/distributed/test_rank_death.py::*[[]zero2-1[]]",
    "tests/distributed/test_multinode_consistency.py::*",
    "tests/distributed/test_distributed.py::test_same_seed_same_config_gives_identical_loss_curve",
    "tests/doctor/test_doctor_runs.py::test_the_default_model_at_2_ranks_is_healthy",
    "tests/checkpoint/test_preemption.py::*[[]SIGTERM-0[]]",
    "tests/models/test_lora.py::test_lora_two_processes[[]zero3[]]",
    "tests/trainer/test_console.py::test_default_run_console_prints_each_line_once",
    "tests/report/test_report_runs.py::test_ctrl_c_run_report",
)


def in_test_all(nodeid: str) -> bool:
    """Whether a ``slow`` test runs in CI (``make test-all``)."""
    return any(fnmatch(nodeid, pattern) for pattern in TEST_ALL_SLOW)


def unmatched(slow_nodeids: list[str]) -> list[str]:
    """The patterns that match none of ``slow_nodeids``."""
    return [p for p in TEST_ALL_SLOW if not any(fnmatch(n, p) for n in slow_nodeids)]
