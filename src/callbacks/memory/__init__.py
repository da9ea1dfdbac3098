"""`MemoryMonitor` (``callbacks.memory``), one check in a package:

- ``check``: the callback (per-rank peaks, leaks, OOM findings);
- ``footprint``: RSS, growth rate, the model states ZeRO should hold per rank, OOM advice ranked for the run.

``from dsdebug.callbacks.memory import MemoryMonitor`` and the config target
``dsdebug.callbacks.memory.MemoryMonitor`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.memory.check import MemoryMonitor

__all__ = ["MemoryMonitor"]
