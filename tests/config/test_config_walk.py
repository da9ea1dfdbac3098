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
