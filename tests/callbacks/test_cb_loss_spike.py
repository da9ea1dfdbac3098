"""loss_spike: the detector (rolling median/MAD, joint with the grad norm), planted spikes named at
their step under warn, dropped under skip, rolled back under rollback (training goes on, the loss
recovers, skipped_batches.json), a resume that does not replay the skipped batches, and one
2-process run where every rank takes the same decision."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from dsdebug.checkpoint.rollback import convert_range, exclusions_for_resume, position_ranges
from dsdebug.callbacks.loss_spike import LossSpike
from dsdebug.callbacks.loss_spike.window import SpikeWindow
from dsdebug.data.resumable import ResumableDataLoader, ResumePosition
from dsdebug.errors import ConfigError
from tests.helpers.runs import SMOKE, TINY_NET, assert_ok, only_run_dir, run_train, train_in_process, train_losses
from tests.helpers.findings import read_findings
from tests.planted.grads import changed_params
from tests.planted.spike import read_batches


def loud(records: list[dict]) -> list[tuple]:
    return [(r["code"], r["step"]) for r in records if r["severity"] != "info"]


# ---- (c) config errors ---------------------------------------------------------------------------
def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"policy": "restart"}, "policy"), ({"window": 2}, "window"),
                        ({"z_threshold": 0}, "z_threshold"), ({"grad_ratio": 1.0}, "grad_ratio"),
                        ({"use_grad_norm": "yes"}, "use_grad_norm"), ({"max_rollbacks": -1}, "max_rollbacks")):
        with pytest.raises(ConfigError, match=f"callbacks.loss_spike.{key}=.*valid: ") as e:
            LossSpike(**kwargs)
        assert "\n" not in str(e.value)


# ---- (a) the detector ----------------------------------------------------------------------------
def _window(grad: bool = True) -> SpikeWindow:
    return SpikeWindow(window=20, warmup_steps=10, z_threshold=6.0, min_rel_jump=0.25, grad_ratio=3.0 if grad else None)


def test_falling_noisy_loss_is_silent_and_a_jump_is_a_spike():
    w, rng = _window(), random.Random(0)
    for step in range(200):  # early training: falling fast, then noisy (+-3%) plateau
        loss = 3.0 + 5.0 * math.exp(-step / 15) + rng.uniform(-0.1, 0.1)
        v = w.judge(loss, 1.0 + rng.uniform(-0.3, 0.3))
        assert not v["spike"], (step, v)
        w.push(step, loss, 1.0)
    v = w.judge(4.2, 1.0)  # x1.4 the median, far outside the noise
    assert v["spike"] and v["score"] >= 1 and "x1.39" in v["why"]
    assert not w.judge(3.3, 1.0)["spike"]  # within 25% of the median: not a spike however small the MAD
    assert w.judge(float("nan"), 1.0)["spike"]


def test_grad_norm_makes_a_half_size_jump_a_spike():
    w = _window()
    for step in range(30):
        w.push(step, 3.0 + 0.01 * (step % 3), 1.0)
    assert not w.judge(3.5, 1.1)["spike"]  # +17%: below min_rel_jump alone
    v = w.judge(3.5, 5.0)  # ... with the grad norm 5x its median: a spike
    assert v["spike"] and v["grad_ratio"] == pytest.approx(5.0)
    assert not _window(grad=False).judge(3.5, 5.0)["spike"]


def test_warmup_and_rollback_window():
    w = _window()
    for step in range(9):
        w.push(step, 3.0, 1.0)
    assert not w.judge(4.2, 1.0)["spike"]  # +40%: a spike for a warm window, not for the early rule (x2) ...
    assert w.judge(30.0, 1.0)["early"] and w.judge(30.0, 1.0)["spike"]  # ... which catches x10 before warm-up
    for step in range(9, 40):
        w.push(step, 3.0 if step < 20 else 9.0, 1.0)
    assert not w.judge(10.0, 1.0)["spike"]  # the window moved on to 9
    w.rollback_to(20)  # back to the window of the checkpoint at step 20
    assert w.judge(10.0, 1.0)["spike"]


# ---- the skip record and the data path ------------------------------------------------------------
def test_early_steps_judged_against_an_untrained_models_loss_then_a_short_history():
    """No history needed at step 0 (ln(vocab)); from 3 healthy steps a jump against the last 5."""
    lnv = math.log(4096)
    w = SpikeWindow(window=50, warmup_steps=20, z_threshold=6.0, min_rel_jump=0.25, grad_ratio=3.0, prior=lnv)
    assert not w.judge(lnv + 0.2, 1.0)["spike"]  # an untrained LM starts at ~ln(vocab)
    v = w.judge(36.7, 1.0)  # logits x20 / a loss scale / an LR blow-up: far above it at step 0
    assert v["spike"] and v["early"] and "untrained model's ln(vocab) = 8.318" in v["why"]
    healthy = [8.4, 8.3, 8.0, 7.4, 7.0, 6.7, 6.5]
    for step, loss in enumerate(healthy):  # the fast early fall is silent
        assert not w.judge(loss, 1.0 - 0.05 * step)["spike"], step
        w.push(step, loss, 1.0 - 0.05 * step)
    assert not w.judge(7.2, 0.8)["spike"]  # a bounce within the noise
    v = w.judge(8.9, 0.8)  # +27% on the median 7.0 and back above ln(vocab): worse than an untrained model (corrupt batch)
    assert v["spike"] and "back above an untrained model's" in v["why"]
    for gnorm in (None, 3.0):  # a verdict before any history has every key the late one has (policy=warn reads them)
        assert {"grad_norm", "grad_ratio", "z", "jump", "mad", "median"} <= set(
            SpikeWindow(50, 20, 6.0, 0.25, None, prior=lnv).judge(36.7, gnorm))
    unknown = SpikeWindow(window=50, warmup_steps=20, z_threshold=6.0, min_rel_jump=0.25, grad_ratio=None)
    assert not unknown.judge(36.7, None)["spike"]  # no prior (not an LM): step 0 is not judged
    for step in range(3):
        unknown.push(step, 2.0, None)
    assert not unknown.judge(3.5, None)["spike"] and unknown.judge(4.5, None)["spike"]  # x2 the last steps


EARLY_SPIKES = {  # planted bug -> its overrides (tests/planted/early.py, spike.py); the onset step is the key's
    ("logits_x20", 3): ["+callbacks.plant._target_=tests.planted.spike.SpikeLoss", "+callbacks.plant.steps=[3]"],
    ("lr_x1000", 8): ["+callbacks.plant._target_=tests.planted.early.LRBlowUp", "+callbacks.plant.step=8"],
    ("loss_scale_x1000", 12): ["+callbacks.plant._target_=tests.planted.early.LossScale", "+callbacks.plant.step=12"],
    # debug=light's setting (the loss alone): a spike before any history, policy=warn, finite loss. This
    # raised KeyError 'grad_norm' inside the check and killed `python train.py optim.lr=3.0` (issue 32)
    ("logits_x20_loss_only", 0): ["+callbacks.plant._target_=tests.planted.spike.SpikeLoss", "+callbacks.plant.steps=[0]",
                                  "callbacks.loss_spike.use_grad_norm=false"],
}


@pytest.mark.parametrize("bug", list(EARLY_SPIKES), ids=lambda b: f"{b[0]}@{b[1]}")
def test_spikes_in_the_first_steps_are_named_within_5_steps(bug, tmp_path, shared_cache):
    """Default warmup_steps=20: the window is not warm yet; the prior and the short history judge."""
    name, onset = bug
    run_dir = tmp_path / "run"
    train_in_process(SMOKE + TINY_NET + ["+callbacks=loss_spike", f"trainer.max_steps={onset + 3}", "export.hf=false",
                                         "export.fp32=false", "trainer.val_check_interval=100", *EARLY_SPIKES[bug]],
                     run_dir, shared_cache)
    found = read_findings(run_dir, "loss_spike")
    spikes = [s for c, s in loud(found) if c == "loss_spike"]
    assert spikes and onset <= spikes[0] <= onset + 5 and all(s >= onset for s in spikes), loud(found)
    assert "early rule" in found[0]["message"]


def test_skip_ranges_and_geometry():
    seen = [(s, 0, s) for s in range(8)] + [(s, 1, s - 8) for s in range(8, 12)]
    assert position_ranges(seen, 6, 10) == [(0, 6, 7), (1, 0, 2)]
    assert convert_range(4, 5, (1, 8), (2, 8)) == (2, 2)  # samples 32..47 -> 2-rank batch 2
    assert convert_range(4, 5, (2, 8), (1, 8)) == (8, 11)
    recs = [{"spike_step": 12, "world_size": 1, "batch_size": 8, "batches": [[0, 10, 12]]},
            {"spike_step": 3, "world_size": 1, "batch_size": 8, "batches": [[0, 1, 3]]}]
    assert exclusions_for_resume(recs, 10, (1, 8)) == [(0, 10, 12)]  # the step-3 one is behind step 10


def test_loader_drops_excluded_positions_and_counts_them():
    pos = ResumePosition(skip=2, excluded={0: [(3, 5)]})
    loader = ResumableDataLoader(list(range(10)), batch_size=1, shuffle=False, position=pos)
    got = [int(b) for b in loader]
    assert got == [2, 6, 7, 8, 9] and pos.dropped == 3
    assert [int(b) for b in loader] == [0, 1, 2, 6, 7, 8, 9]  # each epoch: excluded by epoch, skip once


# ---- (b) planted spikes in real runs ---------------------------------------------------------------
RUN = SMOKE + TINY_NET + [
    "+callbacks=loss_spike", "callbacks.loss_spike.warmup_steps=5", "callbacks.loss_spike.window=10",
    "export.hf=false", "export.fp32=false", "trainer.val_check_interval=100",
    "+callbacks.spike._target_=tests.planted.spike.SpikeLoss",
]


def test_warn_names_the_spike_step_and_batch(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    train_in_process(RUN + ["trainer.max_steps=14", "+callbacks.spike.steps=[11]"], run_dir, shared_cache)
    found = read_findings(run_dir, "loss_spike")
    assert loud(found) == [("loss_spike", 11)]  # onset step, nothing before (healthy steps are silent)
    spike = found[0]
    assert spike["severity"] == "warning" and "step 11 (epoch 0, batch 11)" in spike["message"]
    assert spike["details"]["score"] >= 1 and spike["details"]["grad_ratio"] > 3
    summary = [r for r in found if r["code"] == "loss_spike_summary"][0]
    assert summary["details"]["steps_checked"] == 14


def test_skip_drops_exactly_the_spike_updates(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    train_in_process(RUN + ["trainer.max_steps=13", "+callbacks.spike.steps=[10,11]",
                            "callbacks.loss_spike.policy=skip", "+callbacks.rec._target_=tests.planted.grads.ParamRecorder",
                            "+callbacks.rec.steps=[9,10,11,12]"], run_dir, shared_cache)
    found = read_findings(run_dir, "loss_spike")
    assert loud(found) == [("loss_spike_skipped", 10), ("loss_spike_skipped", 11)]
    assert changed_params(run_dir, 10) == [] and changed_params(run_dir, 11) == []  # ZeRO-2: dropped
    assert changed_params(run_dir, 9) and changed_params(run_dir, 12)  # the steps around them did update


def test_rollback_recovers_records_and_a_resume_does_not_replay(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    witness = ["+callbacks.witness._target_=tests.planted.spike.BatchWitness"]
    train_in_process(RUN + witness + ["trainer.max_steps=24", "+callbacks.spike.steps=[12,13]",
                                      "callbacks.loss_spike.policy=rollback",
                                      "callbacks.model_checkpoint.every_n_train_steps=5"], run_dir, shared_cache)
    found = read_findings(run_dir, "loss_spike")
    assert loud(found) == [("loss_spike_rollback", 12), ("loss_spike_rollback", 13)]
    first = found[0]
    assert "rolled back to step_000010.ckpt (step 10, verified)" in first["message"]
    assert "10..12 of epoch 0" in first["message"] and "step 12 (epoch 0, batch 12)" in first["message"]
    record = json.loads((run_dir / "skipped_batches.json").read_text())["rollbacks"]
    assert [r["batches"] for r in record] == [[[0, 10, 12]], [[0, 10, 13]]]
    losses = train_losses(run_dir)
    assert max(losses) == 23  # training went on to max_steps
    before = sorted(losses[s] for s in range(5, 12))[3]  # median of the window before the spike
    assert losses[12] > 3 * before  # the planted spike (logged, never applied)
    after = [losses[s] for s in range(18, 24)]
    assert max(after) < 1.1 * before  # recovered: back at (below) the pre-spike level
    # resume from the checkpoint before the spike: batch positions 10..13 are not replayed
    batches = {b["step"]: b["fp"] for b in read_batches(run_dir)}
    resumed = tmp_path / "resumed"
    train_in_process(RUN[:-1] + witness + ["trainer.max_steps=13",
                                           f"ckpt_path={run_dir}/checkpoints/step_000010.ckpt"], resumed, shared_cache)
    seen = read_batches(resumed)
    assert [b["fp"] for b in seen] == [batches[s] for s in (14, 15, 16)]  # what the rolled-back run trained on
    info = [r for r in read_findings(resumed, "loss_spike") if r["code"] == "loss_spike_resume_skip"]
    assert len(info) == 1 and "10..13 of epoch 0" in info[0]["message"]


@pytest.mark.slow
def test_two_ranks_take_the_same_decision(tmp_path, shared_cache):
    """2 processes, DDP: the spike is planted on rank 1 only; both ranks roll back together (no hang)."""
    proc = run_train(RUN + ["trainer=ddp_sim", "strategy=ddp", "trainer.max_steps=14", "+callbacks.spike.steps=[11]",
                            "+callbacks.spike.rank=1", "+callbacks.spike.factor=40", "callbacks.loss_spike.policy=rollback",
                            "callbacks.model_checkpoint.every_n_train_steps=5"], tmp_path, shared_cache)
    assert_ok(proc)
    run_dir = only_run_dir(tmp_path)
    found = read_findings(run_dir, "loss_spike")
    assert loud(found) == [("loss_spike_rollback", 11)]
    assert "largest local loss on rank 1" in found[0]["message"] and found[0]["details"]["top_rank"] == 1
    assert max(train_losses(run_dir)) == 13
    for rank in (0, 1):  # every rank dropped the update (lm_module's log line on each rank)
        log = (run_dir / ("train.log" if rank == 0 else "rank1.log"))
        assert "step 11: dropping this optimizer update" in Path(log).read_text(), rank


def test_a_rollback_that_fails_while_loading_ends_the_run(tmp_path, shared_cache, monkeypatch):
    """Isolation would switch loss_spike off and let a half-loaded model train on: a failure inside the
    rollback's load is reported (fatal: 'changing what trains') and ends the run instead."""
    from dsdebug.checkpoint import rollback as rb

    def broken(*args, **kwargs):
        raise OSError("planted: the checkpoint could not be read")

    monkeypatch.setattr(rb, "load_weights_and_optimizer", broken)
    monkeypatch.setenv("DSDEBUG_STRICT", "0")  # what a user gets
    run_dir = tmp_path / "run"
    with pytest.raises(OSError, match="planted"):
        train_in_process(RUN + ["trainer.max_steps=16", "+callbacks.spike.steps=[12]",
                                "callbacks.loss_spike.policy=rollback",
                                "callbacks.model_checkpoint.every_n_train_steps=5"], run_dir, shared_cache)
    failed = [f for f in read_findings(run_dir, "loss_spike") if f["code"] == "check_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 13, failed  # at the end of step 12's batch
    assert "changing what trains" in failed[0]["details"]["fatal"] and "the run stops here" in failed[0]["message"]
