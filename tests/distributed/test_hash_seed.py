"""The training command fixes PYTHONHASHSEED before Python's hash seed matters (src/distributed/hash_seed.py):
unset -> re-executed once with the run's hash_seed; a value the user exported is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from dsdebug.distributed import hash_seed
from tests.helpers.runs import CONF

_SCRIPT = ("import os, sys; from dsdebug.distributed.hash_seed import fix_hash_seed; "
           "print('start', flush=True); fix_hash_seed(sys.argv[1:]); "
           "print(os.environ['PYTHONHASHSEED'], hash('dsdebug'), os.getpid())")


def run(args: list[str], seed: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_unset_hash_seed_is_set_and_the_process_re_executed():
    first, second = run([], None), run([], None)
    assert first[0] == "start" and first[1] == "start"  # ran twice: before and after the exec
    assert first[2] == "0" and first[3] == second[3]  # the same str hash in two separate runs
    assert first[3] == run([], "0")[2]  # as if exported (no re-exec: start, 0, hash)


def test_the_runs_hash_seed_override_is_used_and_an_exported_value_kept():
    assert run(["callbacks.reproducibility.hash_seed=7"], None)[2] == "7"
    kept = run([], "random")
    assert kept[0] == "start" and kept[1] == "random"  # no re-exec: the user's choice


def test_default_equals_the_reproducibility_config():
    conf = yaml.safe_load((CONF / "callbacks" / "reproducibility.yaml").read_text())
    assert str(conf["reproducibility"]["hash_seed"]) == hash_seed.DEFAULT


# as train.py: the command line's seed first, then Hydra's on_run_start with the composed config (HashSeedCheck,
# conf/hydra/default.yaml), before the run dir is made
_COMPOSED = ("import os, sys; from omegaconf import OmegaConf; "
             "from dsdebug.distributed.hash_seed import fix_hash_seed; "
             "from dsdebug.distributed.hash_seed_check import HashSeedCheck; "
             "print('start', flush=True); fix_hash_seed(sys.argv[1:]); "
             "HashSeedCheck().on_run_start(config=OmegaConf.create({'callbacks': {'reproducibility': {'hash_seed': 7}}})); "
             "print(os.environ['PYTHONHASHSEED'], flush=True)")


def test_a_hash_seed_set_in_a_yaml_reaches_this_process_too():
    """The entry reads the command line only; once composed, a YAML's hash_seed (7 here) re-executes the
    process with it, so rank 0 and the ranks it starts hash alike. An exported value stays the user's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", hash_seed.MARK)}
    out = subprocess.run([sys.executable, "-c", _COMPOSED], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["start", "start", "start", "7"]  # 0 from the command line, then 7 from the config
    kept = subprocess.run([sys.executable, "-c", _COMPOSED], env={**env, "PYTHONHASHSEED": "3"}, capture_output=True,
                          text=True, timeout=60)
    assert kept.stdout.split() == ["start", "3"]
