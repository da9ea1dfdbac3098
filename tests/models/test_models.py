"""Tiny DeepSeek V2/V3 builders, checkpoint round trips and the MoE load-balance loss.

All offline and CPU-only; the whole file runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from dsdebug.errors import ConfigError
from dsdebug.models.deepseek import (
    build_deepseek_v2,
    build_deepseek_v3,
    experts_implementation,
    load_pretrained,
    save_pretrained_dir,
)
from dsdebug.models.moe_aux import RouterCapture, RouterRecord, find_routers
from dsdebug.models.moe_loss import expert_load_fractions, load_balancing_loss

BUILDERS = {"v3": build_deepseek_v3, "v2": build_deepseek_v2}
E, K = 8, 2  # tiny-model defaults: routed experts, experts per token


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)


def _ids(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 4096, (batch, seq), generator=torch.Generator().manual_seed(1))


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ---------------------------------------------------------------------------------- builders


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_build_forward_backward(version):
    net = BUILDERS[version]()
    assert type(net).__name__ == f"Deepseek{version.upper()}ForCausalLM"
    n_params = sum(p.numel() for p in net.parameters())
    assert 8.0e6 < n_params < 9.5e6, n_params  # NOTES.md: ~8.7M
    ids = _ids()
    out = net(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, 4096)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    layer = net.model.layers[1]
    for param in (net.model.embed_tokens.weight, layer.self_attn.q_a_proj.weight,
                  layer.self_attn.kv_b_proj.weight, layer.mlp.gate.weight,
                  layer.mlp.shared_experts.up_proj.weight, layer.mlp.experts.gate_up_proj):
        assert param.grad is not None and param.grad.abs().sum() > 0


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_architecture_dense_first_then_moe_with_mla(version):
    net = BUILDERS[version]()
    layers = net.model.layers
    assert len(layers) == 4
    assert not hasattr(layers[0].mlp, "experts") and hasattr(layers[0].mlp, "gate_proj")
    for layer in layers[1:]:
        assert layer.mlp.experts.num_experts == E
        assert layer.mlp.gate.top_k == K
        assert layer.mlp.shared_experts.gate_proj.out_features == 256  # 1 shared expert
    for layer in layers:
        attn = layer.self_attn
        assert attn.q_proj is None  # MLA: low-rank query instead
        assert attn.q_a_proj.out_features == 128 and attn.kv_a_proj_with_mqa is not None
        assert attn.kv_b_proj.in_features == 64
    assert net.config.num_key_value_heads == net.config.num_attention_heads


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_experts_use_grouped_mm(version, monkeypatch):
    net = BUILDERS[version]()
    assert experts_implementation(net) == "grouped_mm"
    calls = []
    real = ALL_EXPERTS_FUNCTIONS["grouped_mm"]

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._local_mapping, "grouped_mm", spy)
    net(input_ids=_ids())
    assert len(calls) == 3  # one per MoE layer


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_sdpa_matches_eager_attention(version):
    net = BUILDERS[version]().eval()
    assert net.config._attn_implementation == "sdpa"  # sdpa_pad_v: tests/models/test_fast_paths.py
    ids = _ids()
    with torch.no_grad():
        sdpa = net(input_ids=ids).logits
        net.set_attn_implementation("eager")
        eager = net(input_ids=ids).logits
    torch.testing.assert_close(sdpa, eager, atol=1e-4, rtol=1e-4)


def test_overrides_reach_config_and_bad_keys_fail_in_one_line():
    net = build_deepseek_v3(num_hidden_layers=2, routed_scaling_factor=1.0, n_group=1, topk_group=1)
    assert len(net.model.layers) == 2 and net.config.routed_scaling_factor == 1.0
    with pytest.raises(ConfigError, match="num_hidden_layers") as err:
        build_deepseek_v3(num_hidden_layer=2)  # typo: HF would silently ignore it
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="n_group"):
        build_deepseek_v3(n_group=8, topk_group=4)  # HF's V3 default: 1 expert per group
    with pytest.raises(ConfigError, match="n_group"):
        build_deepseek_v2(topk_method="group_limited_greedy", n_group=3)


# ------------------------------------------------------------------------- load-balance loss


def _record(logits, indices, score_func="softmax", batch_shape=None):
    return RouterRecord("model.layers.1.mlp.gate", 1, logits, indices,
                        batch_shape or (1, logits.shape[0]), score_func)


def _uniform_record(score_func, tokens=16, batch_shape=None):
    # every token: equal scores; slots round-robin so each expert gets exactly k*T/E
    slots = torch.arange(tokens * K) % E
    return _record(torch.zeros(tokens, E), slots.view(tokens, K), score_func, batch_shape)


def _collapsed_record(score_func, tokens=16):
    logits = torch.full((tokens, E), -10.0)
    logits[:, :K] = 10.0
    return _record(logits, torch.arange(K).repeat(tokens, 1), score_func)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_balance_loss_uniform_is_one_and_collapse_is_e_over_k(score_func):
    uniform = [_uniform_record(score_func)]
    assert load_balancing_loss(uniform, E, K).item() == pytest.approx(1.0, abs=1e-6)
    per_seq = [_uniform_record(score_func, batch_shape=(2, 8))]
    assert load_balancing_loss(per_seq, E, K, level="sequence").item() == pytest.approx(1.0, abs=1e-6)
    collapsed = [_collapsed_record(score_func)]
    assert load_balancing_loss(collapsed, E, K).item() == pytest.approx(E / K, rel=1e-3)
    both = load_balancing_loss(uniform + collapsed, E, K).item()  # mean over layers
    assert both == pytest.approx((1 + E / K) / 2, rel=1e-3)

    load = expert_load_fractions(uniform + collapsed, E)
    assert load.shape == (2, E)
    torch.testing.assert_close(load[0], torch.full((E,), 1 / E))
    torch.testing.assert_close(load[1], torch.tensor([0.5, 0.5] + [0.0] * (E - 2)))


def test_balance_loss_masks_padding():
    rec = _uniform_record("softmax", tokens=16, batch_shape=(2, 8))
    collapsed = _collapsed_record("softmax", tokens=8)
    rec.logits[8:], rec.topk_indices[8:] = collapsed.logits, collapsed.topk_indices
    mask = torch.ones(2, 8)
    assert load_balancing_loss([rec], E, K, attention_mask=mask).item() > 1.5
    mask[1] = 0  # the collapsed second sequence is all padding
    for level in ("batch", "sequence"):
        loss = load_balancing_loss([rec], E, K, attention_mask=mask, level=level)
        assert loss.item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("version,score_func", [("v3", "sigmoid"), ("v2", "softmax")])
def test_capture_on_real_model_gives_differentiable_loss(version, score_func):
    net = BUILDERS[version]()
    ids = _ids()
    with RouterCapture(net) as capture:
        assert (capture.num_experts, capture.top_k) == (E, K)
        out = net(input_ids=ids, output_router_logits=True)
        records = capture.collect()
    assert [r.layer_index for r in records] == [1, 2, 3]
    assert all(r.score_func == score_func and r.batch_shape == (2, 16) for r in records)
    assert records[0].logits.shape == (32, E) and records[0].topk_indices.shape == (32, K)
    # the hooked logits are exactly what HF's output_router_logits reports
    for rec, hf_logits in zip(records, out.router_logits):
        assert torch.equal(rec.logits, hf_logits)

    aux = load_balancing_loss(records, E, K)
    assert 0.9 < aux.item() < E / K
    aux.backward()  # the aux loss alone: gradient must reach every router...
    for layer in net.model.layers[1:]:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
    # ...but nothing downstream of the last router
    assert net.model.layers[3].mlp.experts.gate_up_proj.grad is None
    assert net.lm_head.weight.grad is None
    assert expert_load_fractions(records, E).sum(dim=1).allclose(torch.ones(3))


def test_hooks_removed_and_zero_hooks_when_disabled():
    net = build_deepseek_v3()
    baseline = _hook_count(net)
    disabled = RouterCapture(net, enabled=False).attach()
    assert disabled.num_hooks == 0 and _hook_count(net) == baseline
    net(input_ids=_ids())
    assert disabled.records == []

    with RouterCapture(net) as capture:
        assert _hook_count(net) == baseline + capture.num_hooks == baseline + 2 + 3
    assert _hook_count(net) == baseline and capture.records == []


def test_records_are_per_forward_and_ignore_checkpoint_recompute():
    net = build_deepseek_v3()
    net.activation_checkpointing_enable()  # HF default: non-reentrant
    net.train()
    capture = RouterCapture(net).attach()
    ids = _ids()
    net(input_ids=ids)
    out = net(input_ids=ids, labels=ids)
    assert len(capture.records) == 3  # second forward replaced the first one's records
    loss = out.loss + 0.01 * load_balancing_loss(capture, E, K)
    loss.backward()  # recompute re-runs the routers; they must not be recorded
    assert len(capture.records) == 3
    assert net.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0
    assert len(capture.collect()) == 3 and capture.records == []
    with pytest.raises(ValueError, match="no router outputs"):
        load_balancing_loss(capture, E, K)
    capture.remove()


def test_find_routers_sees_zero3_partitioned_weights():
    net = build_deepseek_v3()
    for layer in net.model.layers[1:]:  # what ZeRO-3 leaves behind: empty data + ds_shape
        weight = layer.mlp.gate.weight
        weight.ds_shape = weight.shape
        weight.data = torch.empty(0)
    assert list(find_routers(net)) == [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]


def test_capture_through_wrappers():
    class LitLike(nn.Module):  # a LightningModule holds the HF model as .net
        def __init__(self):
            super().__init__()
            self.net = build_deepseek_v2()

        def forward(self, ids):
            return self.net(input_ids=ids)

    class EngineLike(nn.Module):  # DeepSpeed engine / DDP expose the wrapped model as .module
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args):
            return self.module(*args)

    engine = EngineLike(LitLike())
    with RouterCapture(engine) as capture:
        engine(_ids())
        assert len(capture.records) == 3
        assert capture.records[0].name == "model.layers.1.mlp.gate"


# --------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_load_pretrained_round_trip(version, tmp_path):
    # "sdpa": what a saved checkpoint loads with by default (sdpa_pad_v is the builders' own; equal to ~1e-6)
    net = BUILDERS[version](num_hidden_layers=2, attn_implementation="sdpa").eval()
    net.save_pretrained(tmp_path)
    loaded = load_pretrained(str(tmp_path))
    assert type(loaded) is type(net)
    assert experts_implementation(loaded) == "grouped_mm"
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(net(input_ids=ids).logits, loaded.eval()(input_ids=ids).logits)


def test_save_pretrained_dir_from_consolidated_state_dict(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    config_source = build_deepseek_v3(num_hidden_layers=2)
    torch.manual_seed(123)
    trained = build_deepseek_v3(num_hidden_layers=2, attn_implementation="sdpa").eval()  # as a load runs it
    # zero_to_fp32 / Lightning style: {"state_dict": {"net.<hf key>": fp32 tensor}}
    ckpt = {"state_dict": {f"net.{k}": v.clone() for k, v in trained.state_dict().items()}}
    tok = Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    out_dir = save_pretrained_dir(config_source, tmp_path / "hf", tokenizer=tok, state_dict=ckpt)
    assert (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists()

    loaded = load_pretrained(str(out_dir)).eval()
    ids = _ids()
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, expected)
        assert not torch.equal(config_source.eval()(input_ids=ids).logits, expected)

    bad = {k: v for k, v in ckpt["state_dict"].items() if "layers.1.mlp.gate" not in k}
    with pytest.raises(ConfigError, match="missing"):
        save_pretrained_dir(config_source, tmp_path / "bad", state_dict=bad)


@pytest.mark.parametrize("name", ["/no/such/dir/model", "./missing_ckpt", "no-org/not-cached-model"])
def test_load_pretrained_bad_name_is_one_line_config_error(name):
    with pytest.raises(ConfigError) as err:
        load_pretrained(name)
    message = str(err.value)
    assert "model.net.name_or_path" in message and name in message and "\n" not in message


def test_load_pretrained_dir_without_model_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model.net.name_or_path"):
        load_pretrained(str(tmp_path))
