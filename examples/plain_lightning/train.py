"""A plain Lightning run with dsdebug's seven checks: no dsdebug config, no Hydra, no framework setup.

    python train.py --root logs                      # 2-rank CPU DDP, healthy
    python train.py --root logs --nan-step 3 --leak  # planted: NaN loss at step 3, val = train

Findings: <root>/lightning_logs/version_<n>/findings.jsonl (and on the console).
"""

import argparse

import lightning as L

from dsdebug.callbacks import (CommDebug, DataInspector, FreezeVerify, GradMonitor, LogSync, Profiler,
                               Reproducibility)
from src.model import BoringModel

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="logs")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nan-step", type=int, default=-1)
    parser.add_argument("--leak", action="store_true", help="validation set = training set")
    parser.add_argument("--tokens", action="store_true", help="token-id batches instead of float tensors")
    args = parser.parse_args()

    L.seed_everything(0)
    checks = [Reproducibility(), CommDebug(), GradMonitor(), DataInspector(), Profiler(wait=1, warmup=0, active=1),
              FreezeVerify(), LogSync(every_n_steps=2)]
    trainer = L.Trainer(strategy="ddp", devices=args.devices, accelerator="cpu", callbacks=checks,
                        default_root_dir=args.root, max_steps=args.steps, val_check_interval=3, limit_val_batches=1,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(BoringModel(tokens=args.tokens, nan_at_step=args.nan_step, val_copies_train=args.leak))
