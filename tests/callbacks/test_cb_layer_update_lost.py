"""layer_health's ``layer_update_lost`` in a plain Lightning Trainer: a layer whose update is orders below the step its
optimizer should give (adaptive: ~lr per element with a gradient; SGD: lr x the gradient) is named with its cause,
four ways built differently -- an eps of 1 in the optimizer's config, a loss scaled down in the user's code (both:
the gradient below eps), a clip threshold orders below the gradient norm (under AdamW and under SGD), 16-bit weights
stepped with no fp32 master copy (``precision="bf16-true"``, a small lr: the step rounds away) -- each at the first
steps (onset: step 0). Healthy AdamW, SGD with momentum, a large-vocabulary embedding seeing few rows, and
bf16-true at a usual lr stay silent. Through the framework at 2 ranks (ZeRO-2/3, DDP):
tests/callbacks/test_cb_layer_update_lost_runs.py."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from dsdebug.callbacks.layer_health import LayerHealth
from dsdebug.callbacks.layer_health.expected import lost_cause
from dsdebug.findings import configure_channel, get_channel
from dsdebug.probes.batch import lm_loss

H = 32


class Net(nn.Module):
    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, H)
        self.norm = nn.LayerNorm(H)
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
        self.head = nn.Linear(H, vocab, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        return self.head(h + self.mlp(self.norm(h)))


class Module(L.LightningModule):
    def __init__(self, net: nn.Module, optimizer: str = "AdamW", lr: float = 3e-3, loss_scale: float = 1.0,
                 **optimizer_args) -> None:
        super().__init__()
        self.net, self.optimizer, self.lr, self.loss_scale, self.optimizer_args = \
            net, optimizer, lr, loss_scale, optimizer_args

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.net(input_ids=batch["input_ids"]), batch)
        return loss * self.loss_scale  # < 1: a loss divided by a count it was already averaged over, say

    def configure_optimizers(self):
        return getattr(torch.optim, self.optimizer)(self.parameters(), lr=self.lr, **self.optimizer_args)


def _data(vocab: int = 32, seen: int | None = None) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(256):
        ids = torch.randint(0, seen or vocab, (16,), generator=g)
        ids[1::2] = ids[0::2]  # something to learn
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _fit(tmp_path, module: L.LightningModule, steps: int = 12, data: list | None = None, **trainer_args) -> list:
    configure_channel(tmp_path / "findings")
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[LayerHealth(every_n_steps=10, read_every_n_steps=10)], **trainer_args)
    trainer.fit(module, train_dataloaders=DataLoader(data or _data(), batch_size=8))
    return [f for f in get_channel().local if f.check == "layer_health"]


def _lost(found: list):
    hits = [f for f in found if f.code == "layer_update_lost"]
    assert len(hits) == 1, [f"{f.code}: {f.message}" for f in found]
    return hits[0]


def test_an_eps_of_one_is_named_at_the_first_steps(tmp_path):
    f = _lost(_fit(tmp_path, Module(Net(), eps=1.0)))
    assert f.details["cause"] == "eps" and f.details["eps"] == 1.0 and "optim.optimizer.eps" in f.advice
    assert {"norm", "mlp.0", "mlp.2"} <= set(f.details["layers"])  # one finding for the layers it names
    assert f.step <= 4 and f.details["ratio"] < 0.01  # onset: step 0; patience 3


def test_a_loss_scaled_down_in_code_puts_the_gradient_below_eps(tmp_path):
    f = _lost(_fit(tmp_path, Module(Net(), loss_scale=1e-9)))
    assert f.details["cause"] == "eps" and f.details["grad_rms"] < f.details["eps"] == 1e-8
    assert f.step <= 4


@pytest.mark.parametrize("optimizer,args", [("AdamW", {}), ("SGD", {"momentum": 0.9})])
def test_a_clip_orders_below_the_gradient_norm_is_named(tmp_path, optimizer, args):
    f = _lost(_fit(tmp_path, Module(Net(), optimizer=optimizer, lr=3e-3 if optimizer == "AdamW" else 0.1, **args),
                   gradient_clip_val=1e-9))
    assert f.details["cause"] == "clip" and f.details["clip"] == 1e-9 and f.details["clip_coef"] < 1e-6
    assert "gradient_clip_val" in f.advice and f.details["optimizer"] == optimizer and f.step <= 4


def test_bf16_weights_without_a_master_copy_round_a_small_step_away(tmp_path):
    found = _fit(tmp_path, Module(Net(), lr=1e-5), precision="bf16-true")
    f = _lost(found)  # one finding per cause: layers reaching the streak later are listed in the summary
    assert f.details["cause"] == "rounding" and "bf16-mixed" in f.advice and f.step <= 4
    assert "half their spacing" in f.message and f.details["floor"] == 0.5
    summary = [s for s in found if s.code == "layer_summary"][0]
    assert {"mlp.0", "mlp.2", "norm"} <= set(summary.details["update_lost"]["rounding"])


@pytest.mark.parametrize("case", ["adamw", "sgd_momentum", "big_vocab_few_rows", "bf16_true_usual_lr", "radam",
                                  "adagrad_keras"])
def test_healthy_optimizers_are_silent(tmp_path, case):
    vocab = 4096 if case == "big_vocab_few_rows" else 32
    module = {"adamw": Module(Net()), "sgd_momentum": Module(Net(), optimizer="SGD", lr=0.1, momentum=0.9),
              "big_vocab_few_rows": Module(Net(vocab)), "bf16_true_usual_lr": Module(Net(), lr=3e-3),
              # their step is not ~lr (RAdam's first steps are momentum SGD; Adagrad's shrinks): not judged
              "radam": Module(Net(), optimizer="RAdam", lr=1e-3),
              "adagrad_keras": Module(Net(), optimizer="Adagrad", lr=1e-2, initial_accumulator_value=0.1)}[case]
    trainer_args = {"precision": "bf16-true"} if case == "bf16_true_usual_lr" else {}
    found = _fit(tmp_path, module, steps=60, data=_data(vocab, seen=64 if vocab > 32 else None),
                 gradient_clip_val=1.0, **trainer_args)
    assert [f.message for f in found if f.severity != "info"] == []
    summary = [f for f in found if f.code == "layer_summary"][0]
    if case in ("radam", "adagrad_keras"):
        assert summary.details["min_update_vs_optimizer"] is None  # not judged
    else:
        assert 0.05 < summary.details["min_update_vs_optimizer"] < math.inf  # judged, with room to spare


def test_a_skipped_step_is_not_a_lost_update():
    check = LayerHealth(patience=1)
    check.set_layers(["a", "b"], [4.0, 4.0])
    check._expect.kind, check._expect.eps, check._expect.bits = ["adaptive"] * 2, [1e-8] * 2, [None] * 2
    assert check.judge_lost([1.0, 1.0], [0.0, 0.0], [4.0, 4.0], [4e-6, 4e-6]) == []  # no update anywhere
    found = check.judge_lost([1.0, 1.0], [4e-6, 0.0], [4.0, 4.0], [4e-6, 4e-6])  # a moved by lr, b not at all
    assert [(code, check._layers[i], d["cause"]) for code, i, _, _, d in found] == [("layer_update_lost", "b",
                                                                                       "unknown")]


def test_an_unmapped_or_lr_zero_layer_is_not_judged():
    check = LayerHealth(patience=1)
    check.set_layers(["a", "b"], [4.0, 4.0])
    check._expect.kind, check._expect.eps, check._expect.bits = [None, "adaptive"], [0.0, 1e-8], [None, None]
    assert check.judge_lost([1.0, 1.0], [1e-9, 1e-9], [4.0, 4.0], [4e-6, 0.0]) == []  # a: no group; b: lr 0


@pytest.mark.parametrize("args,cause", [
    (("adaptive", 1e-3, 1e-10, 1e-8, 1.0, None, 0.02), "eps"),
    (("adaptive", 1e-3, 1e-3, 1e-8, 1e-9, None, 0.02), "clip"),  # clipped gradient 1e-12 < eps
    (("adaptive", 1e-3, 1e-3, 1e-8, 0.5, None, 0.02), "unknown"),  # a mild clip does not touch Adam's step
    (("sgd", 1e-6, 1e-3, 0.0, 1e-4, None, 0.02), "clip"),
    (("adaptive", 1e-5, 1e-3, 1e-8, 1.0, 8, 0.02), "rounding"),  # bf16 spacing at 0.02: 7.8e-5
    (("adaptive", 1e-3, 1e-3, 1e-8, 1.0, 8, 0.02), "unknown"),
])
def test_the_cause_follows_the_facts(args, cause):
    assert lost_cause(*args) == cause


def test_the_optimizer_kind_decides_what_step_is_expected():
    from dsdebug.callbacks.layer_health.expected import _kind

    p = [nn.Parameter(torch.ones(2, 2))]
    assert _kind(torch.optim.AdamW(p), torch.optim.AdamW(p).param_groups[0]) == "adaptive"
    assert _kind(torch.optim.RMSprop(p), torch.optim.RMSprop(p).param_groups[0]) == "adaptive"
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9)
    assert _kind(sgd, sgd.param_groups[0]) == "sgd"

    for name in ("RAdam", "Adagrad", "Adadelta"):  # their step is not ~lr per element from the first step
        opt = getattr(torch.optim, name)(p)
        assert _kind(opt, opt.param_groups[0]) is None

    class Muon(torch.optim.SGD):  # an orthogonalised step: ~lr / sqrt(width) per element, not judged against lr
        pass
    assert _kind(Muon(p, lr=0.1), {"lr": 0.1, "momentum": 0.95, "eps": 1e-7}) is None
    assert _kind(object(), {"lr": None, "scale_parameter": True}) is None  # no betas, no eps: unknown

    class Adafactor(torch.optim.SGD):  # transformers': a step relative to the weight's RMS
        pass
    assert _kind(Adafactor(p, lr=0.1), {"lr": 1e-3, "eps": (1e-30, 1e-3), "beta1": None}) is None


def test_a_16_bit_copy_of_an_fp32_master_is_not_judged_below_its_spacing():
    """DeepSpeed bf16: the weights measured are the bf16 copy of an fp32 master; a norm gain at 1.0 moves by whole
    bf16 spacings (~3.9e-3) only after several steps of lr 3e-4: not a lost update (the 'rounding' rule is for 16-bit
    weights the optimizer writes itself)."""
    check = LayerHealth(patience=1)
    check.set_layers(["norm", "mlp"], [4.0, 4.0])
    exp = check._expect
    exp.kind, exp.eps, exp.bits, exp.direct = ["adaptive"] * 2, [1e-8] * 2, [8, 8], False
    lr_sq = [4 * 3e-4 ** 2] * 2
    assert check.judge_lost([1.0, 1.0], [0.0, 4 * 3e-4 ** 2], [4.0, 4 * 0.02 ** 2], lr_sq) == []
    assert check._lost == [0, 0]
    exp.direct = True  # bf16-true: the optimizer writes the bf16 weights, the step rounds away
    found = check.judge_lost([1.0, 1.0], [0.0, 4 * 3e-4 ** 2], [4.0, 4 * 0.02 ** 2], lr_sq)
    assert [(check._layers[i], d["cause"]) for _, i, _, _, d in found] == [("norm", "rounding")]


def test_a_checkpoint_of_the_previous_version_resumes(tmp_path):
    """A layer_health state saved before min_update_vs_optimizer existed: the restored closest calls gain it."""
    check = LayerHealth(patience=1)
    check.set_layers(["a", "b"], [4.0, 4.0])
    old = {"_seen": [1, 1], "_closest": {"min_grad_rel": 0.5, "min_update_rel": 1.0, "max_explode_ratio": 1.0,
                                         "min_early_rel": 0.1}}
    check.load_state_dict(old)
    check._expect.kind, check._expect.eps, check._expect.bits = ["adaptive"] * 2, [1e-8] * 2, [None] * 2
    check.judge_lost([1.0, 1.0], [4e-6, 4e-6], [4.0, 4.0], [4e-6, 4e-6])
    assert check._closest["min_grad_rel"] == 0.5 and check._closest["min_update_vs_optimizer"] == pytest.approx(1.0)


def test_a_sparse_embedding_gradient_is_counted():
    from dsdebug.callbacks.layer_health.check import _nonzero

    emb = nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 1, 3])).sum().backward()
    assert emb.weight.grad.is_sparse and int(_nonzero(emb.weight.grad)) == 8
