"""``TrainMode`` in a plain Lightning Trainer: a model.eval() left behind by user code during training is named at the
next step with the module it reaches, several ways (a callback on the whole model, a helper in training_step on the
net, a submodule, the whole tree from the start); modes set on purpose (a frozen BatchNorm, an eval/train pair, a
validation) stay silent."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from dsdebug.callbacks.train_mode import TrainMode, top_of
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel, get_channel
from dsdebug.probes.batch import lm_loss

V = 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        self.norm = nn.BatchNorm1d(16)
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(16, V)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h + self.mlp(h))


class Module(L.LightningModule):
    def __init__(self, eval_helper_at: int | None = None) -> None:
        super().__init__()
        self.net, self.eval_helper_at = Net(), eval_helper_at

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.net(input_ids=batch["input_ids"]), batch)
        if batch_idx == self.eval_helper_at:  # an evaluation helper in the training step, never undone
            self.net.eval()
            with torch.no_grad():
                self.net(input_ids=batch["input_ids"][:1])
        return loss

    def validation_step(self, batch, batch_idx):
        return lm_loss(self.net(input_ids=batch["input_ids"]), batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class AtStep(L.Callback):
    """After the update that makes ``global_step == step``: ``action(pl_module)`` (a sample printer, a freeze); step
    ``step`` is the first to train in the modes it leaves."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.action(pl_module)


class AtTrainStart(L.Callback):
    def __init__(self, action) -> None:
        self.action = action

    def on_train_start(self, trainer, pl_module):
        self.action(pl_module)


def _data() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, V, (8,), generator=g)), "labels": ids.clone()} for _ in range(64)]


def _fit(tmp_path, callbacks: list = (), module: Module | None = None, steps: int = 8, val_every: int | None = None,
         before_fit=None) -> list:
    configure_channel(tmp_path / "findings")
    torch.manual_seed(0)
    module = module or Module()
    if before_fit is not None:
        before_fit(module)
    loader = DataLoader(_data(), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[TrainMode(), *callbacks],
                        default_root_dir=tmp_path, val_check_interval=val_every, num_sanity_val_steps=0,
                        limit_val_batches=2 if val_every else 0)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=DataLoader(_data()[:8], batch_size=4))
    assert trainer.global_step == steps
    return [f for f in get_channel().local if f.check == "train_mode"]


def _eval(m):
    m.eval()


@pytest.mark.parametrize("plant, onset, culprit, words", [
    # a sample printer in a callback: the whole LightningModule in eval
    (lambda: {"callbacks": [AtStep(2, _eval)]}, 2, "<Module>", "1 dropout layer(s) off"),
    # an evaluation helper in training_step: the net
    (lambda: {"module": Module(eval_helper_at=4)}, 5, "net", "1 norm layer(s) on their running statistics"),
    # one submodule (a generation helper on the MLP)
    (lambda: {"callbacks": [AtStep(1, lambda m: m.net.mlp.eval())]}, 1, "net.mlp", "1 dropout layer(s) off"),
    # the whole tree from the start
    (lambda: {"callbacks": [AtTrainStart(_eval)]}, 0, "<Module>", "whole module tree"),
])
def test_a_model_eval_left_behind_is_named_at_the_next_step(plant, onset, culprit, words, tmp_path):
    found = _fit(tmp_path, **plant())
    errors = [f for f in found if f.code == "eval_mode_in_training"]
    assert len(errors) == 1, found
    assert errors[0].severity == "error" and errors[0].step == onset, errors[0]
    assert errors[0].details["modules"] == [culprit] and words in errors[0].message, errors[0]
    assert [f for f in found if f.severity != "info"] == errors  # nothing else, and once


def test_healthy_modes_are_silent(tmp_path):
    """An eval/train pair in a callback, a validation every 3 steps (Lightning puts the modes back), nothing to say."""

    def printer(m):
        m.eval()
        m.train()

    assert _fit(tmp_path, [AtStep(2, printer)], val_every=3) == []


def test_a_batchnorm_frozen_before_the_fit_is_the_run_s_mode_and_unfreezing_it_is_a_warning(tmp_path):
    found = _fit(tmp_path, [], before_fit=lambda m: m.net.norm.eval())
    assert found == [], found  # frozen on purpose, held for the whole run (Lightning keeps a submodule's mode)
    found = _fit(tmp_path / "b", [AtStep(3, lambda m: m.train())], before_fit=lambda m: m.net.norm.eval())
    assert [(f.code, f.step, f.details["modules"]) for f in found] == [("train_mode_changed", 3, ["net.norm"])], found


def test_a_flip_undone_and_done_again_is_reported_again(tmp_path):
    def toggle(m):
        m.eval() if m.training else m.train()

    found = _fit(tmp_path, [AtStep(1, toggle), AtStep(3, toggle), AtStep(5, toggle)], steps=8)
    assert [(f.code, f.step) for f in found] == [("eval_mode_in_training", 1), ("eval_mode_in_training", 5)], found


def test_every_n_steps_is_checked_and_the_roots_of_flipped_subtrees_are_named():
    with pytest.raises(ConfigError, match="callbacks.train_mode.every_n_steps=0 is invalid"):
        TrainMode(every_n_steps=0)
    assert top_of(["a", "a.b", "c.d", "c.d.e", "cx"]) == ["a", "c.d", "cx"]
    assert top_of(["<M>", "a", "a.b"]) == ["<M>"]
