"""Train (lightning-hydra-template's src/train.py, cut down): compose, instantiate, fit.

    python src/train.py trainer=ddp_sim callbacks=dsdebug_full model.nan_at_step=3
    python -m dsdebug.report logs/train/runs/<time>      # the checks' findings, found under tensorboard/
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # what rootutils.setup_root does in the template
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402
import lightning as L  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from src.utils.instantiators import instantiate_callbacks, instantiate_loggers  # noqa: E402


def train(cfg: DictConfig) -> L.Trainer:
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=instantiate_callbacks(cfg.get("callbacks")),
                                      logger=instantiate_loggers(cfg.get("logger")))
    trainer.fit(model=model, datamodule=datamodule)
    return trainer


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
