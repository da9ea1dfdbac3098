"""Gradient checkpointing is on only when a user's ds_config asks for it.

Lightning's DeepSpeedStrategy builds its default config (no ds_config given: strategy=zero2) with
an all-false "activation_checkpointing" section; taking that for a request recomputed every
forward in backward (~30 % more CPU per step at 2 ranks in benchmarks/framework_vs_raw.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsdebug.trainer.strategy import DebugDeepSpeedStrategy


class _Net(torch.nn.Module):
    supports_gradient_checkpointing = True

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.calls += 1


def _turned_on(strategy: DebugDeepSpeedStrategy) -> int:
    net = _Net()
    strategy._lightning_module = SimpleNamespace(net=net)  # what _format_config reads
    from lightning.pytorch.strategies import DeepSpeedStrategy

    original = DeepSpeedStrategy._format_config
    DeepSpeedStrategy._format_config = lambda self: None
    try:
        strategy._format_config()
    finally:
        DeepSpeedStrategy._format_config = original
    return net.calls


def test_lightning_default_config_does_not_turn_checkpointing_on():
    strategy = DebugDeepSpeedStrategy(stage=2)
    assert isinstance(strategy.config.get("activation_checkpointing"), dict)  # Lightning's all-false section
    assert _turned_on(strategy) == 0


def test_a_users_ds_config_section_still_turns_it_on():
    strategy = DebugDeepSpeedStrategy(config={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1,
                                              "activation_checkpointing": {"partition_activations": False}})
    assert _turned_on(strategy) == 1
    assert _turned_on(DebugDeepSpeedStrategy(config={"zero_optimization": {"stage": 2},
                                                     "train_micro_batch_size_per_gpu": 1})) == 0
