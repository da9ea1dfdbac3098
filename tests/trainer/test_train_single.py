"""One-process training through the real CLI: artifacts, learning, exports, loggers, resume."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import SMOKE, assert_ok, metrics, only_run_dir, run_dirs, run_train, train_in_process, train_losses


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, shared_cache):
    """The default config (ZeRO-2, tiny DeepSeek-V3, KJV), a few steps, TensorBoard + CSV."""
    log_dir = tmp_path_factory.mktemp("default")
    args = SMOKE + [
        "logger=many", "~logger.wandb", "trainer.max_steps=8", "trainer.val_check_interval=8",
        "callbacks.model_checkpoint.every_n_train_steps=4",
    ]
    proc = run_train(args, log_dir, shared_cache)
    assert_ok(proc)
    return log_dir, only_run_dir(log_dir), proc


def test_default_run_learns_and_writes_its_run_dir(default_run):
    _, run_dir, proc = default_run
    m = metrics(run_dir)
    assert m["status"] == "completed" and m["global_step"] == 8
    assert m["strategy"] == "DebugDeepSpeedStrategy" and m["zero_stage"] == 2
    # random init sits near ln(4096) = 8.3; 8 steps at lr 3e-3 must take it well below
    assert m["val/loss_at_start"] > 8.0
    assert m["val/loss"] < m["val/loss_at_start"] - 1.0
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "strategy" in (run_dir / "config_resolved.yaml").read_text()
    assert (run_dir / "train.log").stat().st_size > 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    assert ckpts == ["step_000004.ckpt", "step_000008.ckpt"]  # the last one is the final one
    assert (run_dir / "checkpoints" / "step_000008.ckpt" / "latest").is_file()  # DeepSpeed shards
    assert "run summary" in proc.stdout
    import csv

    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    aux = [float(r["train/aux_loss"]) for r in rows if r.get("train/aux_loss")]
    assert len(aux) == 8 and all(0.9 < a < 4.0 for a in aux)  # MoE balance loss, 1.0 = balanced
    lrs = [float(r["lr-AdamW/pg1"]) for r in rows if r.get("lr-AdamW/pg1")]
    assert lrs[0] < lrs[1] and max(lrs) == pytest.approx(3e-3, rel=1e-3)  # warmup up to the peak lr


def test_exports_reload_with_identical_outputs(default_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir, _ = default_run
    state = torch.load(run_dir / "export" / "model_fp32.pt", map_location="cpu", weights_only=True)["state_dict"]
    assert all(v.dtype == torch.float32 for v in state.values())
    hf = AutoModelForCausalLM.from_pretrained(run_dir / "export" / "hf")
    tok = AutoTokenizer.from_pretrained(run_dir / "export" / "hf")
    ids = torch.tensor([tok.encode("In the beginning God created the heaven")])
    for name, p in hf.named_parameters():
        assert torch.equal(p.detach(), state[f"net.{name}"]), name
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 4096) and torch.isfinite(logits).all()


def test_resume_latest_continues_from_the_newest_checkpoint(default_run, shared_cache):
    log_dir, first_dir, _ = default_run
    args = SMOKE + [
        "resume=latest", "trainer.max_steps=10", "export.fp32=false", "export.hf=false", f"paths.log_dir={log_dir}"]
    train_in_process(args, log_dir / "train" / "runs" / "resumed", shared_cache)
    second = [d for d in run_dirs(log_dir) if d != first_dir]
    assert len(second) == 1
    m = metrics(second[0])
    assert m["resumed_from"].endswith("step_000008.ckpt") and m["global_step"] == 10
    assert sorted(train_losses(second[0])) == [8, 9]  # only the two new steps were trained


@pytest.fixture(scope="module")
def small_hf_run(tmp_path_factory, shared_cache):
    """One 2-step run for three features that do not touch each other: a model loaded from a
    local save_pretrained dir, bf16-mixed, and the W&B logger offline with an API key in the
    environment, started from an empty working directory."""
    from dsdebug.models.deepseek import build_deepseek_v3

    root = tmp_path_factory.mktemp("small_hf")
    model_dir, cwd = root / "tiny_model", root / "cwd"
    build_deepseek_v3(vocab_size=4096, hidden_size=64, num_hidden_layers=2).save_pretrained(model_dir)
    cwd.mkdir()
    args = SMOKE + [
        "logger=many", "~logger.tensorboard", "model=hf_pretrained", f"model.net.name_or_path={model_dir}",
        "trainer.precision=bf16-mixed", "trainer.max_steps=2", "export.hf=false"]
    proc = run_train(args, root / "logs", shared_cache, env={"WANDB_MODE": "offline", "WANDB_API_KEY": "x" * 40},
                     cwd=cwd)
    assert_ok(proc)
    return only_run_dir(root / "logs"), cwd


def test_bf16_mixed_trains_on_cpu(small_hf_run):
    run_dir, _ = small_hf_run
    m = metrics(run_dir)
    losses = train_losses(run_dir)
    assert m["precision"] == "bf16-mixed" and sorted(losses) == [0, 1] and all(v < 9 for v in losses.values())


def test_wandb_offline_writes_inside_the_run_dir_only(small_hf_run):
    run_dir, cwd = small_hf_run
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run in the run dir"
    assert not (cwd / "wandb").exists() and list(cwd.iterdir()) == []
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and p.stat().st_size < 5_000_000
              and "x" * 40 in p.read_bytes().decode("utf-8", "ignore")]
    assert leaked == [], f"API key written to {leaked}"


def test_hf_pretrained_trains_from_a_local_save_pretrained_dir(small_hf_run):
    run_dir, _ = small_hf_run
    assert metrics(run_dir)["global_step"] == 2
    # the saved model (hidden size 64), not the default config's (256)
    state = torch.load(run_dir / "export" / "model_fp32.pt", map_location="cpu", weights_only=True)["state_dict"]
    assert state["net.model.embed_tokens.weight"].shape == (4096, 64)
