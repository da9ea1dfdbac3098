#!/usr/bin/env python
"""Train a model: ``python train.py [group=option ...] [key=value ...]``.

compose (Hydra, conf/train.yaml) -> instantiate -> fit -> export -> report.
Examples: ``python train.py strategy=zero3 trainer=ddp_sim``,
``python train.py -m optim.lr=1e-3,3e-3 strategy=zero2,zero3 trainer=ddp_sim trainer.max_steps=5``.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402

from src.trainer.cli import precheck_overrides, run  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    return run(cfg, script=__file__)  # a submitit job runs this function, pickled, under its own argv


if __name__ == "__main__":
    from src.trainer.launch_env import detect
    from src.trainer.run_dir import main_argv

    sys.argv[1:] = main_argv()  # torchrun / srun / deepspeed: one run dir for every rank of the job
    # our own child ranks were started from a checked config; an external launcher's were not
    # (every rank checks; only rank 0 prints the error line)
    if os.environ.get("LOCAL_RANK", "0") == "0" or detect() is not None:
        precheck_overrides(sys.argv[1:], ROOT / "conf", "train")
    main()
