"""model.gradient_checkpointing at 2 ranks (train.py, trainer=ddp_sim): the training curve is BITWISE the
curve without it, under ZeRO-3 (make test) and DDP / ZeRO-1 / ZeRO-2 (make test-all). Every step's loss
after the first depends on the previous steps' gradients (Adam), so equal curves mean equal gradients.
The runs leave the grad_checkpointing check out: its measurement allocates, and CPU matmul rounding
follows buffer alignment (docs/toolbox.md), so a run with the check is equal only to float rounding.
A 2-rank run of the check itself: the planted routing bug is named on both ranks (make test-all)."""

from __future__ import annotations

import pytest

from tests.helpers.findings import of, read_findings
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, assert_ok, only_run_dir, run_train, train_losses

BASE = SMOKE + [*SMALL_DEEPSEEK, "model.net.num_hidden_layers=3", "trainer=ddp_sim", "trainer.max_steps=3",
                "trainer.limit_val_batches=0", "export.hf=false"]
_curves: dict[tuple[str, str, bool], dict[int, float]] = {}


def _curve(strategy: str, mode: str, aux: bool, tmp_path_factory, cache) -> dict[int, float]:
    if (strategy, mode, aux) not in _curves:
        log_dir = tmp_path_factory.mktemp(f"ckpt_{strategy}_{mode}")
        args = [f"strategy={strategy}", f"model.gradient_checkpointing={mode}"] + ([] if aux else
                                                                                   ["model.moe_aux_loss_coef=0"])
        assert_ok(run_train(BASE + args, log_dir, cache))
        _curves[strategy, mode, aux] = train_losses(only_run_dir(log_dir))
    return _curves[strategy, mode, aux]


def _equal(strategy: str, mode: str, tmp_path_factory, cache) -> None:
    # reentrant: the MoE balancing loss gets no gradient (the forward runs under no_grad; the check reports
    # reentrant_aux_loss_no_grad), so those curves are compared without it
    aux = mode != "reentrant"
    off = _curve(strategy, "false", aux, tmp_path_factory, cache)
    on = _curve(strategy, mode, aux, tmp_path_factory, cache)
    assert len(off) == 3 and on == off, (off, on)


def test_zero3_reentrant_trains_bitwise_like_no_checkpointing(tmp_path_factory, shared_cache):
    _equal("zero3", "reentrant", tmp_path_factory, shared_cache)


@pytest.mark.slow  # 2-process runs; ZeRO-3 above is the make-test cover
@pytest.mark.parametrize("strategy, mode", [  # test-all: each mode and each engine once; the rest: make test-extended
    pytest.param("ddp", "non_reentrant", marks=pytest.mark.extended), ("ddp", "reentrant"),
    pytest.param("zero1", "reentrant", marks=pytest.mark.extended), ("zero2", "non_reentrant"),
    pytest.param("zero3", "non_reentrant", marks=pytest.mark.extended)])
def test_other_strategies_and_modes_train_bitwise_alike(strategy, mode, tmp_path_factory, shared_cache):
    _equal(strategy, mode, tmp_path_factory, shared_cache)


@pytest.mark.slow  # a 2-process run; the 1-process planted run (tests/callbacks/test_cb_grad_checkpointing.py) is fast
def test_routing_mismatch_is_named_on_each_rank(tmp_path, shared_cache):
    proc = run_train(BASE + ["strategy=ddp", "model.gradient_checkpointing=true", "+callbacks=grad_checkpointing",
                             "+callbacks.planted._target_=tests.planted.ckpt.RouterBiasInForward",
                             "+callbacks.planted.layer=1"], tmp_path, shared_cache)
    assert_ok(proc)
    bad = of(read_findings(only_run_dir(tmp_path), "grad_checkpointing"), "grad_checkpointing")
    assert {(f["code"], f["details"]["router"]) for f in bad} == {("routing_recompute_mismatch",
                                                                   "model.layers.1.mlp.gate")}
    assert {f["rank"] for f in bad} == {0, 1}
