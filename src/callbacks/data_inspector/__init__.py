"""`DataInspector` (``callbacks.data_inspector``), one check in a package:

- ``check``: the callback (batch-level checks: first batch, ranks, labels);
- ``dataset_checks``: the dataset-level checks it mixes in (worker seeding, train/val overlap, data-order record);
- ``fingerprint``: batch and dataset fingerprints (any dtype, no host sync), n-gram overlap.

``from dsdebug.callbacks.data_inspector import DataInspector`` and the config target
``dsdebug.callbacks.data_inspector.DataInspector`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.data_inspector.check import DataInspector

__all__ = ["DataInspector"]
