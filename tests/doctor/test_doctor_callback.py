"""``DoctorCallback`` in a plain Lightning Trainer (no Hydra, no framework entry): the probes run at
on_fit_start, the fit ends before training, ``results`` holds one result per probe."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from dsdebug.doctor import DoctorCallback
from dsdebug.probes.batch import lm_loss
from dsdebug.doctor.callback import ORDER
from tests.planted import doctor_nets as planted

V = 64


class Module(L.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net
        self.strict_loading = False  # the planted non-strict load (a strict one would refuse the checkpoint)

    def training_step(self, batch, batch_idx):
        return lm_loss(self.net(input_ids=batch["input_ids"]), batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


def _fit(net: torch.nn.Module, tmp_path) -> DoctorCallback:
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, V, (16,), generator=g)), "labels": ids.clone()} for _ in range(32)]
    doctor = DoctorCallback(workdir=tmp_path / "doctor")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[doctor],
                        default_root_dir=tmp_path)
    module = Module(net)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=4))
    assert trainer.global_step == 0  # probes instead of training
    return doctor


def test_a_healthy_net_passes_in_a_plain_trainer(tmp_path):
    torch.manual_seed(0)
    doctor = _fit(planted.TinyCausalLM(vocab_size=V), tmp_path)
    assert [r.probe for r in doctor.results] == list(ORDER)
    assert {r.probe: r.status for r in doctor.results if r.status != "pass"} == {"collectives": "skip"}, \
        [(r.probe, r.message) for r in doctor.results]


def test_a_frozen_embedding_left_out_of_the_checkpoint_is_named(tmp_path):
    torch.manual_seed(0)
    doctor = _fit(planted.DropsFrozenFromStateDict(vocab_size=V), tmp_path)
    result = {r.probe: r for r in doctor.results}["checkpoint"]
    assert result.status == "fail" and result.culprit == "embed.weight", result


def test_a_probe_that_raises_is_a_skip_in_every_harness_and_a_collective_one_is_raised(monkeypatch):
    """One rule (probes/on_the_run.py guarded) for the doctor, preflight and outcome_monitor: a probe that raises
    judged nothing (skip, naming the error); a rank leaving a collective probe half-way would leave the others
    waiting in it: raised, not turned into a result. The other probes still run."""
    import pytest
    import torch

    import dsdebug.doctor.callback as doctor_callback
    from dsdebug.probes import registry
    from dsdebug.probes.on_the_run import guarded, run_registered
    from tests.planted.data import HealthyTinyLM

    def boom():
        raise RuntimeError("planted")

    local = guarded("causality", boom)
    assert local.status == "skip" and "RuntimeError: planted" in local.message and local.culprit == "<probe>"
    with pytest.raises(RuntimeError, match="planted"):
        guarded("coverage", boom, collective=True)
    assert not hasattr(doctor_callback, "_guard")  # the doctor has no rule of its own

    monkeypatch.setitem(registry.PROBES, "causality", registry.Probe(
        "causality", lambda inputs, locate: boom(), "planted"))
    net = HealthyTinyLM()
    batch = {"input_ids": torch.randint(0, 4096, (2, 8)), "labels": torch.randint(0, 4096, (2, 8))}
    results = run_registered(["init_loss", "causality", "sample_independence"],
                             registry.ProbeInputs(net, batch), any_rank=lambda flag: bool(flag))
    assert [(r.probe, r.status) for r in results][1] == ("causality", "skip")
    assert results[0].status in ("pass", "warn") and results[2].status == "pass", results