"""data.packing + data.token_budget on 2 CPU processes (DeepSpeed ZeRO-2, gloo), with the packing check:
the run trains (loss drops), every rank runs the same number of steps, the steps carry a variable
number of tokens within the budget, the LR rule is said in the log, and the check stays silent."""

from __future__ import annotations

import pytest

from tests.helpers.findings import csv_column, of, one, read_findings
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, assert_ok, only_run_dir, run_train, train_losses
from tests.helpers.short_documents import short_documents_data, write_short_documents

BUDGET = 512  # tokens per rank per step: rows of 128 -> 4 full rows, more when rows are short


def test_two_processes_train_packed_documents_with_a_token_budget(tmp_path, shared_cache):
    corpus = write_short_documents(tmp_path / "paragraphs.jsonl")
    proc = run_train(SMOKE + SMALL_DEEPSEEK + short_documents_data(corpus) + [
        "trainer=ddp_sim", "trainer.max_steps=8", "trainer.limit_val_batches=1", "optim.lr=3e-3",
        "data.packing=true", f"data.token_budget={BUDGET}", "data.token_budget_lr=sqrt",
        "+callbacks=packing", "callbacks.packing.every_n_steps=4", "export.fp32=false", "export.hf=false"],
        tmp_path / "logs", shared_cache)
    assert_ok(proc)
    run = only_run_dir(tmp_path / "logs")
    log = (run / "train.log").read_text()
    assert "data.token_budget_lr=sqrt (lr x sqrt(tokens / reference)), reference 1024 tokens per step" in log
    losses = train_losses(run)
    assert sorted(losses) == list(range(8)) and losses[7] < losses[0] - 0.3, losses
    tokens = csv_column(run, "packing/tokens_per_step")
    assert sorted(tokens) == list(range(8)) and all(0 < t <= 2 * BUDGET for t in tokens.values()), tokens
    scale = csv_column(run, "train/lr_scale")  # sqrt rule: the LR of each update follows its tokens
    assert sorted(scale) == list(range(8)), scale
    assert all(abs(scale[s] - (tokens[s] / 1024) ** 0.5) < 1e-6 for s in scale), (scale, tokens)
    findings = read_findings(run, "packing")
    assert of(findings, "packing") == []
    summary = one(findings, "packing_summary")["details"]
    assert summary["probes"] == 2 and summary["leak_probes"] == 2 and summary["leak_max"] < 1e-3


@pytest.mark.slow  # a second 2-process run (~20 s); each planted code is covered by the 1-process runs in make test
def test_a_bug_on_one_rank_is_named_with_that_rank(tmp_path, shared_cache):
    corpus = write_short_documents(tmp_path / "paragraphs.jsonl")
    proc = run_train(SMOKE + SMALL_DEEPSEEK + short_documents_data(corpus) + [
        "trainer=ddp_sim", "trainer.max_steps=2", "trainer.limit_val_batches=1", "data.packing=true",
        "data._target_=tests.planted.packing.PositionsRunOnRank1", "+callbacks=packing",
        "export.fp32=false", "export.hf=false"], tmp_path / "logs", shared_cache)
    assert_ok(proc)
    errors = of(read_findings(only_run_dir(tmp_path / "logs"), "packing"), "packing", severities=("error",))
    assert {f["code"] for f in errors} == {"positions_not_reset"} and {f["rank"] for f in errors} == {1}, errors
    assert errors[0]["message"].startswith("rank 1: batch row ")
