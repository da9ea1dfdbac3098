"""Any nn.Module whose forward takes input_ids and returns logits trains through the framework."""

from __future__ import annotations

from tests.helpers.runs import SMOKE, train_in_process


def test_own_network_with_gradient_accumulation_under_ddp(tmp_path, shared_cache):
    overrides = SMOKE + [
        "model.net._target_=tests.helpers.nets.TinyLM", "strategy=ddp", "trainer.accumulate_grad_batches=2",
        "trainer.max_steps=6", "trainer.val_check_interval=12", "optim.lr=1e-2", "export.hf=false"]
    m = train_in_process(overrides, tmp_path / "run", shared_cache)
    assert m["global_step"] == 6  # optimizer steps: 12 batches with accumulation 2
    assert m["val/loss"] < m["val/loss_at_start"] - 0.5
    assert (tmp_path / "run" / "export" / "model_fp32.pt").is_file()  # export.hf skipped: not a HF model
