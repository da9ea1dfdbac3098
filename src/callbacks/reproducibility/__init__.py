"""`Reproducibility` (``callbacks.reproducibility``), one check in a package:

- ``check``: the callback (seeds, deterministic flags, the record, the replayed step);
- ``replay``: RNG snapshot/restore/digest and module-output fingerprints, pure.

``from dsdebug.callbacks.reproducibility import Reproducibility`` and the config target
``dsdebug.callbacks.reproducibility.Reproducibility`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.reproducibility.check import Reproducibility

__all__ = ["Reproducibility"]
