"""Planted bugs: nets, callbacks and datamodules that a test run's config names by ``_target_``
(``+callbacks.plant._target_=tests.planted.comm.SleepOnRank``), one module per check or concern.
Importable in every rank's process: a rank runs ``train.py`` from the repo root, so ``tests`` imports."""
