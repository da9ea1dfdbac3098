"""strategy=deepspeed_json: the seeds' ds_config.json files run as written."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from dsdebug.errors import ConfigError
from dsdebug.config.ds_auto import resolve_auto_values
from dsdebug.config.ds_config import apply_ds_json_to_cfg, load_ds_config
from dsdebug.config.validate import fp16_supported
from tests.helpers.runs import REPO, SMALL_DEEPSEEK, SMOKE, assert_ok, metrics, only_run_dir, run_train

EXAMPLES = REPO / "examples" / "ds_configs"


def _cfg(path, devices=1):
    return OmegaConf.create({
        "strategy": {"config": str(path)},
        "data": {"batch_size": 2},
        "trainer": {"devices": devices, "num_nodes": 1, "accumulate_grad_batches": 1,
                    "gradient_clip_val": 1.0, "precision": "32-true"},
    })


def test_numbers_in_the_json_become_the_run_settings():
    cfg = _cfg(EXAMPLES / "zero3_offload_optimizer_fp16.json")
    apply_ds_json_to_cfg(cfg, fp16_supported=True)
    assert cfg.data.batch_size == 8 and cfg.trainer.accumulate_grad_batches == 4
    assert cfg.trainer.precision == "16-mixed"
    cfg = _cfg(EXAMPLES / "zero3_offload_optimizer_fp16.json")
    apply_ds_json_to_cfg(cfg, fp16_supported=False)  # a CPU without fp16
    assert cfg.trainer.precision == "bf16-mixed"


def test_auto_values_resolve_from_trainer_and_model():
    config = load_ds_config(EXAMPLES / "zero3_offload_all_bf16_auto.json")
    module = SimpleNamespace(
        trainer=SimpleNamespace(accumulate_grad_batches=2, precision="bf16-mixed"),
        net=SimpleNamespace(config=SimpleNamespace(hidden_size=256)),
    )
    resolve_auto_values(config, module, source="zero3_offload_all_bf16_auto.json")
    # Lightning fills these from the trainer when they are absent
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert key not in config
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 256 * 256
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 256 * 256)
    assert zero["stage3_param_persistence_threshold"] == 2560
    assert "auto" not in json.dumps(config)


def test_unresolvable_auto_is_a_one_line_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}))
    with pytest.raises(ConfigError, match=r"sub_group_size.*resolvable"):
        resolve_auto_values(load_ds_config(path), None, source=str(path))


@pytest.mark.parametrize("keys,devices,micro,accum", [
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}, 4, 3, 1),
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}, 2, 3, 2),   # accumulation derived
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, 4, 2),       # micro batch derived
    ({"train_batch_size": 16}, 2, 8, 1),                                         # only the total: gas 1
    ({"train_batch_size": 16, "gradient_accumulation_steps": "auto"}, 2, 8, 1),
    ({"train_micro_batch_size_per_gpu": 5}, 2, 5, 1),                            # accumulation: the run's
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 4, 2, 3),
])
def test_batch_keys_follow_deepspeeds_rule(keys, devices, micro, accum, tmp_path):
    """DeepSpeedConfig._set_batch_related_parameters: any two of the three give the third."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(keys))
    cfg = _cfg(path, devices=devices)
    apply_ds_json_to_cfg(cfg, fp16_supported=True)
    assert (cfg.data.batch_size, cfg.trainer.accumulate_grad_batches) == (micro, accum)


@pytest.mark.parametrize("keys,devices,match", [
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}, 8, r"train_batch_size=12 != .* = 0"),
    ({"train_batch_size": 5}, 2, r"train_batch_size=5 != .*multiple of 2"),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 2,
     r"train_batch_size=24 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 3 x world size 2"),
    ({"train_batch_size": 0}, 1, r"train_batch_size=0 must be a positive integer"),
])
def test_inconsistent_batch_keys_are_one_line_errors(keys, devices, match, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(keys))
    with pytest.raises(ConfigError, match=match):
        apply_ds_json_to_cfg(_cfg(path, devices=devices), fp16_supported=True)


@pytest.mark.slow
@pytest.mark.parametrize("name,trainer", [("zero3_offload_all_bf16_auto.json", "ddp_sim")])
def test_article_ds_config_trains(name, trainer, tmp_path, shared_cache):
    # from the command line, as the README shows it: one optimizer step of a smaller DeepSeek; the
    # other article configs train in the ds_config corpus's process group (tests/config/test_ds_config_corpus.py)
    args = SMOKE + [
        "strategy=deepspeed_json", f"strategy.config={EXAMPLES / name}", f"trainer={trainer}",
        "trainer.max_steps=1", "trainer.limit_val_batches=1", "export.hf=false", *SMALL_DEEPSEEK]
    proc = run_train(args, tmp_path, shared_cache)
    assert_ok(proc)
    run_dir = only_run_dir(tmp_path)
    m = metrics(run_dir)
    ds = json.loads((EXAMPLES / name).read_text())
    # an fp16 file trains in fp16 where the CPU has it (AVX512-FP16/AMX), else in bf16 with a warning
    fp16_file, fp16_here = (ds.get("fp16") or {}).get("enabled") is True, fp16_supported("cpu")
    assert m["global_step"] == 1 and m["precision"] == ("16-mixed" if fp16_file and fp16_here else "bf16-mixed")
    assert m["zero_stage"] == ds["zero_optimization"]["stage"]
    resolved = OmegaConf.load(run_dir / "config_resolved.yaml")
    if fp16_file:
        assert resolved.data.batch_size == 8 and resolved.trainer.accumulate_grad_batches == 4
        if not fp16_here:
            assert "downgraded" in (run_dir / "train.log").read_text() or "fp16" in proc.stderr


def test_optimizer_and_scheduler_auto_come_from_the_run():
    """HF Trainer's ds_config_zero2.json shape: every optimizer/scheduler param "auto"."""
    import functools

    import torch

    from dsdebug.models.optim import warmup_cosine

    config = {"optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
              "scheduler": {"type": "WarmupDecayLR", "params": {k: "auto" for k in (
                  "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}},
              "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    module = SimpleNamespace(
        optimizer_factory=functools.partial(torch.optim.AdamW, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
        scheduler_factory=functools.partial(warmup_cosine, warmup_ratio=0.1, min_lr_ratio=0.1),
        trainer=SimpleNamespace(accumulate_grad_batches=1, precision="bf16-mixed", estimated_stepping_batches=300,
                                max_steps=300),
        net=None)
    filled = resolve_auto_values(config, module, source="ds.json")
    assert config["optimizer"]["params"] == {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 6e-4, "warmup_num_steps": 30,
                                             "total_num_steps": 300}
    assert config["fp16"]["enabled"] is False and config["bf16"]["enabled"] is True
    assert "zero_allow_untested_optimizer" not in config  # DeepSpeed builds the optimizer itself
    assert "optimizer.params.lr=0.0006" in filled and "scheduler.params.warmup_num_steps=30" in filled
    # no optimizer section: the module's optimizer (any torch optimizer) may be wrapped by ZeRO
    config = {"zero_optimization": {"stage": 2}}
    resolve_auto_values(config, module, source="ds.json")
    assert config["zero_allow_untested_optimizer"] is True
