"""Every conf/callbacks/*.yaml goes through a short fit: a new callback is covered the
moment its config exists. Runs in-process (1 rank) with a small plain net to stay cheap; the
seven debug checks on the real tiny DeepSeek are the shared debug=full runs
(tests/helpers/shared_runs.py, asserted silent in tests/callbacks/test_presets.py)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import CONF, SMOKE, TINY_NET, train_in_process

CALLBACKS = sorted(p.stem for p in (CONF / "callbacks").glob("*.yaml") if p.stem != "default")


@pytest.fixture(autouse=True)
def _restore_env():
    """Callbacks like comm_debug/reproducibility set process env vars; keep tests independent."""
    import os

    import torch

    saved, deterministic = dict(os.environ), torch.are_deterministic_algorithms_enabled()
    yield
    os.environ.clear()
    os.environ.update(saved)
    torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("name", CALLBACKS)
def test_callback_config_runs_a_short_fit(name, tmp_path, shared_cache):
    overrides = SMOKE + [
        f"+callbacks={name}", "trainer.max_steps=3", "strategy=zero2", "export.fp32=false", "export.hf=false",
        *TINY_NET]
    if name == "rich_progress_bar":  # experiment=smoke turns the bar off; +callbacks=rich_progress_bar comes after it
        overrides.append("trainer.enable_progress_bar=true")
    m = train_in_process(overrides, tmp_path / "run", shared_cache)
    assert m["global_step"] == 3 and m["status"] == "completed"
    findings = tmp_path / "run" / "findings.jsonl"
    if findings.exists():  # a healthy run: no check may warn or fail
        bad = [r for r in map(json.loads, findings.read_text().splitlines()) if r["severity"] != "info"]
        assert bad == [], bad
