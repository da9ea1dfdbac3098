"""A check's arguments are refused from the config, before torch is imported, with the line its
``__init__`` would raise (config/callback_args.py reads the same ``check_args`` calls)."""

from __future__ import annotations

import inspect
import contextlib
from pathlib import Path

import hydra.utils
import pytest
from omegaconf import OmegaConf

import dsdebug.callbacks as callbacks
from dsdebug.config.callback_args import _init_spec, check_callback_args
from dsdebug.config.instantiate import instantiate_section
from dsdebug.errors import ConfigError
from dsdebug.trainer.cli import find_config_error
from tests.helpers.runs import CONF
from tests.config.test_validation_imports import heavy_after_prepare

CHECK_YAMLS = sorted(p for p in (CONF / "callbacks").glob("*.yaml")
                     if "dsdebug.callbacks." in p.read_text() and "_target_" in p.read_text())
BAD_VALUES = [-1, 0, 0.5, 1.5, 10**9, "nonsense", None, True, [], ["x"]]


def _section(path: Path) -> tuple[str, dict]:
    (key, conf), = OmegaConf.to_container(OmegaConf.load(path), resolve=False).items()
    return key, conf


def _runtime_error(conf: dict, key: str, tmp_path: Path) -> str | None:
    """What building the check raises (the error line), or None."""
    conf = {k: v for k, v in conf.items() if not (isinstance(v, str) and "${" in v)}  # the class default
    try:
        with contextlib.chdir(tmp_path):  # a check that defaults its folder to the cwd writes there, not in the repo
            obj = instantiate_section(OmegaConf.create(conf), f"callbacks.{key}")
    except Exception as e:  # noqa: BLE001 - Hydra wraps the check's ConfigError
        found = find_config_error(e)
        assert found is not None, repr(e)
        return str(found)
    teardown = getattr(obj, "_restore_env", None) or getattr(obj, "restore_env", None)
    if callable(teardown):
        teardown()
    return None


def _static_error(conf: dict, key: str, tmp_path: Path) -> str | None:
    conf = {k: v for k, v in conf.items() if not (isinstance(v, str) and "${" in v)}  # the class default
    try:
        check_callback_args(OmegaConf.create({"callbacks": {key: conf}}))
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("path", CHECK_YAMLS, ids=[p.stem for p in CHECK_YAMLS])
def test_every_value_refused_early_is_refused_the_same_way_by_init(path, tmp_path, monkeypatch):
    """For every argument the static reader checks and a spread of bad values: when it refuses a value,
    building the check refuses it with the very same line. (It may let pass what __init__ refuses
    in a branch; never the other way round.)"""
    monkeypatch.chdir(tmp_path)  # checks that write files (profiler, comm_debug) write here
    key, conf = _section(path)
    params, calls, _, _, _ = _init_spec(conf["_target_"])
    assert calls, f"{path.name}: no check_args call read from {conf['_target_']}.__init__"
    refused = 0
    for arg, _, _ in calls:
        if arg not in conf:
            continue  # a base-class argument (on_error) the YAML does not set: covered below
        for bad in BAD_VALUES:
            variant = {**conf, arg: bad}
            early = _static_error(variant, key, tmp_path)
            if early is not None:
                refused += 1
                assert _runtime_error(variant, key, tmp_path) == early, (arg, bad)
    assert refused, f"{path.name}: no bad value was refused early"


def test_every_check_reads_its_rules(tmp_path):
    """Each check's __init__ validates through check_args (so the early check sees its rules)."""
    for name, module in callbacks._MODULES.items():
        if name in ("DebugCallback",):
            continue
        spec = _init_spec(f"dsdebug.callbacks.{module}.{name}")
        assert spec is not None and spec[1], name


def test_the_default_config_passes():
    for path in CHECK_YAMLS:
        key, conf = _section(path)
        assert _static_error(conf, key, Path("/tmp")) is None, path.name


def test_unknown_key_is_the_same_line_as_at_build(tmp_path):
    conf = {**_section(CONF / "callbacks" / "grad_monitor.yaml")[1], "every_n_stepz": 3}
    early = _static_error(conf, "grad_monitor", tmp_path)
    assert early is not None and early.startswith("callbacks.grad_monitor.every_n_stepz is not an option of "
                                                  "dsdebug.callbacks.grad_monitor.GradMonitor; valid: every_n_steps")
    assert early == _runtime_error(conf, "grad_monitor", tmp_path)


def test_on_error_is_checked_for_every_check(tmp_path):
    conf = {**_section(CONF / "callbacks" / "loss_spike.yaml")[1], "on_error": "panic"}
    assert _static_error(conf, "loss_spike", tmp_path) == _runtime_error(conf, "loss_spike", tmp_path) is not None


def test_cli_refuses_a_bad_check_argument_before_importing_torch(tmp_path):
    result = heavy_after_prepare(["debug=light", "callbacks.grad_monitor.every_n_steps=-1"], tmp_path)
    assert result["loaded"] == [] and result["error"].startswith("callbacks.grad_monitor.every_n_steps=-1 is invalid")


def test_a_non_dsdebug_callback_is_left_to_its_class():
    """Lightning's own callbacks have no check_args: nothing is read, nothing refused early."""
    target = "lightning.pytorch.callbacks.LearningRateMonitor"
    assert inspect.isclass(hydra.utils.get_object(target))
    spec = _init_spec(target)
    assert spec is None or spec[1] == []
