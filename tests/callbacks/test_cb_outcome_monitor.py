"""outcome_monitor: validation non-finite while training is finite, validation above an
untrained model's loss while training improves (memorisation vs an eval-mode bug, told apart by the
passes over the data), a growing train/val gap, a training loss too low to be true. Units on numbers,
then planted nets (tests/planted/outcome.py) in short in-process runs."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from dsdebug.callbacks.outcome_monitor import OutcomeMonitor
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel
from tests.helpers.runs import SMOKE, TINY_NET, train_in_process

LNV = math.log(4096)


def _trainer(step=10, epoch=0):
    return SimpleNamespace(global_step=step, global_rank=0, current_epoch=epoch, world_size=1)


def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"gap_evals": 1}, "gap_evals"), ({"low_fraction": 1.0}, "low_fraction"),
                        ({"memorise_epochs": 1}, "memorise_epochs")):
        with pytest.raises(ConfigError, match=f"callbacks.outcome_monitor.{key}=") as e:
            OutcomeMonitor(**kwargs)
        assert "\n" not in str(e.value)


def test_rules_fire_on_their_evidence_only(tmp_path):
    channel = configure_channel(tmp_path)
    om = OutcomeMonitor()
    om.prior = LNV
    healthy = [(7.9, 8.0), (7.0, 7.2), (6.2, 6.5), (5.9, 6.2), (5.6, 5.9)]
    for i, (train, val) in enumerate(healthy):
        assert om.judge(_trainer(10 * i), train, val, passes=1) == []
    assert om.judge(_trainer(60), 5.5, float("nan"), passes=1) == ["val_nonfinite"]
    # eval-mode bug: val above ln(vocab) while train learns, in 1 pass
    bug = OutcomeMonitor()
    bug.prior = LNV
    assert bug.judge(_trainer(), 6.0, 40.0, passes=1) == ["val_above_untrained"]
    assert "eval-mode bug" in channel.local[-1].message and "train/eval probe" in channel.local[-1].advice
    memo = OutcomeMonitor()
    memo.prior = LNV
    assert memo.judge(_trainer(epoch=9), 0.5, 11.0, passes=10)[0] == "val_above_untrained"
    assert "memorised" in channel.local[-1].message
    # gap growing 3 evaluations in a row to > 0.3 x train
    gap = OutcomeMonitor()
    gap.prior = LNV
    codes = [gap.judge(_trainer(s), t, v, passes=1) for s, (t, v) in enumerate([(5, 5.2), (4, 4.8), (3, 4.5)])]
    assert codes == [[], [], ["train_val_gap"]]
    none = OutcomeMonitor()  # no prior (not an LM): only the prior-free rules judge
    assert none.judge(_trainer(), 6.0, 40.0, passes=1) == []


def test_pretrained_weights_have_no_untrained_prior():
    """A fine-tune of pretrained weights may end below 0.1 ln(vocab): no leakage/untrained-loss judgement."""
    class Head:
        out_features = 4096

    def module(name_or_path):
        net = SimpleNamespace(get_output_embeddings=lambda: Head(), name_or_path=name_or_path)
        return SimpleNamespace(net=net, _losses={})

    for name, prior in (("", LNV), ("/models/llama-7b", None)):
        om = OutcomeMonitor()
        om.on_fit_start(SimpleNamespace(datamodule=None), module(name))
        assert om.prior == prior, name


def _run(tmp_path, cache, net, extra=()):
    run_dir = tmp_path / "run"
    train_in_process(SMOKE + [f"model.net._target_={net}", "+callbacks=outcome_monitor", "trainer.max_steps=8",
                              "export.fp32=false", "export.hf=false", *extra], run_dir, cache)
    rows = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]
    return [r for r in rows if r["check"] == "outcome_monitor"]


def test_planted_eval_mode_bug_is_named_at_the_first_validation(tmp_path, shared_cache):
    rows = _run(tmp_path, shared_cache, "tests.planted.outcome.EvalBugLM")
    loud = [(r["code"], r["step"]) for r in rows if r["severity"] != "info"]
    assert loud and loud[0] == ("val_above_untrained", 2), loud  # smoke validates at steps 2, 4, ...
    assert "eval-mode bug" in rows[0]["message"]
    # the rule ran the train/eval probe on the spot: it names where eval parts from train (the net's own forward)
    spot = [r for r in rows if r["code"] == "train_eval_on_the_spot"]
    assert len(spot) == 1 and spot[0]["severity"] == "error" and spot[0]["details"]["culprit"] == "<net>", spot


def test_planted_leak_is_loss_implausibly_low_and_healthy_is_silent(tmp_path, shared_cache):
    rows = _run(tmp_path / "leak", shared_cache, "tests.planted.outcome.PeekingLM", ["trainer.max_steps=4"])
    low = [r for r in rows if r["code"] == "loss_implausibly_low"]
    assert low and low[0]["step"] == 2 and "leakage" in low[0]["message"], [(r["code"], r["message"][:99]) for r in rows]
    spot = [r for r in rows if r["code"] == "causality_on_the_spot"]
    assert len(spot) == 1 and spot[0]["severity"] == "error" and "sees the future" in spot[0]["message"], spot
    healthy = _run(tmp_path / "healthy", shared_cache, TINY_NET[0].split("=", 1)[1], ["trainer.max_steps=30"])
    assert [r for r in healthy if r["severity"] != "info"] == []
