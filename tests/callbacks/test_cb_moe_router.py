"""moe_router: router collapse, dead experts, load imbalance and a rising aux loss are found per
window and named (layer, experts, shares); healthy and balanced windows are silent. Unit tests on
synthetic windows; planted bugs (tests/planted/router.py) on the tiny DeepSeek-V3 and on HF
Qwen2-MoE, 1 process; one 2-process ZeRO-3 run (slow) for the all-reduced decision."""

from __future__ import annotations

import json
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from dsdebug.callbacks.moe_router import MoERouter, record_stats, window_stats
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel
from dsdebug.models.moe_aux import RouterRecord
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, assert_ok, only_run_dir, run_train, train_in_process


def loud(records: list[dict]) -> list[tuple]:
    return [(r["code"], r["step"]) for r in records if r["severity"] != "info"]


def read(run_dir) -> list[dict]:
    path = run_dir / "findings.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["check"] == "moe_router"]


def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"window_steps": 0}, "window_steps"), ({"collapse_tokens": 1.5}, "collapse_tokens"),
                        ({"imbalance_max": 1}, "imbalance_max"), ({"aux_windows": -1}, "aux_windows"),
                        ({"dead_below": "x"}, "dead_below"), ({"on_error": "skip"}, "on_error"),
                        ({"on_error": "ignore"}, "on_error")):
        with pytest.raises(ConfigError, match=f"callbacks.moe_router.{key}=.*valid: ") as e:
            MoERouter(**kwargs)
        assert "\n" not in str(e.value)


def _record(indices, logits) -> RouterRecord:
    idx = torch.tensor(indices)
    return RouterRecord("model.layers.1.mlp.gate", 1, torch.as_tensor(logits, dtype=torch.float32), idx,
                        (1, idx.shape[0]), "softmax")


def test_record_stats_counts_slots_and_router_entropy():
    uniform = _record([[0, 1], [2, 3], [0, 3]], torch.zeros(3, 4))  # undecided router: entropy log E
    sure = _record([[1, 2]] * 3, torch.tensor([[-50.0, 50.0, -50.0, -50.0]] * 3))  # confident: ~0
    counts, ent, tokens = record_stats([uniform, sure], 4)
    assert counts.tolist() == [[2, 1, 1, 2], [0, 3, 3, 0]] and tokens.tolist() == [3, 3]
    st = window_stats(counts, ent, tokens, top_k=2)
    assert st["entropy"][0].item() == pytest.approx(1.0) and st["entropy"][1].item() < 1e-6
    assert st["token_frac"][1].tolist() == [0, 1, 1, 0]  # every token chose E1 and E2
    assert st["load_entropy"][1].item() == pytest.approx(0.0, abs=1e-9)  # all tokens on the same top-k


def test_window_stats_uniform_is_one_and_bounded():
    st = window_stats(torch.full((1, 8), 100.0), torch.zeros(1), torch.full((1,), 400.0), top_k=2)
    assert st["load_entropy"].item() == pytest.approx(1.0) and st["imbalance"].item() == pytest.approx(1.0)
    assert st["max_share"].item() == pytest.approx(1 / 8)


class _Trainer(SimpleNamespace):
    def __init__(self):
        super().__init__(global_step=0, global_rank=0, world_size=1, loggers=[], max_steps=-1,
                         callback_metrics={}, should_stop=False, lightning_module=None)


def _fed(cb: MoERouter, layers=(1, 3), experts=8, top_k=2, source="project"):
    moe = SimpleNamespace(layers=list(layers), num_experts=experts, top_k=top_k, source=source,
                          observe=lambda fn: True, unobserve=lambda fn: None)
    trainer = _Trainer()
    cb.on_fit_start(trainer, SimpleNamespace(moe=moe))
    return trainer


def _window(cb, trainer, counts, aux=None, steps=2):
    """Feed one window of per-layer counts [L, E] (tokens = counts.sum / k) and close it."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    n, e = counts.shape
    cb._window[: n * e] = counts.reshape(-1)
    cb._window[n * e + n: n * e + 2 * n] = counts.sum(-1) / cb.top_k
    if aux is not None:
        cb._window[-4:-2] = torch.tensor([aux, 1.0])
    trainer.global_step += steps
    cb.on_train_batch_end(trainer, None, None, None, 0)


def test_windows_name_collapse_dead_imbalance_and_rising_aux(tmp_path):
    channel = configure_channel(tmp_path)
    cb = MoERouter(window_steps=2, warmup_steps=2, imbalance_max=2.0, aux_windows=3, aux_rise=0.2)
    trainer = _fed(cb)
    healthy = [[130, 120, 125, 110, 140, 125, 125, 125]] * 2
    collapsed = [[1000, 140, 130, 150, 160, 140, 140, 140], [250] * 8]  # layer 1: E0 in every token
    _window(cb, trainer, collapsed, aux=5.0)  # steps 0-1: warm-up, logged only
    assert channel.local == []
    _window(cb, trainer, healthy, aux=1.0)
    assert channel.local == []  # balanced: silent
    _window(cb, trainer, collapsed, aux=1.1)
    (f,) = channel.local
    assert (f.code, f.severity, f.step, f.details["layer"], f.details["experts"]) == \
        ("router_collapse", "error", 5, 1, ["E0"])
    assert "layer 1 over steps 4-5" in f.message and "E0 100%" in f.message
    dead = [[0, 0, 600, 300, 150, 150, 150, 150], [250] * 8]  # 3.2x the mean load on E2
    _window(cb, trainer, dead, aux=1.3)
    codes = [(x.code, x.details.get("layer")) for x in channel.local[1:]]
    assert ("dead_experts", 1) in codes and ("load_imbalance", 1) in codes  # imbalanced 2 windows in a row
    d = next(x for x in channel.local if x.code == "dead_experts")
    assert d.details["experts"] == ["E0", "E1"] and "E0, E1" in d.message
    _window(cb, trainer, dead, aux=1.5)  # aux rose 1.0 -> 1.1 -> 1.3 -> 1.5: 3 windows in a row, +50%
    rising = [x for x in channel.local if x.code == "aux_loss_rising"]
    assert len(rising) == 1 and "1.000 -> 1.100 -> 1.300 -> 1.500" in rising[0].message
    assert len([x for x in channel.local if x.code == "dead_experts"]) == 1  # the same dead experts: once
    cb.on_train_end(trainer, None)
    summary = channel.local[-1]
    assert summary.code == "router_summary" and set(summary.details["share"]) == {"L1", "L3"}
    assert sum(summary.details["share"]["L1"]) == pytest.approx(1.0)


def test_healthy_noise_is_silent(tmp_path):
    channel = configure_channel(tmp_path)
    cb = MoERouter(window_steps=1, warmup_steps=0)
    trainer = _fed(cb, layers=(1,), experts=4, source="model")
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        _window(cb, trainer, [(torch.rand(4, generator=g) * 40 + 100).tolist()], aux=2.0 + 0.01 * (i % 3), steps=1)
    assert channel.local == []


def test_listener_counts_every_token_and_off_means_no_hook():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from dsdebug.models.lm_module import CausalLMModule

    torch.manual_seed(0)
    net = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, mlp_only_layers=[0]))
    hooks = lambda: sum(len(m._forward_hooks) for m in net.modules())  # noqa: E731
    module = CausalLMModule(net, optimizer=partial(torch.optim.AdamW), moe_aux_loss_coef=0, moe_metrics=False)
    module.log = module.log_dict = lambda *a, **k: None
    before = hooks()
    assert module.moe.capture is None and module.moe.listeners == []  # off: no hook at all
    cb = MoERouter(window_steps=10)
    cb.on_fit_start(_Trainer(), module)  # attaches the capture on demand
    assert cb.layers == [1] and hooks() > before
    ids = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        module.training_step({"input_ids": ids}, 0)
    n = 1 * 4
    assert cb._window[:n].sum().item() == 2 * 32 * 2  # 2 forwards x 32 tokens x top-2
    assert cb._window[n + 1].item() == 64  # tokens seen by layer 1
    with torch.no_grad():
        module.eval()
        module.validation_step({"input_ids": ids}, 0)  # eval forwards are not counted
    assert cb._window[:n].sum().item() == 128
    cb.on_train_end(_Trainer(), module)
    assert module.moe.listeners == []


# ---- planted bugs in real runs ---------------------------------------------------------------
RUN = SMOKE + [
    "+callbacks=moe_router", "callbacks.moe_router.window_steps=2", "callbacks.moe_router.warmup_steps=2",
    "export.fp32=false", "export.hf=false"]


def _bias(name: str, layer: int, expert: int, step: int, bias: float) -> list[str]:
    return [f"+callbacks.{name}._target_=tests.planted.router.RouterBias", f"+callbacks.{name}.layer={layer}",
            f"+callbacks.{name}.expert={expert}", f"+callbacks.{name}.step={step}", f"+callbacks.{name}.bias={bias}"]


def _collapse_named(found: list[dict], step: int, tokens: int) -> None:
    """Planted at step 3 (V3's e_score_correction_bias of layer 1, expert 0): windows of 2 steps."""
    assert [s for _, s in loud(found) if s < 3] == []  # before the onset: silent
    collapse = [r for r in found if r["code"] == "router_collapse" and r["severity"] == "error"]
    assert collapse, loud(found)
    first = collapse[0]
    assert first["step"] == step and first["step"] - 3 <= 5 and first["rank"] is None
    assert first["details"]["layer"] == 1 and first["details"]["experts"] == ["E0"]
    assert first["details"]["tokens_frac"]["E0"] == 1.0 and first["details"]["tokens"] == tokens  # all ranks
    assert "router collapse in layer 1 over steps 4-5" in first["message"] and "E0 100%" in first["message"]
    summary = [r for r in found if r["code"] == "router_summary"][-1]
    share = summary["details"]["share"]["L1"]  # over the whole run: E0 is the busiest
    assert summary["details"]["layers"] == [1] and max(range(len(share)), key=share.__getitem__) == 0


def test_deepseek_v3_planted_collapse_named_within_5_steps(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    m = train_in_process(RUN + SMALL_DEEPSEEK + ["trainer.max_steps=6", *_bias("planted", 1, 0, 3, 10.0)],
                         run_dir, shared_cache)
    assert m["status"] == "completed"
    found = read(run_dir)
    _collapse_named(found, step=5, tokens=2 * 8 * 128)
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    windows = {r["step"]: r for r in rows if "moe_router/max_share/L1" in r}
    assert sorted(windows) == [1, 3, 5] and windows[5]["moe_router/max_share/L1"] == pytest.approx(0.5)
    assert windows[1]["moe_router/max_share/L1"] < 0.4  # before the plant


def test_hf_qwen2_moe_planted_collapse_and_dead_expert_named(tmp_path, shared_cache):
    from tests.models.test_hf_moe import _net

    model_dir = tmp_path / "qwen2_moe"
    _net("qwen2_moe").save_pretrained(model_dir)  # 4 experts, top-2; decoder layer 1 is the MoE layer
    run_dir = tmp_path / "run"
    overrides = RUN + ["model=hf_pretrained", f"model.net.name_or_path={model_dir}", "data.vocab_size=4096",
                       "trainer.max_steps=4", "trainer.limit_val_batches=1", "data.max_tokens=20000",
                       *_bias("hot", 1, 0, 2, 10.0), *_bias("dead", 1, 3, 2, -1e4)]
    assert train_in_process(overrides, run_dir, shared_cache)["status"] == "completed"
    found = read(run_dir)
    assert [s for _, s in loud(found) if s < 2] == []
    collapse = [r for r in found if r["code"] == "router_collapse"]
    assert collapse and collapse[0]["step"] == 3 and collapse[0]["details"]["experts"] == ["E0"]
    dead = [r for r in found if r["code"] == "dead_experts"]
    assert len(dead) == 1 and dead[0]["step"] == 3 and dead[0]["details"]["experts"] == ["E3"]
    assert "1/4 expert(s) of layer 1 got no token over steps 2-3" in dead[0]["message"]
    md = (run_dir / "report.md").read_text()  # the heatmap: layer x expert token share
    assert "](report_files/moe_router.png)" in md and (run_dir / "report_files" / "moe_router.png").is_file()


@pytest.mark.slow
def test_two_processes_zero3_collapse_decided_on_all_ranks_tokens(tmp_path, shared_cache):
    args = RUN + SMALL_DEEPSEEK + ["trainer=ddp_sim", "strategy=zero3", "trainer.max_steps=6",
                                   *_bias("planted", 1, 0, 3, 10.0)]
    proc = run_train(args, tmp_path, shared_cache)
    assert_ok(proc)
    found = read(only_run_dir(tmp_path))
    _collapse_named(found, step=5, tokens=2 * 2 * 8 * 128)  # both ranks' tokens: the decision is global
    assert len([r for r in found if r["code"] == "router_summary"]) == 1  # rank 0 writes


@pytest.mark.parametrize("mode", ["bias", "tie", "zeros"])
def test_router_collapsed_at_initialisation_is_named_at_step_0(mode, tmp_path, shared_cache):
    """The 100-step warm-up used to hide it; a fresh router's near-uniform load is the prior."""
    run_dir = tmp_path / "run"
    m = train_in_process(RUN + SMALL_DEEPSEEK + ["trainer.max_steps=3", "callbacks.moe_router.warmup_steps=100",
                                                "+callbacks.plant._target_=tests.planted.early.RouterInit",
                                                f"+callbacks.plant.mode={mode}", "+callbacks.plant.layer=1"],
                         run_dir, shared_cache)
    assert m["status"] == "completed"
    collapse = [r for r in read(run_dir) if r["code"] == "router_collapse"]
    assert collapse and collapse[0]["step"] == 0 and collapse[0]["details"]["layer"] == 1, collapse
    assert collapse[0]["details"]["early"] and "from the first steps" in collapse[0]["message"]
    if mode == "bias":  # the planted expert is the culprit
        assert collapse[0]["details"]["experts"] == ["E3"]
