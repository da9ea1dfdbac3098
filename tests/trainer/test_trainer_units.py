"""Fast unit tests of the trainer plumbing: child-rank commands, LR scaling, secrets, errors."""

from __future__ import annotations

import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException

from dsdebug.errors import ConfigError
from dsdebug.trainer.cli import find_config_error
from dsdebug.distributed.launcher import hydra_child_command
from dsdebug.models.optim import param_groups, scaled_lr
from dsdebug.findings.secrets import redact
from tests.helpers.runs import CONF, REPO


def test_child_rank_command_uses_this_jobs_overrides_not_argv(monkeypatch, tmp_path):
    """Lightning re-sends sys.argv (with -m and sweep lists) to child ranks; we must not."""
    monkeypatch.setenv("PROJECT_ROOT", str(REPO))
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["optim.lr=0.001", "hparams_search=optuna", f"hydra.run.dir={tmp_path}"],
                      return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(tmp_path / "job0")
    cfg.hydra.runtime.cwd = str(REPO)
    HydraConfig.instance().set_config(cfg)
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "optim.lr=0.001,0.003", "strategy=zero2,zero3"])
    try:
        cmd, cwd = hydra_child_command(1)
    finally:
        HydraConfig.instance().cfg = None  # global: later tests must not see it
    assert cmd[1] == str(REPO / "train.py") and cwd == str(REPO)
    assert "-m" not in cmd and not any("," in a for a in cmd)
    assert "optim.lr=0.001" in cmd and "hparams_search=optuna" in cmd
    assert f'hydra.run.dir="{tmp_path / "job0"}"' in cmd
    assert "hydra.mode=RUN" in cmd  # the optuna preset sets MULTIRUN: the child must not sweep
    assert "hydra.output_subdir=null" in cmd and "hydra.job.name=rank1" in cmd


def test_linear_lr_scaling():
    assert scaled_lr(1e-3, global_batch_size=64, base_batch_size=None) == 1e-3
    assert scaled_lr(1e-3, global_batch_size=64, base_batch_size=32) == pytest.approx(2e-3)
    with pytest.raises(ConfigError, match="scale_lr_base_batch_size"):
        scaled_lr(1e-3, 64, 0)


def test_no_weight_decay_on_norms_biases_and_embeddings():
    import torch

    net = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(10, 4), "proj": torch.nn.Linear(4, 4),
                               "input_layernorm": torch.nn.LayerNorm(4)})
    decay, no_decay = param_groups(net.named_parameters())
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 4


def test_secrets_are_redacted_from_dumps():
    cfg = {"logger": {"wandb": {"api_key": "abc", "project": "p"}}, "hf_token": "hf_x", "tags": ["a"],
           "db": {"password": None}}
    out = redact(cfg)
    assert out["logger"]["wandb"] == {"api_key": "***", "project": "p"} and out["hf_token"] == "***"
    assert out["db"]["password"] is None and out["tags"] == ["a"]
    kept = {"model": {"tokenizer": "/models/gpt2"}, "data": {"max_tokens": 60000, "tokenizer": "org/name",
                                                             "token_budget": 4096, "token_budget_lr": "sqrt"},
            "net": {"pad_token_id": 0, "eos_token": "</s>", "pad_token": "<pad>"}}
    assert redact(kept) == kept  # a tokenizer's path, token counts, budgets, ids and special tokens are not secrets
    assert redact({"access_token": "x", "WANDB_TOKEN": "y", "token": "z"}) == {
        "access_token": "***", "WANDB_TOKEN": "***", "token": "***"}


def test_config_error_is_found_behind_hydra_instantiate():
    try:
        try:
            raise ConfigError("data.seq_len must be a positive int,\n got -1")
        except ConfigError as e:
            raise InstantiationException("Error in call to target 'x':\nConfigError(...)") from e
    except InstantiationException as wrapped:
        found = find_config_error(wrapped)
    assert str(found) == "data.seq_len must be a positive int, got -1"  # one line
