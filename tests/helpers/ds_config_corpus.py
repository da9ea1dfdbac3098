"""Fit each ds_config.json of tests/ds_configs/ that should train, in one process group.

``python tests/helpers/ds_config_corpus.py --devices 2 --out facts.json hf_zero2.json ...``: for every
file, a 2-step fit of a small DeepSeek built exactly as ``train.py`` builds it (``entry.build``),
then the facts a test checks: what the run settled (batch, accumulation, precision), what
DeepSpeed built (optimizer, scheduler, ZeRO stage, offload), what was filled and said (log
records of the framework), the findings, and the losses. With 2 ranks Lightning's launcher
re-runs this command for rank 1; both walk the same list, so their fits pair up.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
CONFIGS = REPO / "tests" / "ds_configs"

OVERRIDES = [
    "experiment=smoke", "strategy=deepspeed_json", "model.net.hidden_size=64", "model.net.num_hidden_layers=2",
    "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0", "~callbacks.model_checkpoint", "export.fp32=false", "export.hf=false",
    "preemption.enabled=false",
]


# per file: overrides beyond OVERRIDES. wall_clock_breakdown runs a module whose training_step
# calls self(x), the pattern that entered DeepSpeed's forward hooks twice and crashed its timers
EXTRA = {"wall_clock_breakdown.json": ["model._target_=tests.helpers.ds_config_corpus.SelfCallingLM"]}


def __getattr__(name: str) -> Any:  # Hydra's _target_ builds it lazily (Lightning is imported by then)
    if name == "SelfCallingLM":
        from dsdebug.models.lm_module import CausalLMModule

        class SelfCallingLM(CausalLMModule):
            """A user's LightningModule: the step calls the module itself (``self(input_ids)``)."""

            def training_step(self, batch: dict, batch_idx: int) -> Any:
                import torch.nn.functional as F

                logits = self(batch["input_ids"])
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                       batch["labels"][:, 1:].reshape(-1))
                self.log("train/loss", loss.detach(), on_step=True)
                return loss

            def validation_step(self, batch: dict, batch_idx: int) -> None:
                self(batch["input_ids"])
                super().validation_step(batch, batch_idx)

        return SelfCallingLM
    raise AttributeError(name)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("dsdebug."):
            self.lines.append((record.levelname, record.getMessage()))


def fit(name: str, devices: int, run_dir: Path) -> dict[str, Any]:
    import lightning as L

    from benchmarks.harness import compose
    from dsdebug.findings import configure_channel
    from dsdebug.checkpoint.checkpoints import FinalCheckpoint
    from dsdebug.config.prepare import prepare
    from dsdebug.trainer.entry import bind_config, build

    records = Records()
    logging.getLogger().addHandler(records)
    logging.getLogger().setLevel(logging.INFO)
    try:
        path = CONFIGS / name if (CONFIGS / name).is_file() else REPO / name  # or examples/ds_configs/...
        cfg = compose([*OVERRIDES, f"strategy.config={path}", f"trainer.devices={devices}",
                       *EXTRA.get(name, [])], run_dir)
        plan = prepare(cfg)
        configure_channel(run_dir)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        datamodule, module, trainer, _, plan = build(plan)
        bind_config(trainer, plan)
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, FinalCheckpoint)]
        trainer.fit(module, datamodule=datamodule)
    finally:
        logging.getLogger().removeHandler(records)
    engine = trainer.strategy.deepspeed_engine
    basic = engine.basic_optimizer
    schedulers = [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs]
    findings = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()] \
        if (run_dir / "findings.jsonl").exists() else []
    loss = trainer.callback_metrics.get("train/loss")
    history = run_dir / "history.jsonl"
    history_keys = sorted({k for line in history.read_text().splitlines() for k in json.loads(line)}) \
        if history.exists() else []
    return {
        "global_step": trainer.global_step, "world_size": trainer.world_size,
        "batch_size": int(cfg.data.batch_size), "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "precision": str(trainer.precision), "gradient_clip_val": trainer.gradient_clip_val,
        "engine_gas": engine.gradient_accumulation_steps(), "engine_micro": engine.train_micro_batch_size_per_gpu(),
        "zero_stage": engine.zero_optimization_stage(), "offload_optimizer": bool(engine.zero_cpu_offload()),
        "optimizer": type(basic).__name__, "optimizer_defaults": {k: v for k, v in basic.defaults.items()
                                                                 if k in ("lr", "betas", "eps", "weight_decay")},
        "schedulers": schedulers, "lr_after": [g["lr"] for g in basic.param_groups][:1],
        "gradient_checkpointing": bool(getattr(module.net, "is_gradient_checkpointing", False)),
        "loss": float(loss) if loss is not None and math.isfinite(float(loss)) else None,
        "module": type(module).__name__, "history_keys": history_keys,
        "grad_scale_factor": next((c.factor for c in trainer.callbacks if type(c).__name__ == "GradScaleCheck"),
                                  None),
        "findings": [(f["check"], f["code"], f["severity"]) for f in findings],
        "finding_messages": {f["code"]: f["message"] for f in findings},
        "logs": records.lines, "rank": trainer.global_rank,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("configs", nargs="+")
    args = p.parse_args(argv)
    os.environ.setdefault("PROJECT_ROOT", str(REPO))
    results = {}
    for name in args.configs:
        results[name] = fit(name, args.devices, args.out.parent / f"{args.out.stem}_runs" / Path(name).stem)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        args.out.write_text(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
