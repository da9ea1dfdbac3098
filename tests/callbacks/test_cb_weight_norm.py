"""``WeightNorm`` in a plain Lightning Trainer: weights collapsing toward zero are named with the parameter and the
cause, four ways built differently (Adam's coupled L2 weight_decay, an L2 penalty in the loss under Adam, an AdamW
weight_decay far too large on every parameter incl. norm gains, a manual ``p.mul_()`` outside the optimizer); a
healthy AdamW run, a zero-initialised parameter and tied weights stay silent. Under the framework's strategies
(DDP, ZeRO-2/3, 2 ranks): tests/callbacks/test_cb_weight_norm_runs.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from dsdebug.callbacks.grad_access import decay_coupled
from dsdebug.callbacks.weight_norm import WeightNorm, decay_cause
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel, get_channel
from dsdebug.probes.batch import lm_loss

V, H = 32, 32


class Net(nn.Module):
    def __init__(self, zero_gate: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.norm = nn.LayerNorm(H)
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
        self.head = nn.Linear(H, V, bias=False)
        self.gate = nn.Parameter(torch.zeros(H)) if zero_gate else None  # LoRA-B / ReZero style: starts at 0
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, input_ids):
        h = self.embed(input_ids)
        branch = self.mlp(self.norm(h))
        h = h + (branch * self.gate if self.gate is not None else branch)
        return self.head(h)


class Module(L.LightningModule):
    def __init__(self, net: nn.Module, optimizer: str = "AdamW", weight_decay: float = 0.1, groups: bool = True,
                 lr: float = 3e-3, penalty: float = 0.0) -> None:
        super().__init__()
        self.net, self.optimizer, self.wd, self.groups, self.lr, self.penalty = \
            net, optimizer, weight_decay, groups, lr, penalty

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.net(input_ids=batch["input_ids"]), batch)
        if self.penalty:  # an L2 penalty written into the loss (under Adam: normalised like the gradient)
            loss = loss + self.penalty * sum((p ** 2).sum() for p in self.parameters())
        return loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.groups:  # the usual grouping: no decay on norm gains and biases
            groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": self.wd},
                      {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        else:
            groups = [{"params": params, "weight_decay": self.wd}]
        return getattr(torch.optim, self.optimizer)(groups, lr=self.lr)


class ShrinkOutsideTheOptimizer(L.Callback):
    """A hand-written 'decay' after every step that forgot the LR: every weight x 0.8."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            for p in pl_module.net.mlp.parameters():
                p.mul_(0.8)


def _data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(256):
        ids = torch.randint(0, V, (16,), generator=g)
        ids[1::2] = ids[0::2]  # something to learn
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _fit(tmp_path, module: L.LightningModule, callbacks=(), steps: int = 30, **check) -> list:
    configure_channel(tmp_path / "findings")
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[WeightNorm(**check), *callbacks], default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=DataLoader(_data(), batch_size=8))
    return [f for f in get_channel().local if f.check == "weight_norm"]


def _collapse(found: list):
    hits = [f for f in found if f.code == "weight_collapse"]
    assert hits, [f"{f.code}: {f.message}" for f in found]
    return hits[0]


def test_adam_coupled_weight_decay_is_named_with_the_key(tmp_path):
    f = _collapse(_fit(tmp_path, Module(Net(), optimizer="Adam", weight_decay=0.1)))
    assert f.details["cause"] == "coupled_l2" and f.details["optimizer"] == "Adam"
    assert f.details["param"].startswith(("mlp.", "embed.", "head."))
    assert "AdamW" in f.advice and "weight_decay=0.1" in f.message
    assert f.details["ratios"][0] > 0.4  # named at its onset: the first check below 0.5x (the fall is steady)
    assert f.severity == "error" and f.details["share"] >= 0.1


def test_an_l2_penalty_in_the_loss_under_adam_is_more_than_the_decay_can_give(tmp_path):
    f = _collapse(_fit(tmp_path, Module(Net(), optimizer="Adam", weight_decay=0.0, penalty=0.05)))
    assert f.details["cause"] == "outside" and "penalty" in f.message and f.details["weight_decay"] == 0.0


def test_a_weight_decay_far_too_large_on_norm_gains_is_the_decay(tmp_path):
    found = _fit(tmp_path, Module(Net(), weight_decay=20.0, groups=False, lr=1e-2), steps=30)
    hits = [f for f in found if f.code == "weight_collapse"]
    assert hits, [f.message for f in found]
    causes = {f.details["cause"] for f in hits}
    assert causes <= {"decay", "decay_on_norm"}, causes
    gain = [f for f in hits if "norm.weight" in f.details["params"]]  # the LayerNorm gain, decayed: it should not be
    assert gain and gain[0].details["cause"] == "decay_on_norm" and "are norm gains or biases" in gain[0].message
    assert any("weight_decay" in f.advice for f in hits)


def test_a_manual_shrink_outside_the_optimizer_is_named(tmp_path):
    f = _collapse(_fit(tmp_path, Module(Net()), callbacks=[ShrinkOutsideTheOptimizer()], steps=15))
    assert f.details["cause"] == "outside" and f.details["param"].startswith("mlp.")
    assert f.step <= 5  # x0.8 per step: below half by step 3, named at the first check that can


@pytest.mark.parametrize("net", [Net(), Net(zero_gate=True), Net(tied=True)], ids=["plain", "zero_gate", "tied"])
def test_a_healthy_adamw_run_is_silent(tmp_path, net):
    found = _fit(tmp_path, Module(net), steps=120)
    assert [f.message for f in found if f.severity != "info"] == []
    summary = [f for f in found if f.code == "weight_summary"]
    assert len(summary) == 1 and summary[0].details["lowest"][0]["ratio"] > 0.5


def test_coupled_decay_is_told_from_decoupled():
    p = [nn.Parameter(torch.ones(2))]
    assert decay_coupled(torch.optim.Adam(p, weight_decay=0.1), {"weight_decay": 0.1})
    assert not decay_coupled(torch.optim.Adam(p, weight_decay=0.0), {"weight_decay": 0.0})
    assert not decay_coupled(torch.optim.AdamW(p, weight_decay=0.1), {"weight_decay": 0.1})
    assert not decay_coupled(torch.optim.SGD(p, lr=0.1, weight_decay=0.1), {"weight_decay": 0.1})
    assert decay_coupled(torch.optim.RMSprop(p, weight_decay=0.1), {"weight_decay": 0.1})

    class Wrapper:  # a DeepSpeed-style wrapper holding the base optimizer
        optimizer = torch.optim.Adam(p, weight_decay=0.1)
    assert decay_coupled(Wrapper(), {"weight_decay": 0.1})

    class FusedAdamLike(torch.optim.Optimizer):  # DeepSpeed's FusedAdam: adam_w_mode decides
        def __init__(self, adam_w_mode):
            super().__init__(p, {"lr": 1e-3, "weight_decay": 0.1})
            self.adam_w_mode = adam_w_mode
    assert decay_coupled(FusedAdamLike(False), {"weight_decay": 0.1})
    assert not decay_coupled(FusedAdamLike(True), {"weight_decay": 0.1})


@pytest.mark.parametrize("args,cause", [
    ((True, 1e-3, 0.1, 0.99, 0.3, False), "coupled_l2"),
    ((False, 1e-2, 20.0, 0.01, 0.3, False), "decay"),
    ((False, 1e-2, 20.0, 0.01, 0.3, True), "decay_on_norm"),
    ((False, 3e-3, 0.1, 0.97, 0.3, False), "outside"),  # decay alone: 3 % of the fall to 0.3x
    ((False, 3e-4, 0.1, 0.4, 0.45, False), "expected"),  # a usual decay over a long run: its equilibrium
    ((False, 3e-4, 0.1, 0.4, 0.45, True), "decay_on_norm"),
    ((False, 3e-3, 0.0, 1.0, 0.1, False), "outside"),
])
def test_the_cause_is_what_the_configured_decay_can_and_cannot_give(args, cause):
    assert decay_cause(*args) == cause


def test_judging_needs_a_fall_below_the_fraction_and_a_streak():
    check = WeightNorm(patience=3, collapse_fraction=0.5)
    check._names, check._numel, check._one_dim = ["a", "b"], [4.0, 4.0], [False, False]
    check._reset(2)
    named = []
    # a: falls steadily to 0.4x; b: drops to 0.4x once, then wobbles (not a streak)
    for a, b in [(1.0, 1.0), (0.8, 0.4), (0.6, 0.45), (0.5, 0.41), (0.4, 0.43), (0.35, 0.42)]:
        named += check.judge(None, 0, [a, b], [])
    assert named == ["a"]
    assert check.judge(None, 0, [0.3, 0.4], []) == []  # once per episode
    assert check._lowest[1] == pytest.approx(0.4)


def test_a_small_fall_the_config_does_not_explain_waits_for_a_share_of_the_weights():
    check = WeightNorm(patience=1, share=0.1)
    check._names, check._numel, check._one_dim = ["gain", "matrix"], [1.0, 99.0], [True, False]
    check._reset(2)
    assert check.judge(None, 0, [1.0, 1.0], []) == []
    assert check.judge(None, 1, [0.4, 1.0], []) == []  # 1 % of the weights, no decay to blame: learning
    assert check._named == [1, 0]
    assert check.judge(None, 2, [0.3, 0.4], []) == ["gain", "matrix"]  # now 100 %: both, once
    assert check.judge(None, 3, [0.2, 0.3], []) == []


def _judged(numel, one_dim, groups, group_of, coupled=None):
    check = WeightNorm(patience=1, share=0.1)
    n = len(numel)
    check._names, check._numel, check._one_dim = [f"p{i}" for i in range(n)], numel, one_dim
    check._reset(n)
    check._groups, check._group_of = groups, group_of
    check._coupled = coupled or [False] * len(groups)
    check._momentum_sgd = [False] * len(groups)
    return check


def test_a_usual_decay_settling_weights_over_a_long_run_is_not_reported():
    # lr 3e-4 x wd 0.1 over ~30k steps compounds to ~0.4x: the matrices settle where the decay holds them
    check = _judged([50.0, 50.0], [False, False], [{"lr": 3e-4, "weight_decay": 0.1}], [0, 0])
    log = [math.log(0.4)]
    assert check.judge(None, 0, [1.0, 1.0], log) == []
    assert check.judge(None, 1, [0.45, 0.45], log) == []
    assert check._named == [3, 3] and check._counts == {}
    assert check.judge(None, 2, [0.44, 0.44], log) == []  # not again either


@pytest.mark.parametrize("group_of,cause", [([0, 0, -1], "coupled_l2"), ([0, -1, -1], "outside")])
def test_the_message_takes_the_facts_of_the_cause_it_names(tmp_path, group_of, cause):
    """p2 (no optimizer group) falls furthest, so it heads the list; the facts quoted are those of a parameter with
    the cause the finding names (the worst one's group may have none: it used to raise a KeyError)."""
    configure_channel(tmp_path / "findings")
    check = _judged([80.0, 10.0, 10.0], [False] * 3, [{"lr": 1e-3, "weight_decay": 0.1}], group_of, coupled=[True])
    check._optimizer_name = "Adam"
    assert check.judge(None, 0, [1.0, 1.0, 1.0], [0.0]) == []
    assert check.judge(None, 1, [0.45, 0.4, 0.3], [0.0]) == ["p0", "p1", "p2"]
    (finding,) = [f for f in get_channel().local if f.code == "weight_collapse"]
    assert finding.details["cause"] == cause and finding.details["param"] == "p2"
    if cause == "coupled_l2":
        assert finding.details["weight_decay"] == 0.1 and "weight_decay=0.1 is an L2 term" in finding.message
    else:
        assert "weight_decay" not in finding.details and "more than the optimizer's decay" in finding.message
    assert finding.severity == "error"  # every parameter collapsed


def test_a_resume_of_another_net_starts_afresh_in_either_restore_order():
    saved = WeightNorm()
    saved._reset(3)
    saved._first = [1.0, 2.0, 3.0]
    state = saved.state_dict()
    for order in ("restore_first", "fit_first"):  # DDP restores before on_fit_start, DeepSpeed after it
        check = WeightNorm()
        if order == "restore_first":
            check.load_state_dict(state)
        check.on_fit_start(SimpleNamespace(strategy=object()), nn.Linear(2, 2))  # 2 parameters: weight, bias
        if order == "fit_first":
            check.load_state_dict(state)
        assert check._first == [None, None], order
        assert check.judge(None, 0, [1.0, 1.0], []) == []  # no IndexError


def test_non_finite_and_zero_norms_are_left_out():
    check = WeightNorm(patience=1)
    check._names, check._numel, check._one_dim = ["a", "b"], [1.0, 1.0], [False, False]
    check._reset(2)
    assert check.judge(None, 0, [0.0, math.nan], []) == []
    assert check.judge(None, 1, [1.0, math.nan], []) == []  # a: zero first norm, no scale to fall from


@pytest.mark.parametrize("key,value", [("collapse_fraction", 0), ("collapse_fraction", 1.5), ("patience", 0),
                                       ("every_n_steps", 0), ("read_every_n_steps", -1), ("on_error", "explode")])
def test_bad_values_are_one_line_config_errors(key, value):
    with pytest.raises(ConfigError, match=f"callbacks.weight_norm.{key}"):
        WeightNorm(**{key: value})
