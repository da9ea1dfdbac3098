"""`LossSpike` (``callbacks.loss_spike``), one check in a package:

- ``check``: the callback (detect before the update; warn | skip | rollback);
- ``window``: the detector, pure math: rolling median/MAD window and the robust z-score verdict.

``from dsdebug.callbacks.loss_spike import LossSpike`` and the config target
``dsdebug.callbacks.loss_spike.LossSpike`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.loss_spike.check import LossSpike

__all__ = ["LossSpike"]
