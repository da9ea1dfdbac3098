"""`MixedPrecisionCheck` (``callbacks.mixed_precision``), one check in a package:

- ``check``: the callback (loss-scale trajectory, skipped steps, overflow streaks, bf16 underflow);
- ``loss_scale``: where the fp16 loss scale lives (DeepSpeed's DynamicLossScaler, torch's GradScaler).

``from dsdebug.callbacks.mixed_precision import MixedPrecisionCheck`` and the config target
``dsdebug.callbacks.mixed_precision.MixedPrecisionCheck`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.mixed_precision.check import MixedPrecisionCheck

__all__ = ["MixedPrecisionCheck"]
