"""The config's path from the task function to fit (tests/helpers/config_walk.py): no package is entered again
more than once, and docs/architecture.md lists the path the code takes."""

from __future__ import annotations

import re

from tests.helpers.config_walk import packages, reentries, walk
from tests.helpers.runs import REPO, SMOKE, TINY_NET

DOC = REPO / "docs" / "architecture.md"


def test_the_config_path_to_fit_reenters_no_package_twice_and_is_the_documented_one(tmp_path, shared_cache):
    stops = walk([*SMOKE, *TINY_NET, "debug=full"], tmp_path / "run", shared_cache)
    assert stops[0] == "dsdebug.train.run" and stops[-1].endswith(".bind_config"), stops
    path = packages(stops)
    assert all(n <= 1 for n in reentries(path).values()), f"re-entered more than once: {reentries(path)} ({path})"
    documented = re.search(r"path, by package: ``([a-z >-]+)``", DOC.read_text())
    assert documented is not None, "docs/architecture.md lost the config's path"
    assert documented.group(1).split(" -> ") == path, (documented.group(1), path)
    files = {stop.rsplit(".", 1)[0] for stop in stops}
    assert all(name in DOC.read_text() for name in ("launcher_world", "prepare_loggers", "bind_config")), files


def test_the_walk_sees_a_stop_that_takes_the_config():
    """The recorder itself: a function of this package handed a node of the config is a stop; one handed a copy
    is not (so the test above cannot pass by recording nothing)."""
    import sys

    from omegaconf import OmegaConf

    from tests.helpers import config_walk

    cfg = OmegaConf.create({"a": {"b": 1}})
    ids = config_walk._nodes(cfg)
    assert id(cfg.a) in ids and id(OmegaConf.create({"a": {"b": 1}}).a) not in ids
    assert packages(["dsdebug.config.x.f", "dsdebug.config.y.g", "dsdebug.trainer.e.h", "dsdebug.config.z.k"]) == \
        ["config", "trainer", "config"]
    assert reentries(["config", "trainer", "config", "trainer", "config"]) == {"config": 2, "trainer": 1}
    assert sys.getprofile() is None


_COUNT_COMPOSES = r"""
import atexit, sys, traceback
from hydra._internal.config_loader_impl import ConfigLoaderImpl
calls = []
original = ConfigLoaderImpl.load_configuration
def counted(self, *args, **kwargs):
    # Hydra 1.3's main composes once more to read the mode (run or multirun) before it composes the run's
    # config: its own, not counted
    if not any(frame.name == "get_mode" for frame in traceback.extract_stack()):
        calls.append(1)
    return original(self, *args, **kwargs)
ConfigLoaderImpl.load_configuration = counted
atexit.register(lambda: print("composed", len(calls), flush=True))
sys.argv = ["train.py", *sys.argv[1:]]
from dsdebug.train import main
main()
"""


def test_a_single_run_composes_its_config_once_and_a_bad_key_is_still_one_line(tmp_path):
    """The command line composes a single run's config once (@hydra.main; Hydra's own look at the mode aside); a
    misspelt key is the precheck's line,
    with its did-you-mean (composed again only then, to find the closest key). A sweep still composes every
    job first (precheck_overrides), before any runs."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONHASHSEED": "0", "PROJECT_ROOT": str(tmp_path)}
    env.pop("DSDEBUG_HASH_SEED_FROM", None)
    env.pop("HYDRA_FULL_ERROR", None)

    def cli(*args):
        return subprocess.run([sys.executable, "-c", _COUNT_COMPOSES, *args, f"paths.log_dir={tmp_path}/logs"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    bad_value = cli("optim.lr=-1")  # composes, fails in prepare
    assert bad_value.returncode == 2, bad_value.stderr[-2000:]
    assert bad_value.stdout.split()[-2:] == ["composed", "1"], bad_value.stdout
    assert bad_value.stderr.strip().splitlines()[-1] == "error: optim.lr must be a positive number, got -1"
    misspelt = cli("trainer.max_stepz=3")
    assert misspelt.returncode == 2 and "Traceback" not in misspelt.stderr, misspelt.stderr[-2000:]
    assert misspelt.stderr.strip().splitlines()[-1].endswith("; did you mean trainer.max_steps?"), misspelt.stderr
