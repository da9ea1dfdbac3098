"""The doctor's probes on small nets, each property broken more than one way (tests/planted/doctor_nets.py):
the probe fails and names the planted module / parameter / key; the healthy witness passes.
Fast: plain modules, no Lightning, no Hydra (the probes are usable without them)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dsdebug.probes.batch import lm_loss
from dsdebug.probes.causality import causality
from dsdebug.doctor.checkpoint import checkpoint_round_trip
from dsdebug.doctor.coverage import coverage
from dsdebug.probes.init_loss import init_loss
from dsdebug.doctor.memory import forecast
from dsdebug.doctor.overfit import overfit
from dsdebug.probes.plan import lr_curve, run_plan
from dsdebug.probes.sample_independence import sample_independence
from dsdebug.doctor.stepper import TorchStepper
from dsdebug.probes.train_eval import train_eval
from tests.planted import doctor_nets as planted

V = 64


def _batch(b: int = 4, t: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, t), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _net(cls: type, **kw) -> nn.Module:
    torch.manual_seed(0)
    return cls(vocab_size=V, **kw)


def _loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return lm_loss(model(input_ids=batch["input_ids"]), batch)


def _stepper(net: nn.Module, lr: float = 1e-2, clip: float | None = 1.0, params=None) -> TorchStepper:
    opt = torch.optim.AdamW(params if params is not None else [p for p in net.parameters() if p.requires_grad], lr=lr)
    return TorchStepper(net, opt, _loss, clip=clip)


# ---- healthy witnesses: every net-level probe passes ----------------------------------

def test_healthy_net_passes_every_net_probe():
    net, batch = _net(planted.TinyCausalLM), _batch()
    for probe in (init_loss, causality, sample_independence, train_eval):
        result = probe(net, batch)
        assert result.status == "pass", result
    cov, _ = coverage(_stepper(net), batch)
    assert cov.status == "pass", cov


# ---- loss at init ---------------------------------------------------------------------

def test_init_loss_far_above_names_the_logits_module():
    result = init_loss(_net(planted.HotHeadLM), _batch())
    assert result.status == "fail" and result.culprit == "head", result
    assert result.details["loss"] > math.log(V) * 1.25 + 1


def test_init_loss_far_below_means_the_model_sees_its_targets():
    class Copier(nn.Module):  # logits = a huge one-hot of the input token: predicts what it sees
        def forward(self, input_ids):
            return 50.0 * nn.functional.one_hot(input_ids, V).float()

    batch = _batch()
    batch["labels"] = torch.roll(batch["input_ids"], 1, dims=1)  # target of t = input t
    result = init_loss(Copier(), batch, vocab=V)
    assert result.status == "fail" and "sees what it predicts" in result.message
    assert init_loss(Copier(), batch, vocab=V, pretrained=True).status == "pass"  # pretrained: low is fine


# ---- causality: missing mask, look-ahead module, labels leak ----------------------------

@pytest.mark.parametrize("cls, culprit", [(planted.NoMaskLM, "attn"), (planted.LookAheadLM, "mix"),
                                          (planted.SequenceContextLM, "mix")])
def test_causality_names_the_first_module_that_sees_the_future(cls, culprit):
    result = causality(_net(cls), _batch())
    assert result.status == "fail", result
    assert result.culprit == culprit or result.culprit.startswith(culprit + "."), result


def test_causality_catches_labels_that_leak_the_answer():
    batch = _batch()
    batch["labels"] = torch.roll(batch["input_ids"], 1, dims=1)  # dataset shifted the wrong way
    result = causality(_net(planted.TinyCausalLM), batch)
    assert result.status == "fail" and result.culprit == "data: labels", result
    assert result.details["label_offset"] == 0


# ---- sample independence: BatchNorm over the batch, a view mixing batch and sequence ----

@pytest.mark.parametrize("cls", [planted.BatchNormLM, planted.ViewMixLM, planted.BatchCenterLM])
def test_sample_independence_names_the_mixing_module(cls):
    result = sample_independence(_net(cls), _batch())
    assert result.status == "fail", result
    assert result.culprit.startswith("mix"), result


# ---- train/eval: BatchNorm, a hand-written dropout, a non-finite eval path -------------------

@pytest.mark.parametrize("cls, words, culprit", [
    (planted.BatchNormLM, "part", "mix"), (planted.EvalNaNLM, "not finite", "mix"),
    # train stays random with every dropout off: judged in expectation, still named
    (planted.HandDropLM, "mean of", "mix"), (planted.BranchOffInEvalLM, "mean of", "mlp_drop")])
def test_train_eval_names_where_they_part(cls, words, culprit):
    result = train_eval(_net(cls), _batch())
    assert result.status == "fail" and words in result.message, result
    assert result.culprit.startswith(culprit), result


@pytest.mark.parametrize("cls", [planted.FunctionalDropoutLM, planted.DropPathLM])
def test_train_eval_passes_randomness_that_is_not_a_dropout_module(cls):
    """Functional dropout with its rate anywhere (nanoGPT's SDPA dropout_p from a config, a constant F.dropout,
    torch.dropout) is switched off like nn.Dropout; stochastic depth, which stays random, agrees in expectation."""
    result = train_eval(_net(cls), _batch())
    assert result.status == "pass", result
    assert result.details["stochastic"] is (cls is planted.DropPathLM), result


@pytest.mark.parametrize("family, attn", [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "eager"),
                                          ("llama", "sdpa")])
def test_train_eval_passes_hf_attention_dropout(family, attn):
    """GPT-2's own dropouts (attn_pdrop, resid_pdrop, embd_pdrop 0.1) and Llama's attention_dropout, under both
    attention implementations: silent."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                         attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
        net = transformers.GPT2LMHeadModel._from_config(config, attn_implementation=attn)
    else:
        config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.1,
                                          max_position_embeddings=32)
        net = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn)
    result = train_eval(net, _batch())
    assert result.status == "pass" and result.details["stochastic"] is False, result


def test_functional_dropout_is_back_after_the_probe():
    import torch.nn.functional as F

    from dsdebug.probes.train_eval import functional_dropout_off

    before = (F.dropout, F.scaled_dot_product_attention, torch.dropout)
    x = torch.ones(1000)
    with functional_dropout_off():
        assert torch.equal(F.dropout(x, 0.5, True), x) and torch.equal(torch.dropout(x, 0.5, True), x)
        assert torch.equal(F.dropout(x, p=0.9), x)
    assert (F.dropout, F.scaled_dot_product_attention, torch.dropout) == before
    assert not torch.equal(F.dropout(x, 0.5, True), x)


def test_train_eval_ignores_ordinary_dropout():
    net = _net(planted.TinyCausalLM)
    net.mlp.append(nn.Dropout(0.5))
    assert train_eval(net, _batch()).status == "pass"


# ---- coverage: added after the optimizer, a missing param group, no gradient, frozen moving ----

def test_coverage_parameter_added_after_the_optimizer():
    net = _net(planted.TinyCausalLM)
    stepper = _stepper(net)
    net.head = nn.Linear(32, V)  # replaced after the optimizer was built
    result, _ = coverage(stepper, _batch())
    assert result.status == "fail" and result.culprit.startswith("head."), result
    assert "not owned" in result.message


def test_coverage_param_group_left_out():
    net = _net(planted.TinyCausalLM)
    decay_only = [p for n, p in net.named_parameters() if p.ndim >= 2]  # the no-decay group forgotten
    result, _ = coverage(_stepper(net, params=decay_only), _batch())
    assert result.status == "fail" and (result.culprit.endswith(".bias") or result.culprit.startswith("norm")), result
    assert "not owned" in result.message


def test_coverage_parameter_without_gradient():
    net = _net(planted.DeadBranchLM)
    result, _ = coverage(_stepper(net), _batch())
    assert result.status == "fail" and result.culprit.startswith("unused."), result


def test_coverage_frozen_parameter_that_moves():
    net = _net(planted.InPlaceFrozenLM)
    result, _ = coverage(_stepper(net), _batch())
    assert result.status == "fail" and result.culprit == "scale" and "frozen" in result.message, result


# ---- overfit one batch: healthy falls; LR ~0, clipping, frozen parts explain a flat loss ----

def test_overfit_healthy_loss_falls():
    result, losses = overfit(_stepper(_net(planted.TinyCausalLM), lr=1e-2, clip=None), _batch(), steps=20)
    assert result.status == "pass" and losses[-1] <= 0.7 * losses[0], result
    assert 3 <= len(losses) < 20  # stops once the loss has fallen far


def test_overfit_tiny_lr_names_the_lr():
    result, _ = overfit(_stepper(_net(planted.TinyCausalLM), lr=1e-9), _batch(), steps=10)
    assert result.status == "fail" and result.culprit == "optim.lr" and "LR" in result.message, result


def test_overfit_clipping_names_the_clip():
    net = _net(planted.TinyCausalLM)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)  # SGD: a clipped update is a tiny update
    result, _ = overfit(TorchStepper(net, opt, _loss, clip=1e-6), _batch(), steps=10)
    assert result.status == "fail" and result.culprit == "optim.grad_clip", result


def test_overfit_frozen_model_points_at_coverage():
    net = _net(planted.TinyCausalLM)
    for p in net.parameters():
        p.requires_grad_(False)
    net.head.bias.requires_grad_(True)
    stepper = _stepper(net, lr=1e-3)
    result, _ = overfit(stepper, _batch(), steps=5, coverage_failed="embed.weight")
    assert result.status == "fail" and result.culprit == "embed.weight", result


# ---- the run's plan -------------------------------------------------------------------------

def _warmup_cosine(total, warmup_ratio):
    from dsdebug.models.optim import warmup_cosine

    return lambda opt: warmup_cosine(opt, total_steps=total, warmup_ratio=warmup_ratio)


def test_plan_healthy():
    lrs = lr_curve(_warmup_cosine(300, 0.1), 3e-3, 300)
    result = run_plan(lrs, 3e-3, 300, 1.0, 2.0, 8000, 16, 1.0)
    assert result.status == "pass" and result.details["peak_step"] == 30, result


def test_plan_warmup_longer_than_the_run():
    from dsdebug.models.optim import warmup_cosine

    # warmup_steps=1000 on a 100-step run: warmup_length clamps it to 99 steps, the peak is the last step's LR;
    # a constant-warmup scheduler that never gets there
    lrs = [3e-3 * (s + 1) / 1000 for s in range(100)]
    result = run_plan(lrs, 3e-3, 100, 1.0, 2.0, 8000, 16, 1.0)
    assert result.status == "fail" and result.culprit == "optim.scheduler.warmup_ratio", result
    assert warmup_cosine  # the project's own schedule clamps instead (see test_plan_healthy)


def test_plan_clip_shrinks_every_update():
    result = run_plan([1e-3] * 10, 1e-3, 10, 0.01, 50.0, 8000, 16, 1.0)
    assert result.status == "fail" and result.culprit == "optim.grad_clip", result


def test_plan_many_epochs_over_a_tiny_dataset():
    result = run_plan([1e-3] * 1000, 1e-3, 1000, 1.0, 1.0, 64, 16, 1.0)
    assert result.status == "fail" and result.culprit == "data.max_tokens" and "epochs" in result.message, result
    assert run_plan([1e-3] * 100, 1e-3, 100, 1.0, 1.0, 200, 16, 1.0).status == "warn"


def test_plan_no_token_counts_in_the_loss():
    result = run_plan([1e-3] * 10, 1e-3, 10, 1.0, 1.0, 8000, 16, 0.0)
    assert result.status == "fail" and result.culprit == "data: labels", result


def test_plan_a_silent_adjustment_is_a_warning_naming_the_key():
    result = run_plan([1e-3] * 10, 1e-3, 10, 1.0, 1.0, 8000, 16, 1.0,
                      adjustments=[("optim.grad_clip", "optim.grad_clip=1.0 but the strategy clips at 0.1")])
    assert result.status == "warn" and result.culprit == "optim.grad_clip", result


# ---- memory forecast ---------------------------------------------------------------------------

def test_memory_predicts_an_oom_with_ordered_advice():
    states = {"params": 4e9, "grads": 4e9, "optimizer": 8e9, "total": 16e9, "accelerator": 16e9}
    result = forecast(states, int(2e9), int(8e9), "a fake 8 GB device", "zero2", ["first do A", "then B"])
    assert result.status == "fail" and result.culprit == "model states", result
    assert result.advice.index("first do A") < result.advice.index("then B")
    ok = forecast(states, int(2e9), int(40e9), "a fake 40 GB device", "zero2", [])
    assert ok.status == "pass"


# ---- checkpoint round trip: frozen parameters left out, optimizer state not saved ----------------

def test_checkpoint_round_trip_healthy_and_frozen_left_out(tmp_path):
    batch = _batch()
    ok, _ = checkpoint_round_trip(_stepper(_net(planted.TinyCausalLM)), batch, str(tmp_path / "a.pt"))
    assert ok.status == "pass", ok
    bad, _ = checkpoint_round_trip(_stepper(_net(planted.DropsFrozenFromStateDict)), batch, str(tmp_path / "b.pt"))
    assert bad.status == "fail" and bad.culprit == "embed.weight" and "frozen" in bad.message, bad


def test_checkpoint_round_trip_optimizer_state_not_saved(tmp_path):
    class WeightsOnly(TorchStepper):
        def save(self, path):
            torch.save({"model": self.model.state_dict()}, path)

        def load(self, path):
            self.model.load_state_dict(torch.load(path, weights_only=True)["model"])

    net = _net(planted.TinyCausalLM)
    stepper = WeightsOnly(net, torch.optim.AdamW(net.parameters(), lr=1e-2), _loss)
    stepper.step(_batch())  # Adam moments exist at save time
    result, _ = checkpoint_round_trip(stepper, _batch(), str(tmp_path / "c.pt"))
    assert result.status == "fail" and "next step" in result.message, result
