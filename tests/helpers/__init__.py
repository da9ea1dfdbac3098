"""Test helpers (no tests, no fixtures: those live in tests/conftest.py).

- ``runs``: run ``train.py`` as a user would (``run_train``) or in this process (``train_in_process``),
  compose a config as ``@hydra.main`` does (``compose_as_hydra_main``), read what a run wrote;
- ``shared_runs``: the multi-process runs many tests read, each made once per session;
- ``findings``: read ``findings.jsonl``, CSV metrics and offline W&B files;
- ``procs``: background runs for fault tests (start, wait, find ranks);
- ``fake_slurm``: ``sbatch``/``srun`` stand-ins on one machine;
- ``nets``: a user's own network (``model.net._target_=tests.helpers.nets.TinyLM``);
- ``tokenizer_families``, ``ds_config_corpus``, ``accum_equivalence``: builders and fit scripts
  of the tests of those names.

Planted bugs (nets, callbacks, datamodules a run's config names by ``_target_``) are in
``tests/planted/``.
"""
