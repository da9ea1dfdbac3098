"""layer_health's ``layer_update_lost`` under the framework's strategies, 2 ranks each (``trainer=ddp_sim``): the
update is measured where each strategy keeps the weights (DDP's replicas, ZeRO-2's lp copies, ZeRO-3's partitions),
each layer's lr read from its optimizer group through DeepSpeed's wrappers, the clip threshold from the DeepSpeed
config's gradient_clipping or the Trainer's gradient_clip_val. Planted: an eps of 1 in the optimizer's config and a
clip threshold orders below the gradient norm, each named with its cause within the first 5 steps. Silence on healthy
runs: every debug=full run of the suite (tests/callbacks/test_forensics_healthy.py's 200-step families)."""

from __future__ import annotations

import pytest

from tests.helpers.findings import read_findings
from tests.helpers.runs import SMOKE, assert_ok, only_run_dir, run_train

STEPS = 8
BASE = SMOKE + ["trainer=ddp_sim", "+callbacks=layer_health", f"trainer.max_steps={STEPS}",
                f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1", "export.hf=false",
                "export.fp32=false"]
EPS = ["optim.optimizer.eps=1.0"]
CLIP = ["optim.grad_clip=1e-7"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,plant,cause", [("zero2", EPS, "eps"), ("zero3", CLIP, "clip"),
                                                  ("ddp", CLIP, "clip")])
def test_updates_lost_against_the_optimizer_are_named_at_2_ranks(strategy, plant, cause, tmp_path, shared_cache):
    proc = run_train([*BASE, f"strategy={strategy}", *plant], tmp_path, shared_cache, timeout=600)
    assert_ok(proc)
    found = read_findings(only_run_dir(tmp_path), "layer_health")
    hits = [f for f in found if f["code"] == "layer_update_lost"]
    assert len(hits) == 1, [(f["code"], f["message"][:300]) for f in found]
    f = hits[0]
    assert f["details"]["cause"] == cause and f["rank"] is None and f["step"] <= 4  # onset: the first steps
    assert len(f["details"]["layers"]) >= 5 and f["details"]["ratio"] < 0.01  # every block loses its step
    if cause == "eps":
        assert f["details"]["eps"] == 1.0 and "optim.optimizer.eps" in f["advice"]
    else:
        assert f["details"]["clip"] == pytest.approx(1e-7) and "optim.grad_clip" in f["advice"]
    summary = [f for f in found if f["code"] == "layer_summary"]
    assert len(summary) == 1 and summary[0]["details"]["min_update_vs_optimizer"] < 0.01
    assert set(f["details"]["layers"]) <= set(summary[0]["details"]["update_lost"][cause])
