"""Fixtures only (helpers: tests/helpers/, planted bugs: tests/planted/; tiers: docs/testing.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The suite runs the checks strict: a check that raises fails its test instead of being isolated as a
# user's run isolates it (src/callbacks/isolation.py). Every `python train.py` a test starts inherits it;
# the isolation tests set DSDEBUG_STRICT=0 for the runs that show a user's behaviour.
os.environ.setdefault("DSDEBUG_STRICT", "1")


@pytest.fixture(autouse=True)
def _restore_process_env():
    """Every test starts from the session's environment and torch thread count. An in-process fit
    changes both for the rest of the process (Lightning's CPU DDP sets OMP_NUM_THREADS=<cores per
    process>, seed_everything sets PL_GLOBAL_SEED, ...), and every later `python train.py` this
    process starts would inherit them: a 2-process run then used 2 threads per rank instead of
    Lightning's 1, and two runs of the same config differed in the last bit of one logged loss."""
    import torch

    saved, threads = dict(os.environ), torch.get_num_threads()
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session (trained once, ~2 s)."""
    return tmp_path_factory.mktemp("cache")


# ---- which tier runs: make test (-m "not slow") says how many of all the tests it picked --------------
_collected: dict[str, int] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Before -m deselects: counts every test, and marks ``extended`` each ``slow`` test CI does not run
    (tests/tiers.py)."""
    from tests.tiers import TEST_ALL_SLOW, in_test_all, unmatched

    _collected["all"] = len(items)
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("extended") and not in_test_all(item.nodeid):
            item.add_marker(pytest.mark.extended)
    stale = unmatched([item.nodeid for item in items if item.get_closest_marker("slow")])
    if len(items) > 1000 and stale:  # the whole suite was collected: a pattern that names no slow test is stale
        raise pytest.UsageError(f"tests/tiers.py: TEST_ALL_SLOW patterns that match no slow test: {stale} "
                                f"(of {len(TEST_ALL_SLOW)}); a renamed test would silently leave CI")


def pytest_report_collectionfinish(config, items):
    expr = config.getoption("markexpr")
    if expr and "all" in _collected:
        return (f"tier -m {expr!r}: {len(items)} of {_collected['all']} tests (make test-all: all but extended; "
                "make test-extended: the rest)")
    return None
