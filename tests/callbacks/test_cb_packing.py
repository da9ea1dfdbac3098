"""The packing check (src/callbacks/packing.py) on real 1-process runs of a small DeepSeek-V3 over packed
short documents (paragraphs of CPython's pydoc topics, ~30 tokens each: every 128-token row holds
several). Healthy: silent, and its probe did run on rows of several documents with a change of ~0.
Each planted bug (tests/planted/packing.py) is named by its own code and no other error."""

from __future__ import annotations

import pytest

from tests.helpers.findings import of, one, read_findings
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, train_in_process
from tests.helpers.short_documents import short_documents_data, write_short_documents


@pytest.fixture(scope="module")
def short_corpus(tmp_path_factory):
    return write_short_documents(tmp_path_factory.mktemp("corpus") / "paragraphs.jsonl")


def _run(tmp_path, cache, corpus, *extra, steps=2):
    overrides = SMOKE + SMALL_DEEPSEEK + short_documents_data(corpus) + [
        "data.packing=true", "+callbacks=packing", "callbacks.packing.every_n_steps=1", f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "export.fp32=false", "export.hf=false", *extra]
    m = train_in_process(overrides, tmp_path / "run", cache)
    assert m["status"] == "completed" and m["global_step"] == steps
    return read_findings(tmp_path / "run", "packing")


def test_a_healthy_packed_run_is_silent_and_its_probe_ran(tmp_path, shared_cache, short_corpus):
    findings = _run(tmp_path, shared_cache, short_corpus)
    assert of(findings, "packing") == []
    summary = one(findings, "packing_summary")["details"]
    assert summary["probes"] == 2 and summary["leak_probes"] == 2  # rows of several documents were probed
    assert summary["leak_max"] < 1e-3 and summary["padding_max"] < 0.25
    assert summary["tokens_min"] > 0


@pytest.mark.parametrize("override, code, culprit", [
    ("data._target_=tests.planted.packing.PositionsRunOn", "positions_not_reset", "starts at a position other than 0"),
    ("data._target_=tests.planted.packing.LabelsCrossDocuments", "labels_cross_documents",
     "last token is trained to predict document"),
    ("model._target_=tests.planted.packing.MaskDroppedLM", "cross_document_attention", "moved document"),
])
def test_each_planted_bug_is_named_by_its_own_code(tmp_path, shared_cache, short_corpus, override, code, culprit):
    findings = _run(tmp_path, shared_cache, short_corpus, override, steps=1)
    errors = of(findings, "packing", severities=("error",))
    assert {f["code"] for f in errors} == {code}, errors
    first = errors[0]
    assert first["rank"] == 0 and culprit in first["message"] and "batch row" in first["message"]
    assert first["details"]["row"] >= 0


@pytest.mark.parametrize("rule", ["none", "linear"])
def test_tokens_per_step_beyond_what_the_lr_rule_assumes(tmp_path, shared_cache, short_corpus, rule):
    """One document per row with a token budget: the steps carry a variable number of tokens. With
    token_budget_lr=none the LR assumes every step is the reference: steps off by more than the
    tolerance are named; with linear the LR follows the tokens and nothing is reported."""
    findings = _run(tmp_path, shared_cache, short_corpus, "data.packing=false", "data.token_budget=512",
                    f"data.token_budget_lr={rule}", "callbacks.packing.tokens_tolerance=0.02")
    vary = [f for f in findings if f["code"] == "tokens_vary"]
    summary = one(findings, "packing_summary")["details"]
    assert summary["tokens_min"] < summary["tokens_max"] <= 512  # variable, within the budget (1 rank, no accumulation)
    if rule == "none":
        assert vary and all(abs(f["details"]["ratio"] - 1) > 0.02 for f in vary)
        assert vary[0]["details"]["reference"] == 512 and "data.token_budget_lr=none" in vary[0]["message"]
    else:
        assert vary == [] and of(findings, "packing") == []
