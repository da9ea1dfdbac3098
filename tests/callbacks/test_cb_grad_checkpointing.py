"""grad_checkpointing: each planted failure is found with the right culprit, healthy runs only say info.

Planted (tests/planted/ckpt.py): a net of one's own with frozen embeddings under reentrant checkpointing
(no block gets a gradient) -> ``reentrant_no_input_grad`` naming the blocks; a DeepSeek-V3 router that
updates its balancing bias inside forward -> ``routing_recompute_mismatch`` naming that layer's router
only; reentrant MoE blocks while a balancing loss trains -> ``reentrant_aux_loss_no_grad`` naming the routers.
Healthy: the same nets without the bug (non-reentrant; HF's reentrant path without aux loss) say info only,
with the activation memory measured (less with checkpointing than without). 1-process in-process runs;
the 2-process runs are in tests/models/test_grad_ckpt_runs.py."""

from __future__ import annotations

import pytest

from dsdebug.callbacks.grad_checkpointing import GradCheckpointing
from dsdebug.errors import ConfigError
from tests.helpers.findings import of, one, read_findings
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, train_in_process

BASE = SMOKE + ["trainer.max_steps=2", "trainer.limit_val_batches=0", "export.hf=false", "strategy=ddp",
                "+callbacks=grad_checkpointing"]
BLOCK_LM = ["model.net._target_=tests.planted.ckpt.BlockLM"]
FROZEN = [*BLOCK_LM, "+model.net.freeze_embedding=true"]
ROUTER_BUG = ["+callbacks.planted._target_=tests.planted.ckpt.RouterBiasInForward", "+callbacks.planted.layer=1"]
DEEPSEEK_3 = [*SMALL_DEEPSEEK, "model.net.num_hidden_layers=3"]  # two MoE layers: the bug is in one


def _findings(overrides, tmp_path, cache):
    train_in_process(BASE + overrides, tmp_path / "run", cache)
    return read_findings(tmp_path / "run", "grad_checkpointing")


def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"check_steps": 0}, "check_steps"), ({"routing": "yes"}, "routing"),
                        ({"memory": 1}, "memory"), ({"on_error": "rollback"}, "on_error")):
        with pytest.raises(ConfigError, match=f"callbacks.grad_checkpointing.{key}=.*valid: "):
            GradCheckpointing(**kwargs)


def test_reentrant_blocks_whose_inputs_need_no_grad_are_named(tmp_path, shared_cache):
    # one step: DDP (without find_unused_parameters) refuses the next forward, because the blocks got no
    # gradient; under DeepSpeed or find_unused_parameters=True nothing stops the run -- the silent case
    findings = _findings([*FROZEN, "model.gradient_checkpointing=reentrant", "trainer.max_steps=1"], tmp_path,
                         shared_cache)
    bad = of(findings, "grad_checkpointing")
    assert [f["code"] for f in bad] == ["reentrant_no_input_grad"], bad
    assert "layers.0 ... layers.2" in bad[0]["message"] and "get NO gradient" in bad[0]["message"]
    assert set(bad[0]["details"]["blocks"]) == {"layers.0", "layers.1", "layers.2"}
    assert bad[0]["rank"] is None and bad[0]["step"] == 0


def test_the_same_frozen_net_non_reentrant_is_healthy_and_memory_is_measured(tmp_path, shared_cache):
    findings = _findings([*FROZEN, "model.gradient_checkpointing=non_reentrant"], tmp_path, shared_cache)
    assert of(findings, "grad_checkpointing") == []
    memory = one(findings, "activation_memory")["details"]
    # the blocks' inside (LayerNorm, 4x wider MLP) is dropped; each block's input is kept
    assert 0 < memory["bytes_with"] < memory["bytes_without"] and memory["bytes_saved"] > 0, memory
    assert memory["blocks"] == 3


def test_routing_that_differs_in_the_recompute_names_the_router(tmp_path, shared_cache):
    findings = _findings([*DEEPSEEK_3, "model.gradient_checkpointing=true", *ROUTER_BUG], tmp_path, shared_cache)
    bad = of(findings, "grad_checkpointing")
    assert {f["code"] for f in bad} == {"routing_recompute_mismatch"}, bad
    assert {f["details"]["router"] for f in bad} == {"model.layers.1.mlp.gate"}  # layer 2's router is healthy
    assert all(0 < f["details"]["share_tokens"] <= 1 for f in bad)


def test_reentrant_moe_blocks_with_a_balancing_loss_are_named(tmp_path, shared_cache):
    findings = _findings([*DEEPSEEK_3, "model.gradient_checkpointing=reentrant", "trainer.max_steps=1"], tmp_path,
                         shared_cache)
    bad = of(findings, "grad_checkpointing")
    assert [f["code"] for f in bad] == ["reentrant_aux_loss_no_grad"], bad
    assert bad[0]["details"]["routers"] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]


def test_healthy_deepseek_reentrant_says_info_only(tmp_path, shared_cache):
    findings = _findings([*DEEPSEEK_3, "model.gradient_checkpointing=reentrant", "model.moe_aux_loss_coef=0"],
                         tmp_path, shared_cache)
    assert of(findings, "grad_checkpointing") == []
    memory = one(findings, "activation_memory")["details"]
    assert memory["bytes_saved"] > 0 and memory["blocks"] == 3


def test_without_checkpointing_it_says_so_and_adds_no_hooks(tmp_path, shared_cache):
    findings = _findings(BLOCK_LM, tmp_path, shared_cache)
    assert [f["code"] for f in findings] == ["checkpointing_off"]
