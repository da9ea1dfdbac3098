"""The ds_config.json shapes people copy (tests/ds_configs/, each modelled on a public file: see
its README) either train 2-process on CPU with what they ask for, or stop with the documented
one-line error. The training ones are fitted in one shared process group (tests/helpers/ds_config_corpus.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsdebug.config import ds_keys
from dsdebug.config.ds_config import read_ds_config
from tests.helpers.bad_input import cli_error_lines
from tests.helpers.runs import REPO

CORPUS = REPO / "tests" / "ds_configs"
DOC = REPO / "docs" / "ds_config.md"
TRAINS = ["hf_zero2.json", "hf_zero3.json", "hf_zero3_bfloat16.json", "dse_megatron_zero2.json",
          "dse_cifar_cpu_offload.json", "wall_clock_breakdown.json", "dse_autotuning_z3.json"]
# the source articles' files (examples/, README's commands) ride in the same process group
ARTICLE_CONFIGS = ["examples/ds_configs/zero3_offload_optimizer_fp16.json", "examples/ds_configs/zero2_offload_bf16_auto.json"]
# file -> the start of its one-line error (after "error: <path>: ")
ERRORS = {
    "dse_onebit_adam.json": "optimizer.type=OneBitAdam: 1-bit optimizers compress the gradient all-reduce",
    "dse_megatron_offload_old_adam.json": "optimizer.type=DeepSpeed_Adam: not an optimizer DeepSpeed can build; "
                                          "valid: Adam, AdamW",
    "dse_bert_lamb.json": "optimizer.type=Lamb: DeepSpeed's Lamb is FusedLamb, a CUDA kernel",
    "apex_amp.json": "amp.enabled: apex AMP: apex is not installed",
    "dse_zero_infinity_nvme.json": "zero_optimization.offload_optimizer.nvme_path=/nvme_data: NVMe offload needs an "
                                   "existing directory",
    "zero3_key_typo.json": "zero_optimization.stage3_param_persitance_threshold: Extra inputs are not permitted "
                           "(did you mean stage3_param_persistence_threshold?)",
    "train_batch_size_indivisible.json": "train_batch_size=5 != train_micro_batch_size_per_gpu 2 x "
                                         "gradient_accumulation_steps 1 x world size 2",
}
_facts: dict = {}


def corpus_facts(tmp_path_factory, cache) -> dict:
    if not _facts:
        out = tmp_path_factory.mktemp("ds_corpus") / "facts.json"
        env = {**os.environ, "DSDEBUG_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
        for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
            env.pop(var, None)
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "ds_config_corpus.py"), "--devices", "2",
                               "--out", str(out), *TRAINS, *ARTICLE_CONFIGS], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        _facts.update(json.loads(out.read_text()))
    return _facts


def _logs(facts: dict, level: str) -> str:
    return "\n".join(message for lvl, message in facts["logs"] if lvl == level)


def test_every_corpus_file_declares_its_outcome():
    assert sorted(p.name for p in CORPUS.glob("*.json")) == sorted(TRAINS + list(ERRORS))


def test_every_key_the_corpus_uses_is_classified():
    """The corpus covers the keys of the public files it mirrors; each must be in the key table
    (except the deliberate typo), and the table and docs/ds_config.md must name the same keys."""
    used = {key for p in CORPUS.glob("*.json") for key in json.loads(p.read_text())}
    assert used - set(ds_keys.KNOWN) == {"stpes_per_print"}
    doc = DOC.read_text()
    missing = [key for key in ds_keys.KNOWN if f"`{key}`" not in doc]
    assert missing == [], f"docs/ds_config.md does not describe {missing}"


def test_deprecated_keys_are_translated(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory":
                                                      False}, "bfloat16": {"enabled": True}}))
    notes: list[str] = []
    config = read_ds_config(path, notes)
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    assert config["bf16"] == {"enabled": True} and "bfloat16" not in config
    assert any("cpu_offload=true -> offload_optimizer.device=cpu (deprecated)" in n for n in notes)
    path.write_text(json.dumps({"zero_optimization": True, "allgather_size": 1000}))
    assert read_ds_config(path)["zero_optimization"] == {"stage": 1, "allgather_bucket_size": 1000}


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINS + ARTICLE_CONFIGS)
def test_corpus_config_trains_two_processes(name, tmp_path_factory, shared_cache):
    facts = corpus_facts(tmp_path_factory, shared_cache)[name]
    assert (facts["world_size"], facts["global_step"]) == (2, 2)
    assert facts["loss"] is not None and 7.0 < facts["loss"] < 9.5  # ln(4096) = 8.3 at the start
    assert facts["grad_scale_factor"] == pytest.approx(1.0, rel=1e-6)  # verified at the first backward
    assert not [f for f in facts["findings"] if f[2] != "info"], facts["findings"]
    config = json.loads((CORPUS / name if (CORPUS / name).is_file() else REPO / name).read_text())
    zero = config["zero_optimization"]
    assert facts["zero_stage"] == zero["stage"]
    offload = "offload_optimizer" in zero or zero.get("cpu_offload") is True
    assert facts["offload_optimizer"] is offload
    # the micro batch and accumulation DeepSpeed runs are the ones the data loader and Lightning use
    assert (facts["engine_micro"], facts["engine_gas"]) == (facts["batch_size"], facts["accumulate_grad_batches"])
    optimizer = config.get("optimizer")
    if optimizer is None:  # the project's AdamW, built by the module (as DeepSpeedCPUAdam with offload)
        assert facts["optimizer"] == ("DeepSpeedCPUAdam" if offload else "AdamW")
        assert facts["schedulers"] == ["LambdaLR"]
    else:
        assert facts["optimizer"] == ("DeepSpeedCPUAdam" if offload else "FusedAdam")
        assert f"\"optimizer\" ({optimizer['type']}) replaces optim.optimizer" in _logs(facts, "WARNING")
        numbers = {k: v for k, v in optimizer["params"].items() if v != "auto"}
        for key, value in numbers.items():
            assert facts["optimizer_defaults"][key] == pytest.approx(value)
        autos = [k for k, v in optimizer["params"].items() if v == "auto"]
        run_values = {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}  # conf/optim/adamw.yaml
        for key in autos:
            assert facts["optimizer_defaults"][key] == pytest.approx(run_values[key])
            assert f"optimizer.params.{key}=" in _logs(facts, "INFO")
        scheduler = config.get("scheduler")
        if scheduler is None:  # the project's warmup + cosine drives the JSON optimizer
            assert facts["schedulers"] == ["LambdaLR"]
        else:
            assert facts["schedulers"] == [scheduler["type"]]


@pytest.mark.slow
def test_corpus_settles_batch_precision_and_deprecations(tmp_path_factory, shared_cache):
    from dsdebug.config.validate import fp16_supported

    facts = corpus_facts(tmp_path_factory, shared_cache)
    fp16 = "16-mixed" if fp16_supported("cpu") else "bf16-mixed"
    # train_batch_size alone (cifar: 4 over 2 ranks) and with gradient_accumulation_steps (megatron: 16, 1)
    assert (facts["dse_cifar_cpu_offload.json"]["batch_size"], facts["dse_cifar_cpu_offload.json"]
            ["accumulate_grad_batches"]) == (2, 1)
    assert "data.batch_size=2 (from train_batch_size=4 by DeepSpeed's rule)" in \
        _logs(facts["dse_cifar_cpu_offload.json"], "INFO")
    assert facts["dse_megatron_zero2.json"]["batch_size"] == 8
    fp16_file = facts[ARTICLE_CONFIGS[0]]  # micro batch 8 x accumulation 4 from the file, fp16 -> this CPU's precision
    assert (fp16_file["batch_size"], fp16_file["accumulate_grad_batches"], fp16_file["precision"]) == (8, 4, fp16)
    assert facts["dse_cifar_cpu_offload.json"]["precision"] == facts["dse_megatron_zero2.json"]["precision"] == fp16
    assert "cpu_offload=true -> offload_optimizer.device=cpu (deprecated)" in \
        _logs(facts["dse_cifar_cpu_offload.json"], "INFO")
    # "auto" everywhere: the run's precision (fp32) and batch; bucket sizes from hidden_size 64
    hf3 = facts["hf_zero3.json"]
    assert hf3["precision"] == "32-true" and hf3["batch_size"] == 8
    for filled in ("fp16.enabled=false", "scheduler.params.total_num_steps=2", "scheduler.params.warmup_max_lr=0.003",
                   "zero_optimization.reduce_bucket_size=4096", "zero_optimization.stage3_param_persistence_threshold=640"):
        assert filled in _logs(hf3, "INFO")
    assert "translated bfloat16 -> bf16" in _logs(facts["hf_zero3_bfloat16.json"], "INFO")
    # activation_checkpointing: the HF model recomputes; DeepSpeed-only sub-keys are listed
    megatron = facts["dse_megatron_zero2.json"]
    assert megatron["gradient_checkpointing"] is True
    assert "not used under Lightning: activation_checkpointing.{partition_activations}" in _logs(megatron, "INFO")
    assert facts["hf_zero2.json"]["gradient_checkpointing"] is False


@pytest.mark.slow
def test_wall_clock_breakdown_reaches_the_findings(tmp_path_factory, shared_cache):
    """A module whose step calls self(x) used to crash DeepSpeed's timers ("fwd_microstep timer has
    already been started"); now the timings end up in a finding and in the metrics."""
    facts = corpus_facts(tmp_path_factory, shared_cache)["wall_clock_breakdown.json"]
    assert facts["module"] == "SelfCallingLM"
    message = facts["finding_messages"]["ds_wall_clock"]
    phases = dict(re.findall(r"(forward|backward|optimizer step) ([\d.]+) ms", message))
    assert set(phases) == {"forward", "backward", "optimizer step"} and all(float(v) > 0 for v in phases.values())
    assert "not used under Lightning: dataloader_drop_last" in _logs(facts, "INFO")
    assert "stpes_per_print (did you mean steps_per_print?)" in _logs(facts, "WARNING")
    assert {"deepspeed/fwd_ms", "deepspeed/bwd_allreduce_ms", "deepspeed/step_ms"} <= set(facts["history_keys"])


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_corpus_config_refused_in_one_line(name, tmp_path, shared_cache, capsys):
    lines = cli_error_lines(["strategy=deepspeed_json", f"strategy.config={CORPUS / name}", "trainer=ddp_sim"],
                            tmp_path, shared_cache, capsys)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"error: {CORPUS / name}: {ERRORS[name]}") or \
        line.startswith(f"error: {Path('tests/ds_configs') / name}: {ERRORS[name]}"), line
    key = ERRORS[name].split(":")[0].split("=")[0].split(".")[0]
    assert f"`{key}" in DOC.read_text().split("## Refused")[1]  # the docs' refused table names the key
