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

# dsdebug.train.main does the rest, first the PYTHONHASHSEED re-exec and the recording of a preemption signal
# while the run starts, before any heavy import (its module imports only the standard library)
from dsdebug.train import main  # noqa: E402

if __name__ == "__main__":
    main(entry=__file__)
