"""`LayerHealth` (``callbacks.layer_health``), one check in a package:

- ``check``: the callback (per-layer gradients and updates, measured on the device, read every N steps);
- ``expected``: what the optimizer should move each layer by in one step, and why a layer moved far less.

``from dsdebug.callbacks.layer_health import LayerHealth`` and the config target
``dsdebug.callbacks.layer_health.LayerHealth`` name the class exported here."""

from __future__ import annotations

from dsdebug.callbacks.layer_health.check import LayerHealth

__all__ = ["LayerHealth"]
