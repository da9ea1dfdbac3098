"""The run header names the net that was built, not only the model group (``model.net._target_`` may point
elsewhere: ``model=deepseek_v3_tiny`` alone named a net the run did not build)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf


class TinyNet(torch.nn.Module):
    pass


def test_header_names_the_built_net(monkeypatch, caplog, tmp_path):
    from hydra.core.hydra_config import HydraConfig

    from dsdebug.trainer import entry

    choices = {"model": "deepseek_v3_tiny", "data": "kjv", "strategy": "ddp"}
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: SimpleNamespace(runtime=SimpleNamespace(choices=choices))))
    with caplog.at_level(logging.INFO, logger=entry.log.name):
        entry._print_header(OmegaConf.create({"callbacks": {}}), tmp_path, SimpleNamespace(net=TinyNet()))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run: "))
    assert "model=deepseek_v3_tiny net=TinyNet data=kjv" in line, line
