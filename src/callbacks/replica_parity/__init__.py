"""`ReplicaParity` (``callbacks.replica_parity``), one check in a package:

- ``check``: the callback (gathers and compares per-rank checksums);
- ``checksums``: bit-exact position-weighted checksums and the majority comparison, pure.

``from dsdebug.callbacks.replica_parity import ReplicaParity`` and the config target
``dsdebug.callbacks.replica_parity.ReplicaParity`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.replica_parity.check import ReplicaParity

__all__ = ["ReplicaParity"]
