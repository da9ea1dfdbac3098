"""``Preflight`` in a plain Lightning Trainer: the doctor's cheap probes on the first real batch name
planted bugs (several per property, two the doctor's own tests do not use), stay quiet on a healthy
net, and leave the run exactly as it would be without them (weights, BatchNorm statistics, RNG)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from dsdebug.callbacks.preflight import Preflight
from dsdebug.config.args import subset_of
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel, get_channel
from dsdebug.probes.batch import lm_loss
from tests.planted import doctor_nets as planted

V = 64


class Module(L.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        return lm_loss(self.net(input_ids=batch["input_ids"]), batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


def _data(leak: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(32):
        ids = torch.randint(0, V, (16,), generator=g)
        labels = ids.clone()
        if leak:  # shifted in the dataset too, the wrong way: the target of position t is input t
            labels[1:] = ids[:-1]
        out.append({"input_ids": ids, "labels": labels})
    return out


def _fit(net: torch.nn.Module, tmp_path, callbacks: list, steps: int = 3, leak: bool = False) -> L.Trainer:
    configure_channel(tmp_path / "findings")  # this fit's findings only (get_channel().local)
    torch.manual_seed(1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        default_root_dir=tmp_path)
    trainer.fit(Module(net), train_dataloaders=DataLoader(_data(leak), batch_size=4, shuffle=True))
    return trainer


def _findings(check: Preflight) -> dict[str, object]:
    return {f.code: f for f in get_channel().local if f.check == "preflight"}


@pytest.mark.parametrize("cls, probe, culprit", [
    (planted.NoMaskLM, "causality", "attn"),
    (planted.LookAheadLM, "causality", "mix"),
    (planted.SequenceContextLM, "causality", "mix"),
    (planted.BatchNormLM, "sample_independence", "mix"),
    (planted.ViewMixLM, "sample_independence", "mix"),
    (planted.BatchCenterLM, "sample_independence", "mix"),
    (planted.HandDropLM, "train_eval", "mix"),
    (planted.EvalNaNLM, "train_eval", "mix"),
    (planted.HotHeadLM, "init_loss", "head"),
])
def test_a_planted_bug_is_named_with_its_module_at_the_first_batch(cls, probe, culprit, tmp_path):
    torch.manual_seed(0)
    check = Preflight()
    trainer = _fit(cls(vocab_size=V), tmp_path, [check], steps=2)
    assert trainer.global_step == 2  # the run goes on: the check reports, it does not stop it
    result = {r.probe: r for r in check.results}[probe]
    assert result.status == "fail", (result, check.results)
    assert result.culprit == culprit or result.culprit.startswith(culprit + "."), result
    finding = _findings(check)[probe]
    assert finding.severity == "error" and finding.step == 0 and culprit in finding.message, finding


def test_labels_shifted_the_wrong_way_are_named_as_the_data(tmp_path):
    torch.manual_seed(0)
    check = Preflight()
    _fit(planted.TinyCausalLM(vocab_size=V), tmp_path, [check], steps=1, leak=True)
    result = {r.probe: r for r in check.results}["causality"]
    assert result.status == "fail" and result.culprit == "data: labels", result


@pytest.mark.parametrize("cls", [planted.TinyCausalLM, planted.FunctionalDropoutLM, planted.DropPathLM])
def test_a_healthy_net_passes_every_probe_and_reports_one_info_line(cls, tmp_path):
    """Also with dropout the probe cannot zero as a module (nanoGPT's functional SDPA dropout, F.dropout,
    torch.dropout) and with randomness that stays (stochastic depth)."""
    torch.manual_seed(0)
    check = Preflight()
    _fit(cls(vocab_size=V), tmp_path, [check], steps=2)
    assert {r.probe: r.status for r in check.results} == {p: "pass" for p in
                                                         ("init_loss", "causality", "sample_independence",
                                                          "train_eval", "plan")}, check.results
    found = _findings(check)
    assert list(found) == ["preflight_summary"] and found["preflight_summary"].severity == "info", found


@pytest.mark.parametrize("cls", [planted.BatchNormLM, planted.HandDropLM, planted.TinyCausalLM])
def test_the_run_trains_exactly_what_it_would_without_the_check(cls, tmp_path):
    """BatchNorm's running statistics (train-mode probe forwards would move them), a hand-written
    dropout drawing from the global RNG, and the dropout/mode flags: all as without the check."""
    nets = []
    for callbacks in ([], [Preflight()]):
        torch.manual_seed(0)
        net = cls(vocab_size=V)
        _fit(net, tmp_path, callbacks, steps=3)
        nets.append(net.state_dict())
    without, with_check = nets
    assert without.keys() == with_check.keys()
    for key in without:
        assert torch.equal(without[key], with_check[key]), key


def test_the_probes_run_once_and_a_subset_can_be_chosen(tmp_path):
    torch.manual_seed(0)
    check = Preflight(probes=["causality"])
    _fit(planted.LookAheadLM(vocab_size=V), tmp_path, [check], steps=3)
    assert [r.probe for r in check.results] == ["causality"]
    assert len([f for f in get_channel().local if f.code == "causality"]) == 1


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"callbacks\.preflight\.probes=.*valid: a list of: init_loss"):
        Preflight(probes=["causalty"])
    with pytest.raises(ConfigError, match=r"callbacks\.preflight\.probes="):
        Preflight(probes="causality")
    assert subset_of("a", "b").test(["b"]) and not subset_of("a", "b").test(["c"])


def test_it_moves_itself_first_so_other_checks_do_not_record_its_forwards(tmp_path):
    from dsdebug.callbacks.reproducibility import Reproducibility

    torch.manual_seed(0)
    check = Preflight()
    repro = Reproducibility(replay_steps=1)
    trainer = _fit(planted.TinyCausalLM(vocab_size=V), tmp_path, [repro, check], steps=2)
    assert trainer.callbacks.index(check) < trainer.callbacks.index(repro)
    # the replay of step 0 saw the same module calls as step 0 (the probes' forwards were not recorded)
    assert not [f for f in get_channel().local if f.severity != "info"], get_channel().local


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_two_process_runs_pass_the_probes_on_every_rank(strategy, tmp_path_factory, shared_cache):
    import json

    from tests.helpers.shared_runs import healthy_run

    run_dir, _ = healthy_run(strategy, tmp_path_factory, shared_cache)
    records = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]
    mine = [r for r in records if r["check"] == "preflight"]
    assert [r["code"] for r in mine] == ["preflight_summary"], mine
    probes = mine[0]["details"]["probes"]
    assert {name: p["status"] for name, p in probes.items()} == {
        "init_loss": "pass", "causality": "pass", "sample_independence": "pass", "train_eval": "pass",
        "plan": "pass"}, probes


def test_every_rank_makes_the_same_forwards_when_one_rank_has_a_one_row_batch():
    """Token-budget batches vary per rank: rank 0 with 2 rows, rank 1 with 1. Under ZeRO-3 each forward is
    a collective, so the skip is agreed before any forward and both ranks make the same forwards."""
    from types import SimpleNamespace

    def forwards(rows: int) -> int:
        torch.manual_seed(0)
        net = planted.TinyCausalLM(vocab_size=V)
        calls = []
        net.register_forward_hook(lambda *a: calls.append(1))
        # the other rank's own answers to the agreed questions: "batch too small for it?" per probe (init_loss,
        # causality, sample_independence, train_eval), then "probe failed?"
        other = iter([False, False, rows == 2, False] + [False] * 8)
        strategy = SimpleNamespace(root_device=torch.device("cpu"),  # any_rank: a max-reduce of each rank's flag
                                   reduce=lambda t, reduce_op: torch.maximum(t, torch.tensor([float(next(other))])))
        trainer = SimpleNamespace(strategy=strategy, global_step=0, world_size=2)
        ids = torch.randint(0, V, (rows, 16))
        check = Preflight(probes=["init_loss", "causality", "sample_independence", "train_eval"])
        results = check.run_probes(trainer, SimpleNamespace(net=net), net, {"input_ids": ids, "labels": ids}, False)
        assert {r.probe: r.status for r in results}["sample_independence"] == "skip", results
        return len(calls)

    assert forwards(2) == forwards(1)


def test_a_failure_is_not_lost_when_the_traced_rerun_cannot_run_and_zero3_raises():
    from dsdebug.probes.on_the_run import probe_agreed
    from dsdebug.probes.result import ProbeResult

    def call(locate: bool) -> ProbeResult:
        if locate:
            raise MemoryError("the module trace does not fit")
        return ProbeResult("causality", "fail", "the output at position 3 changes", "<net>")

    kept = probe_agreed("causality", call, any_rank=lambda flag: flag)
    assert kept.status == "fail" and kept.culprit == "<net>", kept
    with pytest.raises(MemoryError):  # ZeRO-3: a rank leaving the probe's forwards would hang the others
        probe_agreed("causality", call, any_rank=lambda flag: flag, collective=True)
