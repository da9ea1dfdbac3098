"""The throttled progress bar: Lightning's bar, updated at most once per interval (and on the last batch)."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import RichProgressBar

from dsdebug.errors import ConfigError
from dsdebug.trainer import progress
from dsdebug.trainer.progress import ThrottledRichProgressBar


def test_updates_at_most_once_per_interval_and_on_the_last_batch(monkeypatch):
    calls = []
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda self, *a: calls.append(a[-1]))
    monkeypatch.setattr(ThrottledRichProgressBar, "total_train_batches", property(lambda self: 100))
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: True, raising=False)
    bar = ThrottledRichProgressBar(min_interval_s=1.0)
    for batch_idx in range(100):  # 0.3 s per batch
        bar.on_train_batch_end(None, None, None, None, batch_idx)
        clock[0] += 0.3
    assert calls[0] == 0 and calls[-1] == 99              # first and last batch always shown
    gaps = [b - a for a, b in zip(calls, calls[1:-1])]
    assert set(gaps) == {4}                                 # 4 x 0.3 s: the first batch >= 1 s later
    every = ThrottledRichProgressBar(min_interval_s=0)
    calls.clear()
    for batch_idx in range(5):
        every.on_train_batch_end(None, None, None, None, batch_idx)
    assert calls == [0, 1, 2, 3, 4]


def test_redirected_stdout_uses_the_longer_interval(monkeypatch):
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: False, raising=False)
    assert ThrottledRichProgressBar(min_interval_s=1.0, non_tty_interval_s=30.0).min_interval_s == 30.0
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: True, raising=False)
    assert ThrottledRichProgressBar(min_interval_s=1.0, non_tty_interval_s=30.0).min_interval_s == 1.0


def test_bad_interval_is_a_config_error():
    with pytest.raises(ConfigError, match="min_interval_s=-1 is invalid"):
        ThrottledRichProgressBar(min_interval_s=-1)
