"""LoRA through peft (+model/adapter=lora, src/models/adapter.py) and its checks: targets that adapt
nothing are one-line errors at build time; the trainable count is an info finding; freeze_verify
holds the adapter's frozen base to not moving (planted: a base weight left trainable, the base in an
optimizer group, weight decay on frozen parameters, a resume that does not restore the base); the
exported adapter is verified non-empty and reloading to the same logits; the merged export equals
the adapted net. Unit-level plants run FreezeVerify by hand (no fit); one 1-process fit is fast,
the 2-process DDP/ZeRO-2/ZeRO-3 runs and the resume runs are slow."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dsdebug.callbacks.freeze_verify import FreezeVerify
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel
from dsdebug.models.adapter import LoraAdapter, export_adapter, load_adapted, verify_adapter_dir
from dsdebug.models.optim import param_groups
from tests.helpers.findings import of, one, read_findings
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, assert_ok, only_run_dir, run_train, train_in_process
from tests.planted.lora import BASE_WEIGHT, DecayAll

pytest.importorskip("peft")
LORA = ["+model/adapter=lora"]


def _net(**kw):
    from dsdebug.models.deepseek import build_deepseek_v3

    return build_deepseek_v3(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             max_position_embeddings=32, **kw)


# ---- build-time errors -----------------------------------------------------------------------
@pytest.mark.parametrize("targets, says", [
    (["q_proj", "k_proj"], "matches no module; the Linear modules of DeepseekV3ForCausalLM are named down_proj, "
                           "gate_proj, kv_a_proj_with_mqa"),
    (["embed_tokens", "lm_head"], "selects only the embeddings/output head (lm_head, model.embed_tokens)"),
    (["gate"], "selects modules LoRA has no layer for: model.layers.1.mlp.gate (DeepseekV3TopkRouter)"),
    (["q_b_proj", "down_proj"], "which peft maps to the fused expert tensors"),
])
def test_targets_that_adapt_nothing_or_the_wrong_modules_are_one_line_errors(targets, says):
    with pytest.raises(ConfigError) as raised:
        LoraAdapter(target_modules=targets).apply(_net())
    message = str(raised.value)
    assert says in message and "\n" not in message and str(targets) in message


def test_deepseek_v2_and_all_linear_leave_out_what_peft_would_move_to_the_experts():
    from dsdebug.models.deepseek import build_deepseek_v2

    adapter = LoraAdapter()
    adapted = adapter.apply(build_deepseek_v2(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=2, max_position_embeddings=32), report=False)
    lora = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in adapted.named_parameters() if p.requires_grad}
    assert {"o_proj", "kv_b_proj"} <= lora and not lora & {"gate_proj", "up_proj", "down_proj"}
    assert {n.rsplit(".", 1)[-1] for n in adapter.left_out} == {"gate_proj", "up_proj", "down_proj"}
    assert all(not p.requires_grad for n, p in adapted.named_parameters() if n in adapter.intended_frozen)


def test_bad_values_and_qlora_on_cpu_are_one_line_errors():
    for kwargs, key in (({"r": 0}, "r"), ({"alpha": -1}, "alpha"), ({"dropout": 1.0}, "dropout"),
                        ({"kind": "dora"}, "kind"), ({"target_modules": []}, "target_modules")):
        with pytest.raises(ConfigError, match=f"model.adapter.{key}=.*valid: "):
            LoraAdapter(**kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="model.adapter=qlora needs a CUDA GPU and bitsandbytes: "):
            LoraAdapter(kind="qlora")


def test_bad_target_from_the_command_line_fails_at_build(tmp_path, shared_cache):
    from dsdebug.trainer.cli import find_config_error

    with pytest.raises(Exception) as raised:
        train_in_process(SMOKE + LORA + ["model.adapter.target_modules=[qproj]", "strategy=ddp", *SMALL_DEEPSEEK],
                         tmp_path / "run", shared_cache)
    error = find_config_error(raised.value)
    assert error is not None and "model.adapter.target_modules=['qproj'] matches no module" in str(error), raised.value
    assert not (tmp_path / "run" / "checkpoints").exists()  # before training


# ---- freeze_verify and the adapter's frozen base (unit level: FreezeVerify driven by hand) ------
def _adapted_module(**adapter_kw):
    module = nn.Module()
    adapter = LoraAdapter(r=4, dropout=0.0, **adapter_kw)
    module.net = adapter.apply(_net(), report=False)
    module.intended_frozen = frozenset(f"net.{n}" for n in adapter.intended_frozen)
    return module


def _fit(module, cb, make_optimizer, steps=2, trainer=None):
    trainer = trainer or SimpleNamespace(global_rank=0, world_size=1, global_step=0, strategy=object(), optimizers=[])
    cb.setup(trainer, module, "fit")
    opt = make_optimizer(module.net)
    trainer.optimizers = [opt]
    cb.on_train_start(trainer, module)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        module.net(input_ids=ids).logits.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, module, None, None, 0)
    return trainer


def _adamw(net):
    return torch.optim.AdamW(param_groups(net.named_parameters()), lr=1e-2)


def _errors(channel):
    return {f.code: f.details["params"] for f in channel.local if f.severity == "error"}


def test_healthy_adapter_is_verified_with_the_base_held_frozen():
    channel = configure_channel(None)
    module = _adapted_module()
    _fit(module, FreezeVerify(check_after_steps=2), _adamw)
    assert _errors(channel) == {}
    verified = [f for f in channel.local if f.code == "freeze_verified"]
    assert len(verified) == 1 and "frozen ones did not" in verified[0].message


def test_base_weight_left_trainable_moves_and_is_named():
    channel = configure_channel(None)
    module = _adapted_module()
    dict(module.net.named_parameters())[BASE_WEIGHT].requires_grad_(True)  # planted
    cb = FreezeVerify(check_after_steps=2)
    _fit(module, cb, _adamw)
    assert dict(module.net.named_parameters())[BASE_WEIGHT].requires_grad  # reported, not silently re-frozen
    assert _errors(channel) == {"base_param_changed": [BASE_WEIGHT]}


def test_base_in_an_optimizer_group_is_named_even_when_it_does_not_move():
    channel = configure_channel(None)
    module = _adapted_module()
    _fit(module, FreezeVerify(check_after_steps=2),
         lambda net: torch.optim.AdamW([{"params": list(net.parameters())}], lr=1e-2))  # planted: the base too
    errors = _errors(channel)
    assert set(errors) == {"base_in_optimizer"} and BASE_WEIGHT in errors["base_in_optimizer"]
    assert all("lora_" not in n for n in errors["base_in_optimizer"])


def test_weight_decay_on_frozen_params_moves_the_base():
    channel = configure_channel(None)
    module = _adapted_module()
    _fit(module, FreezeVerify(check_after_steps=2), lambda net: DecayAll(list(net.parameters()), lr=1e-2))
    errors = _errors(channel)
    assert set(errors) == {"base_param_changed"}
    assert BASE_WEIGHT in errors["base_param_changed"] and all("lora_" not in n for n in errors["base_param_changed"])


def test_a_one_step_window_is_refused_with_an_adapter():
    with pytest.raises(ConfigError, match="check_after_steps=1 with model.adapter: LoRA's A matrices get no gradient"):
        _fit(_adapted_module(), FreezeVerify(check_after_steps=1), _adamw)


def test_base_moving_after_the_window_is_caught_at_the_end_of_fit():
    channel = configure_channel(None)
    module = _adapted_module()
    cb = FreezeVerify(check_after_steps=2)
    trainer = _fit(module, cb, _adamw, steps=3)
    assert _errors(channel) == {}
    with torch.no_grad():
        dict(module.net.named_parameters())[BASE_WEIGHT].mul_(0.5)  # planted: moved after the window
    cb.on_train_end(trainer, module)
    assert _errors(channel) == {"base_param_changed": [BASE_WEIGHT]}


@pytest.mark.parametrize("perturb", [False, True])
def test_resume_keeps_the_frozen_base(perturb):
    channel = configure_channel(None)
    module = _adapted_module()
    first = FreezeVerify(check_after_steps=2)
    _fit(module, first, _adamw, steps=2)
    saved = first.state_dict()  # what a checkpoint carries
    assert len(saved["_base_sums"]) == len(module.intended_frozen)
    second = FreezeVerify(check_after_steps=2)
    second.load_state_dict(saved)
    if perturb:  # planted: the resumed base is not the one the first fit started from
        with torch.no_grad():
            dict(module.net.named_parameters())[BASE_WEIGHT].add_(1e-3)
    _fit(module, second, _adamw, steps=2)
    assert _errors(channel) == ({"base_changed_on_resume": [BASE_WEIGHT]} if perturb else {})


# ---- the saved adapter ------------------------------------------------------------------------
def _trained_adapter():
    module = _adapted_module(target_modules=["q_b_proj", "o_proj"])
    with torch.no_grad():
        for n, p in module.net.named_parameters():
            if "lora_B" in n:  # as if trained: lora_B starts at zero
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    return module.net


def test_saved_adapter_reloads_to_the_same_logits_and_merges(tmp_path):
    channel = configure_channel(None)
    net = _trained_adapter()
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        want = net(input_ids=ids).logits
    merged, facts = export_adapter(net, tmp_path / "adapter")
    assert facts["tensors"] == 8 and facts["elements"] > 0 and facts["reload_max_abs_diff"] <= 1e-6
    assert [f for f in channel.local if f.severity == "error"] == []
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def test_empty_adapter_tensors_are_named(tmp_path):
    """What a live ZeRO-3 model's save writes without gathering (peft #2500): size-0 tensors."""
    channel = configure_channel(None)
    net = _trained_adapter()
    name, p = next((n, p) for n, p in net.named_parameters() if "lora_A" in n)
    p.data = torch.empty(0)  # planted: a partitioned parameter as ZeRO-3 leaves it outside a gather
    net.save_pretrained(str(tmp_path / "adapter"))
    assert verify_adapter_dir(tmp_path / "adapter")
    found = [f for f in channel.local if f.code == "adapter_empty"]
    assert len(found) == 1 and "1 of 8 tensors empty" in found[0].message
    assert found[0].details["empty"] == [name.replace(".default", "")]


def test_stale_adapter_copy_does_not_reload_to_the_trained_logits(tmp_path, monkeypatch):
    import dsdebug.models.adapter as adapter_mod

    channel = configure_channel(None)
    real = adapter_mod.adapter_state
    monkeypatch.setattr(adapter_mod, "adapter_state",  # planted: a copy taken before training (lora_B = 0)
                        lambda net: {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in real(net).items()})
    export_adapter(_trained_adapter(), tmp_path / "adapter")
    assert [f.code for f in channel.local if f.severity == "error"] == ["adapter_reload_mismatch"]


# ---- real fits ----------------------------------------------------------------------------------
def _check_healthy_run(run_dir, expect_source="export"):
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

    found = read_findings(run_dir)
    assert of(found, "adapter") == [] and of(found, "freeze_verify") == [], [f["message"] for f in found]
    applied = one(read_findings(run_dir, "adapter"), "adapter_applied")
    assert 0 < applied["details"]["share"] < 0.1 and applied["details"]["trainable"] > 0
    assert [r["code"] for r in read_findings(run_dir, "freeze_verify")] == ["freeze_verified"]
    export = run_dir / "export"
    assert verify_adapter_dir(export / "adapter") == []
    # the merged HF export equals the adapted net rebuilt from the consolidated checkpoint
    state = torch.load(export / "model_fp32.pt", weights_only=False)["state_dict"]
    net_state = {k[4:]: v.float() for k, v in state.items() if k.startswith("net.")}
    config = AutoModelForCausalLM.from_pretrained(export / "hf").config
    adapted = load_adapted(LoraAdapter(), DeepseekV3ForCausalLM(config), net_state).eval()
    merged = AutoModelForCausalLM.from_pretrained(export / "hf").eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4)
    # the adapter trained: every lora_B moved off its zero init
    assert all(v.abs().sum() > 0 for k, v in net_state.items() if "lora_B" in k)


def test_lora_one_process_fit_is_silent_and_exports(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = train_in_process(SMOKE + LORA + ["strategy=ddp", *SMALL_DEEPSEEK], run_dir, shared_cache)
    assert set(metrics["exports"]) == {"fp32", "adapter", "hf"}
    _check_healthy_run(run_dir)


@pytest.mark.slow  # four 2-process fits (~1-3 min each on 2 cores); the 1-process fit above is the fast cover
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero1", marks=pytest.mark.extended),  # test-all: DDP and
                                      pytest.param("zero2", marks=pytest.mark.extended), "zero3"])  # ZeRO-3
def test_lora_two_processes(strategy, tmp_path, shared_cache):
    proc = run_train(SMOKE + LORA + ["trainer=ddp_sim", f"strategy={strategy}", *SMALL_DEEPSEEK],
                     tmp_path / "logs", shared_cache, timeout=600)
    assert_ok(proc)
    _check_healthy_run(only_run_dir(tmp_path / "logs"))


@pytest.mark.slow  # two 1-process fits; the unit-level resume test above is the fast cover
@pytest.mark.parametrize("perturb", [False, True])
def test_resume_through_a_checkpoint_keeps_the_frozen_base(perturb, tmp_path, shared_cache):
    base = SMOKE + LORA + ["strategy=ddp", *SMALL_DEEPSEEK]
    first = tmp_path / "first"
    first.mkdir()
    train_in_process(base + ["trainer.max_steps=2"], first, shared_cache)
    second = tmp_path / "second"
    second.mkdir()
    plant = ["+callbacks.perturb._target_=tests.planted.lora.PerturbBaseOnResume"] if perturb else []
    train_in_process(base + plant + [f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"], second, shared_cache)
    errors = of(read_findings(second), "freeze_verify")
    if perturb:
        assert [(e["code"], e["details"]["params"]) for e in errors] == [("base_changed_on_resume", [BASE_WEIGHT])]
    else:
        assert errors == []


@pytest.mark.slow  # a pretrained dir with its tokenizer and a 1-process fit (~30 s); DeepSeek's fit above is the fast cover
def test_hf_pretrained_llama_trains_its_adapter_and_keeps_the_pretrained_base(tmp_path, shared_cache):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dsdebug.data.corpus import KJVCorpus
    from tests.helpers.tokenizer_families import save_model_dir

    model_dir = save_model_dir("llama", tmp_path / "llama", list(KJVCorpus().documents())[:4])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = train_in_process(SMOKE + LORA + ["model=hf_pretrained", f"model.net.name_or_path={model_dir}",
                                               "model.adapter.target_modules=[q_proj,v_proj]", "strategy=ddp",
                                               "trainer.max_steps=3"], run_dir, shared_cache)
    assert metrics["status"] == "completed" and set(metrics["exports"]) == {"fp32", "adapter", "hf"}
    found = read_findings(run_dir)
    assert of(found, "adapter") == [] and of(found, "freeze_verify") == [], [f["message"] for f in found]
    assert "on 2 modules (q_proj, v_proj)" in one(found, "adapter_applied")["message"]
    # independent witness: every base tensor of the consolidated checkpoint is the pretrained one, bit for bit
    pretrained = load_file(str(model_dir / "model.safetensors"))
    state = torch.load(run_dir / "export" / "model_fp32.pt", weights_only=False)["state_dict"]
    base = {k.replace("net.base_model.model.", "").replace(".base_layer", ""): v for k, v in state.items()
            if "lora_" not in k}
    assert set(pretrained) <= set(base)
    assert all(torch.equal(base[k].float(), v.float()) for k, v in pretrained.items())
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "export" / "hf")
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight.float(),
                           pretrained["model.layers.0.self_attn.q_proj.weight"].float())  # LoRA folded in
