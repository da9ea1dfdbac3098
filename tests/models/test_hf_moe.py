"""HF MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) train with their own balance loss, once,
at their own coefficient, and log the moe/* metrics; dense models get no hooks.

Unit checks build tiny models from config (random init, offline); one short in-process run per
family trains a save_pretrained directory through ``model=hf_pretrained`` with default settings.
"""

from __future__ import annotations

import importlib
import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from dsdebug.errors import ConfigError
from dsdebug.models.deepseek import build_deepseek_v3
from dsdebug.models.lm_module import CausalLMModule
from tests.helpers.runs import SMOKE, train_in_process

VOCAB, E, K = 4096, 4, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=K, max_position_embeddings=256)
# family -> (config class, model class, extra config, decoder layers with an MoE block)
FAMILIES = {
    # a coefficient unlike the project's 0.01 and HF's 0.001 default: the one used must be the config's
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=E, router_aux_loss_coef=0.02), [0, 1]),
    # shared expert, and layer 0 dense (mlp_only_layers): the MoE layer is decoder layer 1
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(num_experts=E, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, mlp_only_layers=[0]), [1]),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_experts=E, moe_intermediate_size=32, head_dim=8), [0, 1]),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(num_experts=E, eos_token_id=2), [0, 1]),  # OLMoE's own coef: 0.01
}


def _net(family: str, seed: int = 0):
    config_cls, model_cls, extra, _ = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**COMMON, **extra))


def _module(net, **kwargs) -> CausalLMModule:
    module = CausalLMModule(net, optimizer=partial(torch.optim.AdamW), **kwargs)
    module.logged = {}
    module.log = lambda key, value, **_: module.logged.__setitem__(key, value)
    module.log_dict = lambda values, **_: module.logged.update(values)
    module._logs_this_step = lambda: True
    return module


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _hf_reference(net, ids):
    """Cross-entropy and HF's own load_balancing_loss_func for this batch, computed independently."""
    out = net(input_ids=ids, output_router_logits=True)
    hf_aux = importlib.import_module(type(net).__module__).load_balancing_loss_func(out.router_logits, E, K)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    return ce, hf_aux


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_own_aux_loss_once_at_the_models_coefficient(family):
    net = _net(family)
    coef = net.config.router_aux_loss_coef
    module = _module(net)  # default: moe_aux_loss_coef="auto"
    assert module.moe.source == "model" and module.moe_aux_loss_coef == coef
    assert module.moe.layers == FAMILIES[family][3]  # decoder layer indices, dense layers skipped
    ids = _ids()
    total = module.training_step({"input_ids": ids}, 0)
    ce, hf_aux = _hf_reference(net, ids)
    logged = module.logged
    assert logged["train/aux_loss"].item() == pytest.approx(hf_aux.item(), rel=1e-6)
    assert logged["train/loss"].item() == pytest.approx(ce.item(), rel=1e-6)
    # back-propagated: CE + coef * aux, the aux term exactly once (HF adds its own only with labels)
    assert total.item() == pytest.approx(ce.item() + coef * hf_aux.item(), rel=1e-6)
    assert total.item() != pytest.approx(ce.item() + 2 * coef * hf_aux.item(), rel=1e-7)
    total.backward()
    router = net.get_submodule(next(iter(module.moe.capture.routers)))
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    layers = FAMILIES[family][3]
    assert sorted(k for k in logged if k.startswith("moe/load/")) == sorted(
        f"moe/load/L{i}/E{e}" for i in layers for e in range(E))
    assert sum(logged[f"moe/load/L{layers[0]}/E{e}"] for e in range(E)) == pytest.approx(1.0)
    assert 1.0 <= logged["moe/load_imbalance"].item() <= E / K


def test_coefficient_number_zero_and_off():
    ids = _ids()
    ce, hf_aux = _hf_reference(_net("qwen3_moe"), ids)
    module = _module(_net("qwen3_moe"), moe_aux_loss_coef=0.5)  # a number replaces the model's own
    assert module.training_step({"input_ids": ids}, 0).item() == pytest.approx(ce.item() + 0.5 * hf_aux.item(), rel=1e-6)

    net = _net("qwen3_moe")
    module = _module(net, moe_aux_loss_coef=0)  # no balancing, still measured and logged
    total = module.training_step({"input_ids": ids}, 0)
    assert total.item() == pytest.approx(ce.item(), rel=1e-6)
    assert module.logged["train/aux_loss"].item() == pytest.approx(hf_aux.item(), rel=1e-6)
    assert not module.logged["train/aux_loss"].requires_grad and "moe/load/L0/E0" in module.logged

    net, baseline = _net("qwen3_moe"), None
    baseline = _hooks(net)
    module = _module(net, moe_aux_loss_coef=0, moe_metrics=False)  # off means zero cost
    assert _hooks(net) == baseline and module.moe.forward_kwargs(training=True) == {}
    module.training_step({"input_ids": ids}, 0)
    assert list(module.logged) == ["train/loss"]

    for bad in ("high", -0.1, float("nan")):
        with pytest.raises(ConfigError, match=r"model.moe_aux_loss_coef=.* valid: auto, or a number >= 0"):
            _module(_net("qwen3_moe"), moe_aux_loss_coef=bad)


def test_deepseek_keeps_the_projects_loss_and_dense_models_get_nothing():
    deepseek = _module(build_deepseek_v3(num_hidden_layers=2, hidden_size=64))
    assert (deepseek.moe.source, deepseek.moe_aux_loss_coef, deepseek.moe.layers) == ("project", 0.01, [1])
    assert deepseek.moe.forward_kwargs(training=True) == {}  # no HF aux to ask for

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4))
    baseline = _hooks(llama)
    module = _module(llama)
    assert _hooks(llama) == baseline and module.moe.source is None and module.moe.capture is None
    module.training_step({"input_ids": _ids()}, 0)
    assert list(module.logged) == ["train/loss"]
    assert module.moe.summary()["layers"] == [] and module.moe.summary()["aux_source"] is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_moe_run_logs_balance_loss_and_load_heatmap(family, tmp_path, shared_cache):
    model_dir = tmp_path / family
    _net(family).save_pretrained(model_dir)
    overrides = SMOKE + [
        "model=hf_pretrained", f"model.net.name_or_path={model_dir}", f"data.vocab_size={VOCAB}",
        "trainer.max_steps=2", "trainer.limit_val_batches=1", "data.max_tokens=20000",
        "export.fp32=false", "export.hf=false"]
    run_dir = tmp_path / "run"
    m = train_in_process(overrides, run_dir, shared_cache)
    coef = FAMILIES[family][2].get("router_aux_loss_coef", 0.01 if family == "olmoe" else 0.001)
    assert m["moe"] == {"aux_source": "model", "aux_coef": coef, "metrics": True, "layers": FAMILIES[family][3],
                        "experts": E, "top_k": K}
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 2
    for r in train:  # the back-propagated total used the model's coefficient, once
        assert r["train/loss_total"] == pytest.approx(r["train/loss"] + coef * r["train/aux_loss"], rel=1e-5)
        assert 1.9 < r["train/aux_loss"] < 2.5  # HF's scale: top_k (2) when balanced
        assert f"moe/load/L{FAMILIES[family][3][-1]}/E{E - 1}" in r and "moe/load_imbalance" in r
    md = (run_dir / "report.md").read_text()
    assert "![MoE expert load](report_files/moe_load.png)" in md and (run_dir / "report_files" / "moe_load.png").is_file()
    assert "aux loss: the model's own" in md
