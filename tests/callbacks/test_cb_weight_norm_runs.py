"""``weight_norm`` under the framework's strategies, 2 ranks each (``trainer=ddp_sim``): the weights' norms are
all-reduced from where each strategy keeps them (DDP's replicas, ZeRO-2's lp copies, ZeRO-3's partitions) and each
parameter is mapped to its optimizer group through DeepSpeed's wrappers. Planted: ``torch.optim.Adam`` with the
config's weight_decay (coupled L2, named as such with the key to change) and a shrink outside the optimizer
(tests/planted/degenerate.ShrinkWeights). Silence on healthy runs: every debug=full run of the suite (the shared
2-rank runs, tests/callbacks/test_forensics_healthy.py's 200-step families)."""

from __future__ import annotations

import pytest

from tests.helpers.findings import read_findings
from tests.helpers.runs import SMOKE, assert_ok, only_run_dir, run_train

STEPS = 16
BASE = SMOKE + ["trainer=ddp_sim", "+callbacks=weight_norm", "callbacks.weight_norm.read_every_n_steps=4",
                f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1",
                "export.hf=false", "export.fp32=false"]
ADAM = ["optim.optimizer._target_=torch.optim.Adam"]
SHRINK = ["+callbacks.plant._target_=tests.planted.degenerate.ShrinkWeights", "+callbacks.plant.match=mlp"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,plant,cause", [("zero2", ADAM, "coupled_l2"), ("zero3", ADAM, "coupled_l2"),
                                                  ("ddp", SHRINK, "outside")])
def test_collapsing_weights_are_named_with_their_cause_at_2_ranks(strategy, plant, cause, tmp_path, shared_cache):
    proc = run_train([*BASE, f"strategy={strategy}", *plant], tmp_path, shared_cache, timeout=600)
    assert_ok(proc)
    found = read_findings(only_run_dir(tmp_path), "weight_norm")
    hits = [f for f in found if f["code"] == "weight_collapse"]
    assert hits, [(f["code"], f["message"][:200]) for f in found]
    first = hits[0]
    assert first["details"]["cause"] == cause and first["rank"] is None  # one decision, written once
    assert first["step"] <= 12 and first["details"]["ratios"][0] > 0.35  # named close to its onset
    if cause == "coupled_l2":
        assert first["details"]["optimizer"] == "Adam" and first["details"]["weight_decay"] == 0.1
        assert "optim.optimizer._target_=torch.optim.AdamW" in first["advice"]
    else:
        assert all("mlp" in p for f in hits for p in f["details"]["params"])
    assert len([f for f in found if f["code"] == "weight_summary"]) == 1
