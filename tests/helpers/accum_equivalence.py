"""Gradient accumulation k x b must equal one batch of k*b: one optimizer step, every strategy.

Run as a script (``python tests/helpers/accum_equivalence.py --devices 2 --out results.json``): one
process group fits, for each strategy, two variants built exactly as ``train.py`` builds them
(``entry.build``): ``accum`` (micro batch b, ``accumulate_grad_batches=k``) and ``big`` (batch
k*b, no accumulation). Both see the same samples on each rank (the sampler deals one global
permutation rank by rank, so rank r's first k micro-batches are its first big batch). With
2 ranks Lightning's launcher re-runs this command line for rank 1; both ranks walk the same
list, so their fits pair up.

Per fit it records, at the first optimizer step: the global gradient norm just before the
update (full gradients: ``safe_get_full_grad`` under ZeRO, on every rank), the loss scale the
``grad_scale`` check measured, and the full fp32 weights after the update. SGD without clipping
makes the update proportional to the gradient (Adam's first step is scale-invariant and
clipping caps the norm, so neither would show a wrong scale in the weights). The net is dense
(no MoE aux loss, which is not additive over micro-batches) and every micro-batch has the same
token count, so the mean of the micro-batch losses is the big batch's loss.

``--plant double`` swaps in Lightning's stock DeepSpeed backward (the engine divides by
gradient_accumulation_steps a second time), the bug this file guards against; ``--plant gas``
gives the engine a gradient_accumulation_steps other than Lightning's accumulation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# "json" = strategy=deepspeed_json with a ds_config.json that sets the micro batch and
# gradient_accumulation_steps itself (the run's accumulation comes from the file)
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "json")
K, B = 4, 2  # accumulation steps x micro batch


def ds_json(out_dir: Path, variant: str) -> Path:
    """A user's ds_config.json fixing micro batch and accumulation (written atomically: both ranks do)."""
    micro, accum = (B, K) if variant == "accum" else (K * B, 1)
    path = out_dir / f"ds_config_{variant}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
                               "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
                               "zero_allow_untested_optimizer": True}))
    os.replace(tmp, path)
    return path


def variant_overrides(strategy: str, variant: str, devices: int, plant: str | None, out_dir: Path) -> list[str]:
    if strategy == "json":
        chosen = ["strategy=deepspeed_json", f"strategy.config={ds_json(out_dir, variant)}"]
        batch = []
    else:
        chosen = [f"strategy={strategy}"]
        batch = ["data.batch_size=2", f"trainer.accumulate_grad_batches={K}"] if variant == "accum" else [
            f"data.batch_size={K * B}", "trainer.accumulate_grad_batches=1"]
    if plant and strategy != "ddp":
        chosen.append(f"strategy._target_=tests.helpers.accum_equivalence.{PLANTS[plant]}")
    # SGD makes the update proportional to the gradient; optimizer offload needs an Adam
    # (DeepSpeedCPUAdam), whose weights after one step show less (its grad norm still does)
    optimizer = [] if strategy.endswith("offload") else [
        "optim.optimizer._target_=torch.optim.SGD", "~optim.optimizer.betas", "~optim.optimizer.eps"]
    return [
        "experiment=smoke", *chosen, f"trainer.devices={devices}", *batch,
        "model.net._target_=tests.planted.data.HealthyTinyLM", *optimizer,
        "optim.optimizer.weight_decay=0.0", "optim.lr=0.5", "~optim.scheduler", "optim.grad_clip=null",
        "trainer.max_steps=1", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
        "~callbacks.model_checkpoint", "~callbacks.lr_monitor", "export.fp32=false", "export.hf=false",
        "data.max_tokens=30000", "preemption.enabled=false",
    ]


def _probe_class() -> type:
    from lightning.pytorch import Callback

    class Probe(Callback):
        """Global grad norm before the first update and the full weights after it (every rank)."""

        def __init__(self) -> None:
            self.grad_norm: float | None = None
            self.weights: dict[str, list[float]] | None = None

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            engine = getattr(trainer.strategy, "deepspeed_engine", None)
            if engine is not None and not engine.is_gradient_accumulation_boundary():
                return
            if self.grad_norm is not None:
                return
            import torch

            total = 0.0
            for p in pl_module.parameters():
                if engine is not None:
                    from deepspeed.utils import safe_get_full_grad

                    g = safe_get_full_grad(p)
                else:
                    g = p.grad
                if g is not None:
                    total += float(g.detach().double().pow(2).sum())
            self.grad_norm = total ** 0.5
            del torch

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if trainer.global_step < 1 or self.weights is not None:
                return
            engine = getattr(trainer.strategy, "deepspeed_engine", None)
            weights = {}
            for name, p in pl_module.named_parameters():
                if engine is not None:
                    from deepspeed.utils import safe_get_full_fp32_param

                    w = safe_get_full_fp32_param(p)
                else:
                    w = p.data
                weights[name] = w.detach().double().flatten().tolist()
            self.weights = weights

    return Probe


PLANTS = {"double": "PlantedDoubleScaling", "gas": "PlantedEngineAccumulation"}


def _planted_strategy(name: str) -> type:
    from dsdebug.trainer.strategy import DebugDeepSpeedStrategy

    class PlantedDoubleScaling(DebugDeepSpeedStrategy):
        """Lightning's stock DeepSpeed backward: the engine scales by 1/gas on top of Lightning."""

        def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            from lightning.pytorch.strategies import DeepSpeedStrategy

            return DeepSpeedStrategy.backward(self, closure_loss, optimizer, *args, **kwargs)

    class PlantedEngineAccumulation(DebugDeepSpeedStrategy):
        """The engine is configured with half of Lightning's accumulation (edited after Lightning)."""

        def _format_config(self) -> None:
            super()._format_config()
            self.config["gradient_accumulation_steps"] = max(1, self.config["gradient_accumulation_steps"] // 2)
            self.config["train_batch_size"] = (self.config["train_micro_batch_size_per_gpu"] * self.world_size
                                               * self.config["gradient_accumulation_steps"])

    return {"PlantedDoubleScaling": PlantedDoubleScaling, "PlantedEngineAccumulation": PlantedEngineAccumulation}[name]


def __getattr__(name: str) -> Any:  # Hydra's _target_ resolves the planted strategies lazily
    if name in PLANTS.values():
        return _planted_strategy(name)
    raise AttributeError(name)


def fit(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    import lightning as L

    from benchmarks.harness import compose
    from dsdebug.findings import configure_channel, get_channel
    from dsdebug.checkpoint.checkpoints import FinalCheckpoint
    from dsdebug.config.prepare import prepare
    from dsdebug.trainer.entry import bind_config, build

    cfg = compose(overrides, run_dir)
    plan = prepare(cfg)
    configure_channel(run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule, module, trainer, _, plan = build(plan)
    bind_config(trainer, plan)
    probe = _probe_class()()
    trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, FinalCheckpoint)] + [probe]
    trainer.fit(module, datamodule=datamodule)
    findings = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()
                if line.strip()] if (run_dir / "findings.jsonl").exists() else []
    del get_channel
    check = next((c for c in trainer.callbacks if type(c).__name__ == "GradScaleCheck"), None)
    return {"grad_norm": probe.grad_norm, "grad_scale_factor": getattr(check, "factor", None), "weights": probe.weights, "global_step": trainer.global_step,
            "rank": trainer.global_rank, "world_size": trainer.world_size,
            "findings": [f for f in findings if f["check"] == "grad_scale"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--variants", default="accum,big")
    p.add_argument("--plant", choices=sorted(PLANTS), default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("PROJECT_ROOT", str(REPO))
    results: dict[str, Any] = {}
    runs = args.out.parent / f"{args.out.stem}_runs"
    runs.mkdir(parents=True, exist_ok=True)
    for strategy in args.strategies.split(","):
        for variant in args.variants.split(","):
            results[f"{strategy}/{variant}"] = fit(
                variant_overrides(strategy, variant, args.devices, args.plant, runs), runs / f"{strategy}_{variant}")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if rank == 0:
        args.out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
