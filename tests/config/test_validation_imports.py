"""Bad input fails in about a second: the whole validation path (compose -> prepare) imports none of
torch, Lightning, DeepSpeed or transformers.

Each case runs in a fresh interpreter (this one has long imported them all): compose the config,
``prepare`` it (validation and every derivation), then list which heavy modules are loaded. A planted
``import torch`` in a copy of the package shows the check catches one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import CONF, REPO

HEAVY = ("torch", "lightning", "pytorch_lightning", "deepspeed", "transformers")

_SCRIPT = r"""
import json, os, sys
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from dsdebug.config.prepare import prepare
from dsdebug.errors import ConfigError

conf, overrides, heavy = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
with initialize_config_dir(conf, version_base="1.3"):
    cfg = compose("train", overrides=overrides)
error = None
try:
    prepare(cfg)
except ConfigError as e:
    error = str(e)
import dsdebug
print(json.dumps({"loaded": sorted(m for m in heavy if m in sys.modules), "error": error,
                  "package": dsdebug.__file__}))
"""


def heavy_after_prepare(overrides: list[str], tmp_path: Path, package_root: Path | None = None) -> dict:
    """{"loaded": heavy modules in sys.modules after prepare, "error": its ConfigError or None,
    "package": where dsdebug was imported from}; ``package_root`` holds a ``dsdebug`` copy to use."""
    env = {"PROJECT_ROOT": str(tmp_path), "DSDEBUG_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    if package_root is not None:
        env["PYTHONPATH"] = str(package_root)  # found before the editable install's finder
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(CONF), json.dumps(overrides), json.dumps(HEAVY)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = {
    "default": [],
    "bad lr": ["optim.lr=-1"],
    "ddp 2 ranks": ["strategy=ddp", "trainer=ddp_sim"],
    "zero3 offload bf16": ["strategy=zero3_offload", "trainer=ddp_sim", "trainer.precision=bf16-mixed"],
    "ddp powersgd": ["strategy=ddp_powersgd", "trainer=ddp_sim"],
    "zero1 global batch": ["strategy=zero1", "data.global_batch_size=16", "optim.scale_lr_base_batch_size=8"],
    "v2 text files": ["model=deepseek_v2_tiny", "data=text_files", f"data.source.paths={REPO}/README.md"],
    "debug full": ["debug=full"],
    "bad callback key": ["callbacks.grad_monitor.every_n_steps=0", "debug=light"],
    "unknown target": ["model.net._target_=dsdebug.models.deepseek.build_deepseek_v9"],
}


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_validation_imports_no_heavy_module(overrides, tmp_path):
    result = heavy_after_prepare(overrides, tmp_path)
    assert result["loaded"] == [], f"validation imported {result['loaded']} (error: {result['error']})"
    assert result["package"].startswith(str(REPO / "src")), result["package"]


def test_the_bad_lr_is_refused_by_that_path(tmp_path):
    assert "optim.lr must be a positive number" in heavy_after_prepare(["optim.lr=-1"], tmp_path)["error"]


def test_a_planted_torch_import_in_the_validation_path_is_caught(tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(REPO / "src", root / "dsdebug", ignore=shutil.ignore_patterns("__pycache__"))
    global_batch = root / "dsdebug" / "config" / "global_batch.py"
    global_batch.write_text(global_batch.read_text() + "\nimport torch  # planted\n")
    result = heavy_after_prepare([], tmp_path, package_root=root)
    assert result["package"].startswith(str(root)), result["package"]
    assert "torch" in result["loaded"]


def test_the_cli_refuses_a_bad_value_before_importing_torch(tmp_path):
    """`python train.py optim.lr=-1` as a user types it: exit 2, one line, and Python's import log
    (-X importtime) shows no heavy module was imported on the way."""
    env = {"PROJECT_ROOT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "train.py"), "optim.lr=-1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: optim.lr must be a positive number, got -1"], errors
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert "dsdebug.config.prepare" in imported  # the log is the one of the validation path


def test_a_misspelt_key_gets_the_closest_valid_key_before_importing_torch(tmp_path):
    """`python train.py trainer.max_step=5`: the composition precheck names the closest valid key
    (composing the config again without the bad override) and still imports no heavy module."""
    env = {"PROJECT_ROOT": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "train.py"), "trainer.max_step=5"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith("; did you mean trainer.max_steps?"), errors
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
