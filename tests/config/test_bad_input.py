"""Bad input: one line on stderr naming the key/file and the valid choices, exit code 2.

Every row of docs/bad_inputs.md is one test here (or in the file its row names). A case runs in this
process (tests/helpers/bad_input.py ``cli_error_lines``): each layer of the command line is called in the
CLI's order -- composition (``precheck_overrides``), Hydra's run-start callback (``OutputDirCheck``), the
composed config (``prepare``), the checkpoint to resume, building (``entry.build``), data preparation
(the datamodule's ``setup``) -- and the first one that refuses gives the ``error:`` line the command line
prints. ``trainer/cli.py`` turns every refusal of a layer into that line, exit code 2 and no traceback in
the same way, so ``test_command_line_prints_the_same_line_and_exits_2`` runs ``train.py`` for real once
per layer and compares its line with the in-process one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dsdebug.errors import ConfigError
from tests.helpers.bad_input import assert_one_line_error, cli_error_lines
from tests.helpers.runs import CONF, REPO, SMOKE, compose_as_hydra_main, error_lines, run_train

CASES = {
    "unknown_group_option": (["strategy=zero4"], ["strategy/zero4", "zero3", "ddp"]),
    "misspelt_key": (["trainer.max_stepz=3"], ["trainer.max_stepz", "did you mean trainer.max_steps?"]),
    # the closest valid key: in the same section, else anywhere (a misspelt section)
    "misspelt_key_suggested": (["trainer.max_step=5"], ["'trainer.max_step'", "did you mean trainer.max_steps?"]),
    "misspelt_section_suggested": (["trainr.max_steps=5"], ["'trainr.max_steps'", "did you mean trainer.max_steps?"]),
    "negative_lr": (["optim.lr=-1"], ["optim.lr", "-1"]),
    "devices_over_available": (["trainer=ddp_sim", "trainer.devices=64"], ["trainer.devices=64", "valid: 1.."]),
    "fp16_on_this_cpu": (["trainer.precision=16-mixed"], ["trainer.precision=16-mixed", "bf16-mixed"]),
    "bad_precision": (["trainer.precision=8"], ["trainer.precision", "bf16-mixed"]),
    "missing_data_files": (["data=text_files", "data.source.paths=/nonexistent/*.txt"],
                           ["data.source.paths", "/nonexistent/*.txt"]),
    "missing_checkpoint": (["ckpt_path=/nonexistent/step_000010.ckpt"], ["ckpt_path", "/nonexistent/step_000010.ckpt"]),
    "resume_typo": (["resume=lastest"], ["resume", "latest"]),
    "malloc_tuning_not_bool": (["malloc_tuning=maybe"], ["malloc_tuning='maybe' is invalid", "true", "false"]),
    "debug_strict_not_bool": (["debug.strict=maybe"], ["debug.strict='maybe' is invalid", "true", "false", "null"]),
    "callback_typo_add": (["+callbacks=grad_monitr"], ["callbacks/grad_monitr", "grad_monitor"]),
    "callback_typo_remove": (["~callbacks.lr_monitr"], ["callbacks.lr_monitr", "did you mean callbacks.lr_monitor?"]),
    # a check's own arguments: its __init__'s check_args rules, read from its source before anything is imported
    "check_arg_out_of_range": (["debug=light", "callbacks.grad_monitor.every_n_steps=-1"],
                               ["callbacks.grad_monitor.every_n_steps=-1 is invalid; valid: an int >= 0"]),
    "check_arg_unknown_key": (["debug=light", "+callbacks.grad_monitor.bogus=1"],
                              ["callbacks.grad_monitor.bogus is not an option of dsdebug.callbacks.grad_monitor.GradMonitor",
                               "valid: every_n_steps"]),
    "check_on_error_typo": (["debug=light", "callbacks.grad_monitor.on_error=explode"],
                            ["callbacks.grad_monitor.on_error='explode'", "warn"]),
    # two of a check's arguments that contradict each other: refused when the check is built
    "repro_fill_without_deterministic": (["debug=light", "callbacks.reproducibility.fill_uninitialized_memory=true"],
                                         ["callbacks.reproducibility.fill_uninitialized_memory=true does nothing with "
                                          "callbacks.reproducibility.deterministic=false",
                                          "valid: fill_uninitialized_memory=null or false, or deterministic=true"]),
    "missing_ds_config": (["strategy=deepspeed_json", "strategy.config=/nonexistent/ds.json"],
                          ["strategy.config", "/nonexistent/ds.json"]),
    # wrong types and ranges: caught from the composed config, before anything is imported
    "lr_not_a_number": (["optim.lr=abc"], ["optim.lr must be a positive number, got 'abc'"]),
    "max_steps_not_integer": (["trainer.max_steps=1.5"], ["trainer.max_steps must be a positive integer, got 1.5"]),
    "batch_size_zero": (["data.batch_size=0"], ["data.batch_size must be a positive int, got 0"]),
    "batch_size_negative": (["data.batch_size=-2"], ["data.batch_size must be a positive int, got -2"]),
    "seed_not_integer": (["seed=abc"], ["seed must be an integer, got 'abc'"]),
    "devices_zero": (["trainer.devices=0"], ["trainer.devices=0", "valid: 1.."]),
    "accelerator_tpu": (["trainer.accelerator=tpu"], ["trainer.accelerator='tpu'", "valid: cpu, gpu, cuda, auto"]),
    "moe_aux_coef_not_a_number": (["model.moe_aux_loss_coef=high"],
                                  ["model.moe_aux_loss_coef='high' is invalid; valid: auto, or a number >= 0"]),
    "unknown_logger": (["logger=nope"], ["logger/nope", "csv, many, tensorboard, wandb"]),
    "required_value_unset": (["data=text_files"], ["data.source.paths is required", "data.source.paths='corpus/*.txt'"]),
    "target_not_importable": (["model.net._target_=dsdebug.models.deepseek.build_deepseek_v4"],
                              ["model.net._target_='dsdebug.models.deepseek.build_deepseek_v4'",
                               "did you mean build_deepseek_v3"]),
    # the model must fit the data: checked from the config alone, before tokenizing or building
    "seq_len_over_model_max": (["data.seq_len=1024", "model.net.max_position_embeddings=512"],
                               ["data.seq_len=1024", "model.net.max_position_embeddings=512",
                                "valid: data.seq_len<=512"]),
    "data_vocab_over_model_vocab": (["data.vocab_size=8192", "model.net.vocab_size=4096"],
                                    ["data.vocab_size=8192", "model.net.vocab_size=4096",
                                     "valid: data.vocab_size<=4096"]),
    "global_batch_not_divisible": (["trainer=ddp_sim", "data.global_batch_size=9"],
                                   ["data.global_batch_size=9", "world size 2", "valid: a multiple of 2 (e.g. 8 or 10)"]),
    "gradient_checkpointing_unknown": (["model.gradient_checkpointing=maybe"],
                                       ["model.gradient_checkpointing='maybe' is invalid; valid: false, true "
                                        "(= non_reentrant), reentrant, non_reentrant"]),
    # the model's kernel switches (src/models/kernel_options.py) and the optimizer's fused kernel
    "compile_not_a_bool": (["model.compile=maybe"],
                           ["model.compile='maybe' is invalid; valid: false (eager), true (torch.compile each "
                            "decoder block"]),
    "cross_entropy_unknown": (["model.cross_entropy=fused"],
                              ["model.cross_entropy='fused' is invalid; valid: chunked", "full (one cross_entropy "
                               "over an fp32 copy of the logits: the reference)"]),
    "optimizer_fused_unknown": (["optim.optimizer.fused=yes"],
                                ["optim.optimizer.fused='yes' is invalid; valid: auto (true; false under torch AMP "
                                 "fp16), true (torch's fused kernel), false, null (torch's default)"]),
    # parameters DeepSpeed's engine cannot hold (src/trainer/param_layout.py): refused once the model is built
    "param_empty_under_zero3": (["model.net._target_=tests.planted.shapes.EmptyParamLM", "strategy=zero3"],
                                ["parameter net.extra (shape [0], float32) has no elements", "DeepSpeed ZeRO-3",
                                 "valid: register it as a buffer", "strategy=zero2 or strategy=ddp"]),
    "param_empty_under_zero1": (["model.net._target_=tests.planted.shapes.EmptyParamLM", "strategy=zero1"],
                                ["parameter net.extra (shape [0], float32)", "DeepSpeed ZeRO-1", "zero_to_fp32",
                                 "strategy=zero2 or strategy=ddp"]),
    "param_float64_under_deepspeed": (["model.net._target_=tests.planted.shapes.Float64ParamLM", "strategy=zero2"],
                                      ["parameter net.scale (shape [64], float64)", "DeepSpeed ZeRO-2",
                                       "train as float32", "valid: keep it float32 (cast to float64 inside forward)",
                                       "strategy=ddp"]),
    "param_complex_under_deepspeed": (["model.net._target_=tests.planted.shapes.ComplexParamLM", "strategy=zero3"],
                                      ["parameter net.rot (shape [32], complex64)", "imaginary part is dropped",
                                       "a real float32 tensor of shape [..., 2]", "strategy=ddp"]),
    "param_0_dim_under_stage0_clipping": (["model.net._target_=tests.planted.shapes.GatedLM", "strategy=zero1",
                                           "strategy.stage=0"],
                                          ["parameter net.gate (shape [], float32) is 0-dim", "gradient_clipping=1",
                                           "strategy=zero1|zero2|zero3", "trainer.gradient_clip_val=0"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_naming_the_key(case, tmp_path, shared_cache, capsys, monkeypatch):
    overrides, must_contain = CASES[case]
    if case == "fp16_on_this_cpu":  # the row's CPU: no AVX512-FP16/AMX (whatever this machine has)
        from dsdebug.config import validate

        monkeypatch.setattr(validate, "fp16_supported", lambda accelerator: False)
    assert_one_line_error(cli_error_lines(SMOKE + overrides, tmp_path, shared_cache, capsys), must_contain)


def test_fp16_on_a_cpu_with_fp16_passes_validation(tmp_path, shared_cache, monkeypatch):
    """The other side of row 17: where the probe finds fp16 (AVX512-FP16/AMX), 16-mixed is valid."""
    from hydra.core.hydra_config import HydraConfig

    from dsdebug.config import validate
    from dsdebug.config.prepare import prepare

    probed = []
    monkeypatch.setattr(validate, "fp16_supported", lambda accelerator: probed.append(accelerator) or True)
    try:
        cfg = prepare(compose_as_hydra_main([*SMOKE, "trainer.precision=16-mixed"], tmp_path / "run", shared_cache)).cfg
    finally:
        HydraConfig.instance().cfg = None
    assert cfg.trainer.precision == "16-mixed" and probed == ["cpu"]


# One real command line per layer: the same line as in-process, exit code 2, no traceback.
CLI_CASES = {
    "composition": ["strategy=zero4"],
    "composed_config": ["trainer=ddp_sim", "trainer.devices=64"],
    "hydra_run_dir": ["hydra.run.dir={afile}/run"],
    "build": ["+logger.csv.bogus=1"],
    "data_preparation": ["data=text_files", "data.source.paths={garbage}", "strategy=ddp"],
}


@pytest.mark.parametrize("layer", list(CLI_CASES))
def test_command_line_prints_the_same_line_and_exits_2(layer, tmp_path, shared_cache, capsys):
    (tmp_path / "afile").write_text("keep me\n")
    (tmp_path / "garbage.txt").write_bytes(bytes(range(128, 256)) * 40)
    args = SMOKE + [a.format(afile=tmp_path / "afile", garbage=tmp_path / "garbage.txt") for a in CLI_CASES[layer]]
    proc = run_train(args, tmp_path / "logs", shared_cache)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines == cli_error_lines(args, tmp_path / "logs", shared_cache, capsys)


def test_empty_data_file(tmp_path, shared_cache, capsys):
    (tmp_path / "empty.txt").write_text("")
    lines = cli_error_lines(SMOKE + ["data=text_files", f"data.source.paths={tmp_path}/empty.txt"], tmp_path / "logs",
                            shared_cache, capsys)
    assert_one_line_error(lines, ["empty.txt", "empty"])


def test_corpus_too_small_for_one_batch(tmp_path, shared_cache, capsys):
    (tmp_path / "tiny.txt").write_text("In the beginning God created the heaven and the earth. " * 10)
    lines = cli_error_lines(SMOKE + ["data=text_files", f"data.source.paths={tmp_path}/tiny.txt", "data.vocab_size=270"],
                            tmp_path / "logs", shared_cache, capsys)
    assert_one_line_error(lines, ["data.batch_size"])


@pytest.mark.parametrize("content,must_contain", [
    ('{"zero_optimization": {"stage": 3,}', ["invalid JSON", "line 1"]),
    ('{"zero_optimization": {"stage": 7}}', ["zero_optimization.stage=7", "0, 1, 2, 3"]),
    ('{"zero_optimization": {"stage": 2, "overlap_comm": "often"}}', ["zero_optimization.overlap_comm"]),
    ('[1, 2]', ["top level must be a JSON object"]),
    ('{"train_batch_size": 5, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}',
     ["train_batch_size=5 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 2 x world size 1"]),
], ids=["trailing_comma", "stage_7", "overlap_comm_not_bool", "top_level_list", "train_batch_size_mismatch"])
def test_bad_ds_config_json(content, must_contain, tmp_path, shared_cache, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(content)
    lines = cli_error_lines(SMOKE + ["strategy=deepspeed_json", f"strategy.config={path}"], tmp_path / "logs",
                            shared_cache, capsys)
    assert_one_line_error(lines, [str(path)] + must_contain)


# -- unwritable output -------------------------------------------------------------------
# We run as root, so permission bits do not stop a write; a regular file where a directory
# must go does, for everyone.


@pytest.mark.parametrize("where", ["hydra.run.dir", "hydra.sweep.dir", "paths.log_dir", "data.cache_dir"])
def test_output_dir_under_a_file(where, tmp_path, shared_cache, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    log_dir = tmp_path / "logs"
    if where == "hydra.run.dir":
        args, needles = [f"hydra.run.dir={afile}/run"], [f"hydra.run.dir={afile}/run", f"{afile} is a file"]
    elif where == "hydra.sweep.dir":
        args = [f"hydra.sweep.dir={afile}/sweep", "optim.lr=1e-3,2e-3"]
        needles = [f"hydra.sweep.dir={afile}/sweep", f"{afile} is a file"]
    elif where == "paths.log_dir":
        args, needles, log_dir = [], [f"paths.log_dir={afile}/logs", f"{afile} is a file"], afile / "logs"
    else:
        args, needles = [f"data.cache_dir={afile}/cache"], [f"data.cache_dir={afile}/cache", f"{afile} is a file"]
    multirun = ["-m"] if where == "hydra.sweep.dir" else []  # Hydra's flag goes before the overrides
    lines = cli_error_lines(multirun + SMOKE + args, log_dir, shared_cache, capsys)
    assert_one_line_error(lines, needles + ["valid: a writable directory"])
    assert afile.read_text() == "keep me\n"  # nothing already there is touched


# -- model=hf_pretrained: a local directory, read before anything is loaded --------------


@pytest.mark.parametrize("case", ["missing_dir", "no_config_json", "vocab_smaller_than_data"])
def test_hf_pretrained_dir(case, tmp_path, shared_cache, capsys):
    model_dir = tmp_path / "model"
    if case == "missing_dir":
        needles = [f"model.net.name_or_path={model_dir}: no such directory", "save_pretrained"]
    else:
        model_dir.mkdir()
        needles = [f"model.net.name_or_path={model_dir} has no config.json", "save_pretrained"]
    if case == "vocab_smaller_than_data":
        (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1000,
                                                           "max_position_embeddings": 2048}))
        needles = ["data.vocab_size=4096", "vocab_size=1000", str(model_dir / "config.json"),
                   "valid: data.vocab_size<=1000"]
    lines = cli_error_lines(SMOKE + ["model=hf_pretrained", f"model.net.name_or_path={model_dir}"], tmp_path / "logs",
                            shared_cache, capsys)
    assert_one_line_error(lines, needles)


# -- errors found while building (after the heavy imports: entry.build) ------------------


def test_unknown_logger_option(tmp_path, shared_cache, capsys):
    lines = cli_error_lines(SMOKE + ["+logger.csv.bogus=1"], tmp_path, shared_cache, capsys)
    assert_one_line_error(lines, ["logger.csv.bogus is not an option of lightning.pytorch.loggers.CSVLogger",
                                  "valid: save_dir, name, version"])


# Every section `entry.build` instantiates: a key its target does not take (only reachable with "+", the
# keys in conf/ are struct) names the key, the target and the valid options. Without the check: Hydra's
# multi-line InstantiationException (strategy, trainer, data, model), or a traceback only once the
# ranks run (DDP hands unknown keys to DistributedDataParallel; optimizer/scheduler are partials).
@pytest.mark.parametrize("overrides,must_contain", [
    (["strategy=ddp", "+strategy.bogus=1"], ["strategy.bogus is not an option of the DDP strategy",
                                             "bucket_cap_mb", "static_graph"]),
    (["strategy=zero3", "+strategy.stage3_max_reuse_distance=0"],
     ["strategy.stage3_max_reuse_distance is not an option of dsdebug.trainer.strategy.DebugDeepSpeedStrategy",
      "communication_data_type", "reduce_bucket_size", "strategy=deepspeed_json strategy.config=<file>"]),
    (["+trainer.bogus=1"], ["trainer.bogus is not an option of lightning.pytorch.Trainer", "max_steps"]),
    (["+data.bogus=1"], ["data.bogus is not an option of dsdebug.data.datamodule.LMDataModule", "seq_len"]),
    (["+model.bogus=1"], ["model.bogus is not an option of dsdebug.models.lm_module.CausalLMModule", "net"]),
    (["+optim.optimizer.bogus=1"], ["optim.optimizer.bogus is not an option of torch.optim.AdamW", "weight_decay"]),
    (["+optim.scheduler.bogus=1"], ["optim.scheduler.bogus is not an option of dsdebug.models.optim.warmup_cosine",
                                    "warmup_ratio"]),
], ids=["ddp", "deepspeed", "trainer", "data", "model", "optimizer", "scheduler"])
def test_unknown_key_of_a_built_section(overrides, must_contain, tmp_path, shared_cache, capsys):
    assert_one_line_error(cli_error_lines(SMOKE + overrides, tmp_path, shared_cache, capsys), must_contain)


def test_data_file_not_utf8(tmp_path, shared_cache, capsys):
    garbage = tmp_path / "garbage.txt"
    garbage.write_bytes(bytes(range(128, 256)) * 40)  # never valid UTF-8
    lines = cli_error_lines(SMOKE + ["data=text_files", f"data.source.paths={garbage}", "strategy=ddp"],
                            tmp_path / "logs", shared_cache, capsys)
    assert_one_line_error(lines, [f"data file {garbage} is not valid UTF-8 (byte 0)"])


# -- the layers themselves ---------------------------------------------------------------


def test_target_in_a_missing_module_lists_what_exists():
    from dsdebug.config.targets import target_problem

    assert target_problem("dsdebug.models.deepseek.build_deepseek_v3") is None
    assert target_problem("torch.optim.AdamW") is None
    assert target_problem("lightning.pytorch.loggers.CSVLogger") is None
    models = REPO / "src" / "models"  # every module and package in it, as found on disk
    there = sorted({p.stem for p in models.glob("*.py") if p.stem != "__init__"}
                   | {p.name for p in models.iterdir() if (p / "__init__.py").is_file()})
    assert "deepseek" in there and "optim" in there
    listed = ", ".join(there[:12]) + (", ..." if len(there) > 12 else "")  # the first 12, alphabetically
    assert target_problem("dsdebug.models.nope.build") == f"dsdebug.models has no 'nope'; valid: {listed}"
    assert target_problem("nosuchpkg.x").startswith("no module named 'nosuchpkg'")


def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides)


def test_global_batch_size_sets_the_per_rank_batch(monkeypatch, tmp_path):
    from dsdebug.data.corpus import SyntheticCorpus
    from dsdebug.data.datamodule import LMDataModule
    from dsdebug.config.global_batch import apply_global_batch_size

    monkeypatch.setenv("PROJECT_ROOT", str(REPO))
    cfg = _compose(["trainer=ddp_sim", "trainer.accumulate_grad_batches=2", "data.global_batch_size=32"])
    apply_global_batch_size(cfg)
    assert cfg.data.batch_size == 8  # 32 / (2 ranks x 2 accumulation)
    cfg = _compose(["data.global_batch_size=null", "data.batch_size=5"])
    apply_global_batch_size(cfg)
    assert cfg.data.batch_size == 5  # unset: data.batch_size as given
    # a datamodule built with an underived batch size refuses to run
    dm = LMDataModule(SyntheticCorpus(num_tokens=5000), vocab_size=512, seq_len=16, batch_size=8,
                      global_batch_size=16, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="data.global_batch_size=16 but data.batch_size=8"):
        dm.setup("fit")
    GlobalHydra.instance().clear()


def test_global_batch_size_and_ds_json_batch_together(tmp_path, shared_cache, capsys):
    """A ds_config.json that fixes the batch too would fight data.global_batch_size."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    lines = cli_error_lines(SMOKE + ["strategy=deepspeed_json", f"strategy.config={ds}", "data.global_batch_size=8"],
                            tmp_path / "logs", shared_cache, capsys)
    assert_one_line_error(lines, ["data.global_batch_size=8", f"strategy.config={ds}",
                                  "train_micro_batch_size_per_gpu=4", "data.global_batch_size=null"])


TEXT = "".join(f"Verse {i}: and the evening and the morning were the day number {i}.\n" for i in range(300))


def test_corrupt_tokenizer_cache_is_rebuilt_with_a_warning(tmp_path, caplog):
    """A cache entry is only a cache: a damaged file in it is named in a warning and rebuilt."""
    from dsdebug.data.corpus import TextFilesCorpus
    from dsdebug.data.datamodule import LMDataModule

    (tmp_path / "corpus.txt").write_text(TEXT)

    def datamodule():
        dm = LMDataModule(TextFilesCorpus(str(tmp_path / "corpus.txt")), vocab_size=300, seq_len=16,
                          batch_size=2, cache_dir=str(tmp_path / "cache"))
        dm.setup("fit")
        return dm

    good = datamodule()
    entry = Path(good.tokenizer_dir).parent
    tokens = np.array(good.train_dataset.tokens)
    damage = {
        entry / "tokenizer" / "tokenizer.json": lambda p: p.write_bytes(b"\x00not json"),
        entry / "tokens.npy": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),  # truncated
        entry / "meta.json": lambda p: p.write_text("{"),
    }
    for path, corrupt in damage.items():
        corrupt(path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dsdebug.data.tokenizer"):
            rebuilt = datamodule()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0] and "rebuilding" in warnings[0], warnings
        assert Path(rebuilt.tokenizer_dir).parent == entry
        assert np.array_equal(np.array(rebuilt.train_dataset.tokens), tokens)
        assert rebuilt.tokenizer.decode(rebuilt.tokenizer.encode(TEXT[:200])) == TEXT[:200]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [entry.name]  # no leftovers
