"""freeze_verify: parameters that should learn but don't are named with the reason; train_only
really freezes the rest (ZeRO-3, 2 processes); healthy runs only say info. The CLI runs are
shared with test_cb_grad_monitor.py (tests/planted/grads.py); the healthy 2-process DDP run with
other tests (tests/helpers/shared_runs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dsdebug.callbacks.freeze_verify import FreezeVerify
from dsdebug.errors import ConfigError
from dsdebug.findings import configure_channel
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, assert_ok, train_in_process
from tests.helpers.findings import one, read_findings
from tests.helpers.shared_runs import grad_run, healthy_run
from tests.planted.grads import changed_params


def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"on_error": "skip"}, "on_error"), ({"check_after_steps": 0}, "check_after_steps"),
                        ({"freeze": ["re:layers.(0"]}, "freeze")):
        with pytest.raises(ConfigError, match=f"callbacks.freeze_verify.{key}.*valid: "):
            FreezeVerify(**kwargs)


class _FiveWays(nn.Module):
    """a: lr=0 group; b: output x 0; c: not given to the optimizer; d: frozen by config but
    changed in place by forward; e: healthy."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(4, 4) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.d.weight.add_(1.0)
        return self.e(x) + self.a(x) + 0 * self.b(x) + self.c(x) + self.d(x)


def test_reasons_lr_zero_zero_grad_not_in_optimizer_frozen_changed():
    channel = configure_channel(None)
    module = nn.Module()
    module.net = _FiveWays()
    cb = FreezeVerify(freeze=["d.*"], check_after_steps=2)
    trainer = SimpleNamespace(global_rank=0, world_size=1, global_step=0, strategy=object(), optimizers=[])
    cb.setup(trainer, module, "fit")
    net = module.net
    opt = torch.optim.AdamW([{"params": net.e.parameters()}, {"params": net.a.parameters(), "lr": 0.0},
                             {"params": net.b.parameters()}], lr=0.1)
    trainer.optimizers = [opt]
    cb.on_train_start(trainer, module)
    for _ in range(2):
        net(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, module, None, None, 0)
    codes = {f.code: f.details["params"] for f in channel.local if f.severity == "error"}
    assert codes == {"lr_zero_param": ["a.weight", "a.bias"], "zero_grad_param": ["b.weight", "b.bias"],
                     "not_in_optimizer": ["c.weight", "c.bias"], "frozen_param_changed": ["d.weight"]}
    assert cb._handles == []  # every hook removed after the check


def test_tied_weights_match_by_either_name_and_conflicts_are_errors():
    module = nn.Module()
    module.net = nn.Module()
    module.net.embed, module.net.mid = nn.Embedding(8, 4), nn.Linear(4, 4)
    module.net.head = nn.Linear(4, 8, bias=False)
    module.net.head.weight = module.net.embed.weight  # tied: named_parameters() lists only embed.weight
    trainer = SimpleNamespace(global_rank=1, world_size=1, global_step=0)
    FreezeVerify(freeze=["head.*", "embed.*"]).setup(trainer, module, "fit")
    assert not module.net.embed.weight.requires_grad
    module.net.embed.weight.requires_grad_(True)
    with pytest.raises(ConfigError, match="net.embed.weight and net.head.weight are one tied tensor"):
        FreezeVerify(freeze=["head.*"]).setup(trainer, module, "fit")


def test_unused_detached_and_model_frozen_params_named(tmp_path_factory, shared_cache):
    _, run_dir = grad_run("zero2_dead_net", tmp_path_factory, shared_cache)  # in this process
    found = read_findings(run_dir, "freeze_verify")
    unused, detached = one(found, "unused_param"), one(found, "detached_param")
    frozen = one(found, "frozen_outside_config")
    assert unused["details"]["params"] == ["unused.weight", "unused.bias"] and "unused.weight" in unused["message"]
    assert detached["details"]["params"] == ["detached.weight", "detached.bias"]
    assert "its module ran in forward" in detached["message"]
    assert frozen["details"]["params"] == ["frozen.weight"] and "requires_grad=False" in frozen["message"]
    assert {r["code"] for r in found} == {"unused_param", "detached_param", "frozen_outside_config"}
    assert {r["step"] for r in found} == {3}


def test_healthy_one_process_run_is_verified_and_silent(tmp_path_factory, shared_cache):
    _, run_dir = grad_run("ddp_stop", tmp_path_factory, shared_cache)  # its planted bug is grad_monitor's
    found = read_findings(run_dir, "freeze_verify")
    assert [r["code"] for r in found] == ["freeze_verified"], found


@pytest.mark.slow
def test_train_only_freezes_the_rest_under_zero3_two_processes(tmp_path_factory, shared_cache):
    proc, run_dir = grad_run("zero3_2proc", tmp_path_factory, shared_cache)
    assert_ok(proc)
    found = read_findings(run_dir, "freeze_verify")
    assert [r["code"] for r in found] == ["freeze_applied", "freeze_verified"], found
    assert "training 12/60 parameters" in found[0]["message"]
    # independent witness (gathered full parameters): step 0 changed exactly layer 0's parameters
    changed = changed_params(run_dir, 0)
    assert len(changed) == 12 and all(n.startswith("model.layers.0.") for n in changed), changed


def test_healthy_ddp_two_processes_verified(tmp_path_factory, shared_cache):
    run_dir, _ = healthy_run("ddp", tmp_path_factory, shared_cache)  # debug=full
    found = read_findings(run_dir, "freeze_verify")
    assert [r["code"] for r in found] == ["freeze_verified"] and "all 60 trainable" in found[0]["message"]


def test_pattern_matching_nothing_is_a_one_line_error(tmp_path, shared_cache):
    """Found when the model exists (setup, inside fit); the command line prints a ConfigError raised
    there as one line, exit 2 (tests/config/test_bad_input.py, data_preparation)."""
    from dsdebug.trainer.cli import find_config_error

    with pytest.raises(Exception) as raised:
        train_in_process(SMOKE + ["+callbacks=freeze_verify", "callbacks.freeze_verify.train_only=[model.layer.0.*]",
                                  "strategy=ddp", *SMALL_DEEPSEEK], tmp_path / "run", shared_cache)
    error = find_config_error(raised.value)
    assert error is not None, raised.value
    assert "callbacks.freeze_verify.train_only: pattern 'model.layer.0.*' matches no" in str(error)
