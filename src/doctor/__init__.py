"""The preflight doctor: probes of the properties every correct training step has, run on the
run's real model, data and strategy before it trains (``python train.py <overrides> doctor=true``).

One probe per module; each works on a plain ``nn.Module`` + batch (or a ``TorchStepper``) without
Hydra or Lightning, and ``DoctorCallback`` runs them all inside a Lightning fit. The probes that need
only a net and a batch live in ``dsdebug.probes`` (a layer below the checks, which run the cheap
ones at the start of ``debug=light``); the ones that step through the strategy live here:

| probe | module | function |
|---|---|---|
| loss at initialisation vs ln(vocab) | ``probes.init_loss`` | ``init_loss(net, batch)`` |
| causality (net and labels) | ``probes.causality`` | ``causality(net, batch)`` |
| sample independence | ``probes.sample_independence`` | ``sample_independence(net, batch)`` |
| train/eval consistency | ``probes.train_eval`` | ``train_eval(net, batch)`` |
| optimizer coverage and gradient flow | ``coverage`` | ``coverage(stepper, batch)`` |
| overfit one batch | ``overfit`` | ``overfit(stepper, batch)`` |
| the run's plan | ``probes.plan`` | ``run_plan(...)``, ``lr_curve(...)`` |
| collectives | ``collectives`` | ``collectives()`` |
| memory forecast | ``memory`` | ``forecast(...)`` |
| checkpoint round trip | ``checkpoint`` | ``checkpoint_round_trip(stepper, batch, path)`` |

Layering: above ``trainer`` (the entry builds the run with ``trainer.entry.build``); only the
command's entry (``dsdebug.train``) imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DoctorCallback", "ProbeResult", "TorchStepper", "StrategyStepper", "init_loss", "causality",
           "sample_independence", "train_eval", "coverage", "overfit", "run_plan", "lr_curve", "collectives",
           "forecast", "checkpoint_round_trip"]

_WHERE = {"DoctorCallback": "doctor.callback", "ProbeResult": "probes.result", "TorchStepper": "doctor.stepper",
          "StrategyStepper": "doctor.stepper", "init_loss": "probes.init_loss", "causality": "probes.causality",
          "sample_independence": "probes.sample_independence", "train_eval": "probes.train_eval",
          "coverage": "doctor.coverage", "overfit": "doctor.overfit", "run_plan": "probes.plan",
          "lr_curve": "probes.plan", "collectives": "doctor.collectives", "forecast": "doctor.memory",
          "checkpoint_round_trip": "doctor.checkpoint"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"dsdebug.{_WHERE[name]}"), name)
    raise AttributeError(name)
