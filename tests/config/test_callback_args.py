"""A check's arguments are refused from the config, before torch is imported, with the line its
``__init__`` would raise (config/callback_args.py reads the declared rules from config/check_args.json,
which must agree with the classes)."""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path

import hydra.utils
import pytest
from omegaconf import OmegaConf

import dsdebug.callbacks as callbacks
from dsdebug.callbacks.arg_table import build_table, render
from dsdebug.config.args import integer
from dsdebug.config.callback_args import TABLE_FILE, check_callback_args, declared
from dsdebug.trainer.instantiate import instantiate_section
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
    """For every declared argument (those the YAML leaves to the class default too) and a spread of bad values:
    when the table refuses a value, building the check refuses it with the very same line -- so every declared
    rule is applied by __init__. (__init__ may refuse more, by a rule that depends on another argument; never
    the other way round.)"""
    monkeypatch.chdir(tmp_path)  # checks that write files (profiler, comm_debug) write here
    key, conf = _section(path)
    _, _, rules = declared(conf["_target_"])
    assert rules, f"{path.name}: no declared rule for {conf['_target_']}"
    refused = 0
    for arg in rules:
        for bad in BAD_VALUES:
            variant = {**conf, arg: bad}
            early = _static_error(variant, key, tmp_path)
            if early is not None:
                refused += 1
                assert _runtime_error(variant, key, tmp_path) == early, (arg, bad)
    assert refused, f"{path.name}: no bad value was refused early"


def test_the_table_the_config_layer_reads_is_the_classes_declarations(monkeypatch):
    """config/check_args.json == what the check classes declare (python -m dsdebug.callbacks.arg_table rewrites
    it); a rule changed on a class without rewriting the table is caught, and so is a new argument."""
    table = json.loads(TABLE_FILE.read_text())
    assert table == build_table(), "config/check_args.json is stale: run python -m dsdebug.callbacks.arg_table"
    assert TABLE_FILE.read_text() == render(build_table())
    checks = [n for n in callbacks._MODULES if n != "DebugCallback"]
    assert set(table) == set(checks), set(checks) ^ set(table)
    assert all(entry["rules"] for entry in table.values() if entry["params"] != [])  # every check with arguments
    grad_monitor = callbacks.GradMonitor
    monkeypatch.setattr(grad_monitor, "arg_rules", {**grad_monitor.arg_rules, "every_n_steps": integer(5)})
    assert build_table() != table  # a drifted rule
    monkeypatch.undo()
    original = grad_monitor.__init__
    monkeypatch.setattr(grad_monitor, "__init__", lambda self, new_knob=1, **kw: original(self, **kw))
    assert build_table() != table  # a drifted signature


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
    """Lightning's own callbacks declare nothing: nothing is looked up, nothing refused early."""
    target = "lightning.pytorch.callbacks.LearningRateMonitor"
    assert inspect.isclass(hydra.utils.get_object(target))
    assert declared(target) is None
    assert declared("mypackage.callbacks.GradMonitor") is None  # a class of the same name elsewhere
    assert declared("dsdebug.callbacks.GradMonitor")[0] == declared("dsdebug.callbacks.grad_monitor.GradMonitor")[0]
    assert declared("dsdebug.callbacks.layer_health.LayerHealth") is not None  # a check's package


def test_the_config_layer_reads_no_check_source(monkeypatch):
    """The declared table is data: checking arguments neither imports a check nor opens a .py file."""
    import builtins
    import sys

    opened = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (opened.append(str(self)), real_open(self).read())[1])
    before = set(sys.modules)
    check_callback_args(OmegaConf.create({"callbacks": {
        "grad_monitor": {"_target_": "dsdebug.callbacks.grad_monitor.GradMonitor", "every_n_steps": 2}}}))
    assert not [f for f in opened if f.endswith(".py")], opened
    assert not [m for m in set(sys.modules) - before if m.startswith("dsdebug.callbacks")]


def test_every_declared_rule_is_data_that_reads_back_as_the_same_rule():
    from dsdebug.config.args import Rule

    for class_name in build_table():
        for arg, rule in getattr(callbacks, class_name).declared_rules().items():
            again = Rule.from_data(json.loads(json.dumps(rule.to_data())))
            assert again == rule and again.valid == rule.valid, (class_name, arg)
    with pytest.raises(ValueError, match="unknown argument rule 'regex'"):
        Rule.from_data({"rule": "regex", "args": [".*"]})
