"""Resume under another ZeRO stage or world size via DeepSpeed's universal checkpoint, and clear
errors where no conversion exists."""

from __future__ import annotations

import pytest
import torch

from dsdebug.checkpoint.integrity import write_manifest
from tests.helpers.bad_input import assert_one_line_error, cli_error_lines
from tests.helpers.runs import SMOKE, assert_ok, metrics, only_run_dir, run_train, train_losses
from tests.helpers.shared_runs import TWO_PROC, strategy_run


@pytest.fixture(scope="module")
def zero2_two_ranks(tmp_path_factory, shared_cache):
    """The shared 2-process zero2 run: 6 steps, checkpoints at 3 and 6."""
    return strategy_run("zero2", tmp_path_factory, shared_cache)[0]


@pytest.mark.slow  # a 2-process resume through DeepSpeed's universal checkpoint (the refusals run in-process below)
def test_zero2_checkpoint_resumes_under_zero1(zero2_two_ranks, tmp_path, shared_cache):
    ckpt = zero2_two_ranks / "checkpoints" / "step_000003.ckpt"
    proc = run_train(TWO_PROC + ["strategy=zero1", "export.fp32=false", f"ckpt_path={ckpt}"], tmp_path, shared_cache)
    assert_ok(proc)
    run = only_run_dir(tmp_path)
    assert (run / "resume" / "step_000003.ckpt" / "manifest.json").is_file()
    assert metrics(run)["zero_stage"] == 1 and metrics(run)["global_step"] == 6
    # weights, Adam moments and data position carried over: steps 3-5 match the zero2 run
    # (same data and math; only the reduction layout differs). Fresh moments would not.
    full, resumed = train_losses(zero2_two_ranks), train_losses(run)
    assert sorted(resumed) == [3, 4, 5]
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], rel=1e-4), (step, resumed[step], full[step])


@pytest.mark.parametrize("saved,now", [(2, "zero3"), (3, "zero2")])
def test_zero3_and_zero12_do_not_mix_and_say_why(saved, now, tmp_path, shared_cache, capsys):
    ckpt = _fake(tmp_path, "DebugDeepSpeedStrategy", saved, 2)
    lines = cli_error_lines(SMOKE + [f"strategy={now}", f"ckpt_path={ckpt}"], tmp_path / "logs", shared_cache, capsys)
    assert_one_line_error(lines, [str(ckpt), f"zero_stage={saved}", "ZeRO-3"])


@pytest.mark.slow  # resharding a real checkpoint onto another world size
def test_zero3_two_rank_checkpoint_resumes_on_one_rank(tmp_path_factory, tmp_path, shared_cache):
    from tests.helpers.shared_runs import healthy_run

    source, _ = healthy_run("zero3", tmp_path_factory, shared_cache)
    ckpt = source / "checkpoints" / "step_000003.ckpt"
    args = [a for a in TWO_PROC if a != "trainer=ddp_sim"] + ["strategy=zero3", "export.fp32=false"]
    assert_ok(run_train(args + [f"ckpt_path={ckpt}"], tmp_path, shared_cache))
    run = only_run_dir(tmp_path)
    m = metrics(run)
    assert m["world_size"] == 1 and m["zero_stage"] == 3 and m["global_step"] == 6
    losses = train_losses(run)
    assert sorted(losses) == [3, 4, 5]
    assert abs(losses[3] - train_losses(source)[3]) < 0.3, losses


def _fake(tmp_path, strategy, stage, world_size):
    if stage is None:
        ckpt = tmp_path / "step_000002.ckpt"
        torch.save({"state_dict": {}}, ckpt)
    else:
        ckpt = tmp_path / "step_000002.ckpt"
        (ckpt / "checkpoint").mkdir(parents=True)
        torch.save({}, ckpt / "checkpoint" / "mp_rank_00_model_states.pt")
        (ckpt / "latest").write_text("checkpoint")
    write_manifest(ckpt, {"global_step": 2, "world_size": world_size, "strategy": strategy, "zero_stage": stage})
    return ckpt


def test_ddp_checkpoint_under_deepspeed_says_how(tmp_path, shared_cache, capsys):
    ckpt = _fake(tmp_path, "DebugDDPStrategy", None, 2)
    lines = cli_error_lines(SMOKE + ["strategy=zero2", f"ckpt_path={ckpt}"], tmp_path / "logs", shared_cache, capsys)
    assert_one_line_error(lines, [str(ckpt), "DDP and DeepSpeed", "model=hf_pretrained"])


def test_reshard_off_says_how_to_convert(tmp_path, shared_cache, capsys):
    ckpt = _fake(tmp_path, "DebugDeepSpeedStrategy", 2, 4)
    lines = cli_error_lines(SMOKE + ["strategy=zero2", f"ckpt_path={ckpt}", "resume_reshard=false"], tmp_path / "logs",
                            shared_cache, capsys)
    assert_one_line_error(lines, ["world_size=4", "world_size=1", "ds_to_universal"])


@pytest.mark.parametrize("what,strategy,words", [
    ("text_file", "ddp", ["not a torch checkpoint"]),
    ("torch_file", "zero2", ["single-file (DDP) checkpoint", "strategy=ddp"]),
    ("ds_dir", "ddp", ["DeepSpeed checkpoint directory", "strategy=zero1|zero2|zero3"]),
])
def test_checkpoint_of_the_wrong_kind_is_one_line(what, strategy, words, tmp_path, shared_cache, capsys):
    """Checkpoints from elsewhere (no manifest) that this run's strategy cannot load."""
    if what == "text_file":
        ckpt = tmp_path / "notes.ckpt"
        ckpt.write_text("not a checkpoint\n")
    elif what == "torch_file":
        ckpt = tmp_path / "model.ckpt"
        torch.save({"state_dict": {}}, ckpt)
    else:
        ckpt = tmp_path / "step_000002.ckpt"
        (ckpt / "checkpoint").mkdir(parents=True)
        (ckpt / "latest").write_text("checkpoint")
    lines = cli_error_lines(SMOKE + [f"strategy={strategy}", f"ckpt_path={ckpt}"], tmp_path / "logs", shared_cache, capsys)
    assert_one_line_error(lines, [str(ckpt), *words])
