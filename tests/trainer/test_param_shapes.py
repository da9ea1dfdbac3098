"""Parameter shapes and dtypes users write, under every strategy (src/trainer/param_layout.py).

What trains is held to DDP: the same planted net (tests/planted/shapes.py OddShapesLM: 0-dim gates at the
top and in blocks, a non-contiguous parameter, a weight registered in two modules, int64/bool buffers)
trained 2 steps under ZeRO-1/2/3 must end with DDP's weights, with the user's shapes in the exported fp32
weights and in DeepSpeed's checkpoint, and resume from that checkpoint. What cannot train is refused
before the engine starts with one line (rows in docs/bad_inputs.md; the cases live in
tests/config/test_bad_input.py). One process each; the 2-process runs are in the slow tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsdebug.trainer.cli import find_config_error
from tests.helpers.runs import SMOKE, assert_ok, metrics, only_run_dir, run_train, train_in_process

NET = "tests.planted.shapes.OddShapesLM"
FAST = [*SMOKE, "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0", "export.hf=false", "~callbacks.model_checkpoint"]
SCALARS = ("net.gate", "net.blocks.0.alpha", "net.blocks.1.alpha")
ATOL = 5e-5  # ZeRO-3 differs from DDP by ~5e-6 on these nets after 2-3 AdamW steps (reduction order); a gate
#              left untrained or trained twice is off by ~lr = 3e-3


def _train(strategy: str, run_dir: Path, cache: Path, *extra: str) -> tuple[Path, dict]:
    m = train_in_process([*FAST, f"model.net._target_={NET}", f"strategy={strategy}", *extra], run_dir, cache)
    return run_dir, m


def _fp32(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "export" / "model_fp32.pt", map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, shared_cache):
    return _train("ddp", tmp_path_factory.mktemp("ddp"), shared_cache)


@pytest.fixture(scope="module", params=["zero1", "zero2", "zero3", "zero3_partitioned"])
def zero_run(request, tmp_path_factory, shared_cache):
    run_dir = tmp_path_factory.mktemp(request.param)
    if request.param == "zero3_partitioned":
        strategy, config = _zero3_partitioned(run_dir.parent)
        return request.param, *_train(strategy.split("=")[1], run_dir, shared_cache, config)
    return request.param, *_train(request.param, run_dir, shared_cache)


def test_odd_shapes_train_under_zero_as_under_ddp(ddp_run, zero_run):
    stage, run_dir, m = zero_run
    assert m["status"] == "completed" and m["global_step"] == 2
    want, got = _fp32(ddp_run[0]), _fp32(run_dir)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert (tuple(g.shape), g.dtype) == (tuple(w.shape), w.dtype), (stage, name)
        assert torch.allclose(g, w, rtol=0, atol=ATOL), (stage, name, (g - w).abs().max().item())
    for name in SCALARS:
        assert want[name].shape == () and abs(want[name].item() - (0.5 if name == "net.gate" else 0.25)) > 1e-3, name
    assert torch.equal(got["net.up.weight"], got["net.down.weight"])  # still one tensor, not two copies
    log = (run_dir / "train.log").read_text()
    assert "param layout: 3 0-dim parameter(s) (net.gate, net.blocks.0.alpha, net.blocks.1.alpha) held as shape [1]" in log
    assert "1 non-contiguous parameter(s) (net.proj) made contiguous" in log
    assert "param layout" not in (ddp_run[0] / "train.log").read_text()


def test_deepspeed_checkpoint_records_the_users_shapes(zero_run):
    """DeepSpeed's own checkpoint (what zero_to_fp32 and a resume read) names the 0-dim shapes."""
    stage, run_dir, _ = zero_run
    [states] = (run_dir / "checkpoints").glob("*.ckpt/checkpoint/*model_states.pt")
    saved = torch.load(states, map_location="cpu", weights_only=False)
    shapes = {name: tuple(shape) for group in saved["param_shapes"] for name, shape in group.items()}
    assert all(shapes[name] == () for name in SCALARS), (stage, {n: shapes[n] for n in SCALARS})
    if not stage.startswith("zero3"):  # ZeRO-3's module state holds partition placeholders; ZeRO-1/2's the weights
        assert all(saved["module"][name].shape == () for name in SCALARS)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])  # the two ways the shapes are given back (param_layout)
def test_resume_from_a_checkpoint_with_0_dim_parameters(stage, tmp_path, shared_cache):
    first, _ = _train(stage, tmp_path / "first", shared_cache, "export.fp32=false")
    [ckpt] = (first / "checkpoints").glob("*.ckpt")
    run_dir, m = _train(stage, tmp_path / "resumed", shared_cache, f"ckpt_path={ckpt}", "trainer.max_steps=3")
    assert m["global_step"] == 3 and m["resumed_from"] == str(ckpt)
    assert all(_fp32(run_dir)[name].shape == () for name in SCALARS)


def test_odd_shapes_with_the_light_checks_under_zero3(tmp_path, shared_cache):
    """debug=light's checks read gradients and parameters under ZeRO-3 (safe_get_full_grad, the 0-dim
    ones included): the run completes and no check fails on them."""
    run_dir, m = _train("zero3", tmp_path, shared_cache, "debug=light", "export.fp32=false")
    assert m["status"] == "completed"
    findings = (run_dir / "findings.jsonl").read_text() if (run_dir / "findings.jsonl").exists() else ""
    assert "check_failed" not in findings


def test_unused_parameter_under_ddp_is_one_line_naming_it(tmp_path, shared_cache):
    """A parameter forward never uses stops DDP (find_unused_parameters=false) at the second step; the
    error names it (torch gives indices, Lightning a generic hint) and is bad input (exit 2)."""
    with pytest.raises(RuntimeError) as caught:
        train_in_process([*FAST, "model.net._target_=tests.planted.shapes.UnusedParamLM", "strategy=ddp",
                          "export.fp32=false"], tmp_path, shared_cache)
    error = find_config_error(caught.value)
    assert error is not None, caught.value
    assert "net.unused.weight, net.unused.bias" in str(error) and "strategy.find_unused_parameters=true" in str(error)


def test_unused_parameter_trains_with_find_unused_parameters(tmp_path, shared_cache):
    _, m = _train("ddp", tmp_path, shared_cache, "strategy.find_unused_parameters=true", "export.fp32=false")
    assert m["status"] == "completed"


def _zero3_partitioned(run_dir: Path) -> list[str]:
    """ZeRO-3 that partitions every parameter (stage3_param_persistence_threshold 0; zero3 keeps small ones,
    the gates among them, whole on every rank): a gate is then gathered into its ds_shape at each use."""
    config = run_dir / "zero3_partitioned.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    return ["strategy=deepspeed_json", f"strategy.config={config}"]


def _two_ranks(strategy: str, tmp: Path, cache: Path) -> Path:
    chosen = _zero3_partitioned(tmp) if strategy == "zero3_partitioned" else [f"strategy={strategy}"]
    proc = run_train([*FAST, f"model.net._target_={NET}", "trainer=ddp_sim", *chosen], tmp / "logs", cache)
    assert_ok(proc)
    run_dir = only_run_dir(tmp / "logs")
    assert metrics(run_dir)["global_step"] == 2 and metrics(run_dir)["world_size"] == 2
    return run_dir


@pytest.fixture(scope="module")
def ddp_two_ranks(tmp_path_factory, shared_cache):
    return _two_ranks("ddp", tmp_path_factory.mktemp("ddp2"), shared_cache)


@pytest.mark.slow  # 2 processes (~40 s each); the 1-process runs above hold every property but the cross-rank one
@pytest.mark.parametrize("strategy", ["zero2", "zero3_partitioned"])
def test_odd_shapes_on_two_ranks(strategy, ddp_two_ranks, tmp_path, shared_cache):
    """Rank 1 starts from rank 0's weights through the engine's start-up broadcast (where a 0-dim or
    non-contiguous parameter used to stop DeepSpeed), ZeRO-2 splits the flat buffer and ZeRO-3 the
    1-element gates over 2 ranks: the weights end as DDP's on 2 ranks, with the user's shapes."""
    want, got = _fp32(ddp_two_ranks), _fp32(_two_ranks(strategy, tmp_path, shared_cache))
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].shape == w.shape and torch.allclose(got[name], w, rtol=0, atol=ATOL), name
    assert all(got[name].shape == () for name in SCALARS)
    assert torch.equal(got["net.up.weight"], got["net.down.weight"])


@pytest.mark.parametrize("trainer_clip, refused", [(1.0, True), (None, False), (0.0, False)])
def test_hf_auto_gradient_clipping_takes_the_trainers_value(trainer_clip, refused):
    """An HF-style ds_config.json says "gradient_clipping": "auto" (tests/data/ds_configs/hf_zero2.json):
    the trainer's value decides whether stage 0's fp32 clipping meets the 0-dim gate (it crashed with
    'could not convert string to float: auto' before)."""
    from dsdebug.errors import ConfigError
    from dsdebug.trainer.param_layout import refuse_unheld

    net = torch.nn.Module()
    net.gate = torch.nn.Parameter(torch.ones(()))
    config = {"zero_optimization": {"stage": 0}, "gradient_clipping": "auto"}
    if refused:
        with pytest.raises(ConfigError, match=r"parameter gate .*is 0-dim"):
            refuse_unheld(net, config, "32-true", trainer_clip)
    else:
        refuse_unheld(net, config, "32-true", trainer_clip)


def test_a_parameter_registered_after_zero3_built_the_engine_is_one_line(tmp_path, shared_cache):
    """A parameter registered on the first forward (tests/planted/degenerate.LateRegisteredParameter) was never
    partitioned by ZeRO-3: DeepSpeed fails on its missing ``ds_status``. The run ends with one line that says what
    happened and what to do (exit 1, crash.json keeps the traceback), not DeepSpeed's traceback."""
    proc = run_train([*FAST, "model.net._target_=tests.planted.data.HealthyTinyLM", "strategy=zero3",
                      "+callbacks.plant._target_=tests.planted.degenerate.LateRegisteredParameter",
                      "export.fp32=false"], tmp_path, shared_cache)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "never partitioned (no 'ds_status')" in errors[0], proc.stderr[-3000:]
    assert "build every layer and parameter in __init__" in errors[0] and "Traceback" not in proc.stderr
    crash = json.loads((only_run_dir(tmp_path) / "crash.json").read_text())
    assert crash["exception"] == "AttributeError" and "ds_status" in crash["traceback_tail"]


def test_only_a_missing_deepspeed_attribute_is_read_as_a_late_parameter():
    from dsdebug.trainer.cli import _zero3_late_parameter

    assert _zero3_late_parameter(AttributeError("'Parameter' object has no attribute 'ds_id'")) is not None
    assert _zero3_late_parameter(AttributeError("'Net' object has no attribute 'dropout'")) is None
    assert _zero3_late_parameter(KeyError("ds_status")) is None


def test_a_users_own_ds_attribute_is_not_read_as_a_late_parameter():
    from dsdebug.trainer.cli import _zero3_late_parameter

    assert _zero3_late_parameter(AttributeError("'Net' object has no attribute 'ds_conv'")) is None
    assert _zero3_late_parameter(AttributeError("'Parameter' object has no attribute 'ds_conv'")) is None
    assert _zero3_late_parameter(AttributeError("'Tensor' object has no attribute 'ds_tensor'")) is not None
