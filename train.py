#!/usr/bin/env python
"""Train a model from a checkout: ``python train.py [group=option ...] [key=value ...]``.

The same command as ``dsdebug-train`` (src/train.py, ``dsdebug.train``); logs go under this
checkout. Examples: ``python train.py strategy=zero3 trainer=ddp_sim``,
``python train.py -m optim.lr=1e-3,3e-3 strategy=zero2,zero3 trainer=ddp_sim trainer.max_steps=5``.
"""

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("PROJECT_ROOT", str(ROOT))

if importlib.util.find_spec("dsdebug") is None:  # not installed (make setup installs it editable)
    _spec = importlib.util.spec_from_file_location("dsdebug", ROOT / "src" / "__init__.py",
                                                   submodule_search_locations=[str(ROOT / "src")])
    sys.modules["dsdebug"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["dsdebug"])

# every rank hashes str alike: with PYTHONHASHSEED unset, set it and re-execute, before anything else
# (src/distributed/hash_seed.py; main() does it for dsdebug-train)
from dsdebug.distributed.hash_seed import fix_hash_seed  # noqa: E402

if __name__ == "__main__":
    fix_hash_seed(sys.argv[1:])

# from here on a preemption signal (SIGUSR1/SIGTERM) is recorded, not fatal: a run stopped while it
# starts ends as `preempted` (src/distributed/startup_signals.py); before the heavy imports below
from dsdebug.distributed.startup_signals import record_from_now  # noqa: E402

record_from_now()

from dsdebug.train import main  # noqa: E402

if __name__ == "__main__":
    main(entry=__file__)
