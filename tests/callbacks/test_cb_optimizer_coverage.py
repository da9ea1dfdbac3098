"""``OptimizerCoverage`` in a plain Lightning Trainer: a tensor the loss learns from that no optimizer param group
holds is named at the first backward, four ways built differently (a layer made on the first forward, a parameter
replaced after the optimizer, weights in a Python list, a tensor attribute with requires_grad); tied weights, a
frozen base with inputs made to require grad, and a healthy net stay silent. Under DeepSpeed ZeRO: the matrix
(tests/trainer/test_runs_that_go_wrong.py, case ``param_outside_optimizer``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from dsdebug.callbacks.optimizer_coverage import OptimizerCoverage, graph_leaves, where_held
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel, get_channel
from dsdebug.probes.batch import lm_loss

V = 32


class Net(nn.Module):
    def __init__(self, plant: str = "") -> None:
        super().__init__()
        self.plant = plant
        self.embed = nn.Embedding(V, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, V)
        self.late = None
        if plant == "python_list":  # a Parameter in a plain list: not registered
            self.extra = [nn.Parameter(torch.ones(16))]
        if plant == "tensor_attribute":  # a plain tensor that requires grad
            self.scale = torch.ones(16, requires_grad=True)
        if plant == "tied":  # tied input/output embeddings: one parameter, two uses
            self.head.weight = self.embed.weight

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if self.plant == "lazy":  # a layer built on the first forward, after configure_optimizers
            if self.late is None:
                self.late = nn.Linear(16, 16)
            h = self.late(h)
        if self.plant == "python_list":
            h = h * self.extra[0]
        if self.plant == "tensor_attribute":
            h = h * self.scale
        return self.head(h + self.mlp(h))


class Module(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        return lm_loss(self.net(input_ids=batch["input_ids"]), batch)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class ReplaceHeadAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module):
        pl_module.net.head.weight = nn.Parameter(pl_module.net.head.weight.detach().clone())


def _data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, V, (8,), generator=g)), "labels": ids.clone()} for _ in range(32)]


def _fit(tmp_path, net: nn.Module, callbacks=(), steps: int = 4) -> list:
    configure_channel(tmp_path / "findings")
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[OptimizerCoverage(), *callbacks], default_root_dir=tmp_path)
    trainer.fit(Module(net), train_dataloaders=DataLoader(_data(), batch_size=4))
    return [f for f in get_channel().local if f.check == "optimizer_coverage"]


@pytest.mark.parametrize("plant, callbacks, named, how", [
    ("lazy", (), "late.weight", "registered after the optimizer"),
    ("", (ReplaceHeadAtStart(),), "head.weight", "replaced"),
    ("python_list", (), "extra[0]", "a Parameter the module tree does not register"),
    ("tensor_attribute", (), "scale", "a tensor attribute with requires_grad"),
])
def test_a_tensor_the_optimizer_does_not_hold_is_named_at_the_first_backward(plant, callbacks, named, how,
                                                                            tmp_path):
    found = _fit(tmp_path, Net(plant), callbacks)
    assert len(found) == 1, found  # once, not at every step
    f = found[0]
    assert f.code == "not_in_optimizer" and f.severity == "error" and f.step == 0, f
    assert f.details["tensors"][0] == named and how in f.details["how"][0], f
    if plant == "lazy":  # the layer's bias too, nothing else
        assert sorted(f.details["tensors"]) == ["late.bias", "late.weight"], f


def test_tied_weights_and_a_frozen_base_with_inputs_that_require_grad_are_silent(tmp_path):
    assert _fit(tmp_path, Net("tied")) == []
    net = Net()
    for p in net.embed.parameters():  # a frozen base whose inputs are made to require grad (gradient checkpointing)
        p.requires_grad_(False)
    net.embed.register_forward_hook(lambda m, i, out: out.requires_grad_(True))
    assert _fit(tmp_path / "b", net) == []


def test_the_walk_finds_the_leaves_and_the_attribute_paths():
    net = Net("python_list")
    loss = net(torch.zeros(2, 4, dtype=torch.long)).sum()
    leaves = {id(t) for t in graph_leaves(loss)}
    assert id(net.extra[0]) in leaves and id(net.head.weight) in leaves and id(net.embed.weight) in leaves
    assert where_held(net, {id(net.extra[0])}) == {id(net.extra[0]): "extra[0]"}
    with pytest.raises(ConfigError, match="callbacks.optimizer_coverage.every_n_steps=0 is invalid"):
        OptimizerCoverage(every_n_steps=0)
