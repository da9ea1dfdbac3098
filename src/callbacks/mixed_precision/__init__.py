"""`MixedPrecisionCheck` (``callbacks.mixed_precision``), one check in a package:

- ``check``: the callback (loss-scale trajectory, skipped steps, overflow streaks, bf16 underflow);
- ``underflow``: the share of subnormal fp16 gradient elements.

The loss scale itself (DeepSpeed's loss scaler, torch's GradScaler) is read through the shared
``dsdebug.callbacks.loss_scale``, as the gradient checks read it.

``from dsdebug.callbacks.mixed_precision import MixedPrecisionCheck`` and the config target
``dsdebug.callbacks.mixed_precision.MixedPrecisionCheck`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.mixed_precision.check import MixedPrecisionCheck

__all__ = ["MixedPrecisionCheck"]
