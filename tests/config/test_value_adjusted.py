"""A value the user set is never changed without a word (issue 34): a clamp is a warning naming the key the
user set, its value and the value used; the run's plan names that key too, not one the user did not set."""

from __future__ import annotations

import json

import pytest

from dsdebug.models.optim import warmup_clamped, warmup_length
from tests.helpers.runs import SMOKE, TINY_NET, train_in_process


@pytest.mark.parametrize("total, asked, used", [(40, 2000, 39), (6, 6, 5), (2, 100, 1)])
def test_a_clamped_warmup_is_one_line_naming_the_key_the_value_and_what_is_used(total, asked, used):
    text = warmup_clamped(total, asked)
    assert warmup_length(total, 0.0, asked) == used
    assert f"optim.scheduler.warmup_steps={asked} is used as {used}" in text and f"{total} optimizer steps" in text


@pytest.mark.parametrize("total, asked", [(40, None), (40, 39), (40, 0), (1, 0)])
def test_a_warmup_used_as_given_says_nothing(total, asked):
    assert warmup_clamped(total, asked) is None


def _findings(run_dir):
    return [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines() if line.strip()]


def test_a_run_whose_warmup_steps_exceed_it_warns_with_the_key_it_set(tmp_path, shared_cache):
    """``+optim.scheduler.warmup_steps=100`` on a 6-step run: trained with a 5-step warmup (the LR peaks at the last
    step), one warning finding on the key and both values, and the preflight plan names warmup_steps, not the
    warmup_ratio the default config carries."""
    run_dir = tmp_path / "run"
    out = train_in_process([*SMOKE, *TINY_NET, "debug=light", "trainer.max_steps=6",
                            "+optim.scheduler.warmup_steps=100"], run_dir,
                           shared_cache)
    assert out["status"] == "completed"
    records = _findings(run_dir)
    adjusted = [r for r in records if (r["check"], r["code"]) == ("config", "value_adjusted")]
    assert len(adjusted) == 1, records
    assert adjusted[0]["severity"] == "warning"
    assert adjusted[0]["details"] == {"key": "optim.scheduler.warmup_steps", "asked": 100, "used": 5}
    plan = [r for r in records if r["check"] == "preflight" and "LR peaks" in r["message"]]
    assert plan and "optim.scheduler.warmup_steps" in plan[0]["advice"], records
    assert not any("warmup_ratio" in (r.get("advice") or "") + r["message"] for r in records if r is not adjusted[0])


def test_a_warmup_that_fits_says_nothing(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    out = train_in_process([*SMOKE, *TINY_NET, "debug=light", "trainer.max_steps=6",
                            "+optim.scheduler.warmup_steps=1"], run_dir,
                           shared_cache)
    assert out["status"] == "completed"
    assert not [r for r in _findings(run_dir) if r["check"] == "config" or "LR peaks" in r["message"]
                or "warmup_steps" in r["message"]]
