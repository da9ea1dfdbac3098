"""`LogSync` (``callbacks.log_sync``), one check in a package:

- ``check``: the callback (every rank's metrics and log lines gathered to rank 0);
- ``timeline``: its files: the per-rank timeline.jsonl and the merged logs_merged.log.

``from dsdebug.callbacks.log_sync import LogSync`` and the config target
``dsdebug.callbacks.log_sync.LogSync`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.log_sync.check import LogSync

__all__ = ["LogSync"]
