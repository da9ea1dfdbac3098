"""Bad input: one line on stderr naming the key/file and the valid choices, exit code 2."""

from __future__ import annotations

import pytest

from tests.conftest import FAST, error_lines, run_train

CASES = {
    "unknown_group_option": (["strategy=zero4"], ["strategy/zero4", "zero3", "ddp"]),
    "misspelt_key": (["trainer.max_stepz=3"], ["trainer.max_stepz"]),
    "negative_lr": (["optim.lr=-1"], ["optim.lr", "-1"]),
    "devices_over_available": (["trainer=ddp_sim", "trainer.devices=64"], ["trainer.devices=64", "valid: 1.."]),
    "fp16_on_this_cpu": (["trainer.precision=16-mixed"], ["trainer.precision=16-mixed", "bf16-mixed"]),
    "bad_precision": (["trainer.precision=8"], ["trainer.precision", "bf16-mixed"]),
    "missing_data_files": (["data=text_files", "data.source.paths=/nonexistent/*.txt"],
                           ["data.source.paths", "/nonexistent/*.txt"]),
    "missing_checkpoint": (["ckpt_path=/nonexistent/step_000010.ckpt"], ["ckpt_path", "/nonexistent/step_000010.ckpt"]),
    "resume_typo": (["resume=lastest"], ["resume", "latest"]),
    "callback_typo_add": (["+callbacks=grad_monitr"], ["callbacks/grad_monitr", "grad_monitor"]),
    "callback_typo_remove": (["~callbacks.lr_monitr"], ["callbacks.lr_monitr"]),
    "missing_ds_config": (["strategy=deepspeed_json", "strategy.config=/nonexistent/ds.json"],
                          ["strategy.config", "/nonexistent/ds.json"]),
}


def _assert_one_line_error(proc, must_contain):
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr[-3000:]
    for text in must_contain:
        assert text in lines[0], (text, lines[0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_naming_the_key(case, tmp_path, shared_cache):
    overrides, must_contain = CASES[case]
    _assert_one_line_error(run_train(FAST + overrides, tmp_path, shared_cache), must_contain)


def test_empty_data_file(tmp_path, shared_cache):
    (tmp_path / "empty.txt").write_text("")
    proc = run_train(FAST + ["data=text_files", f"data.source.paths={tmp_path}/empty.txt"], tmp_path / "logs", shared_cache)
    _assert_one_line_error(proc, ["empty.txt", "empty"])


def test_corpus_too_small_for_one_batch(tmp_path, shared_cache):
    (tmp_path / "tiny.txt").write_text("In the beginning God created the heaven and the earth. " * 10)
    proc = run_train(FAST + ["data=text_files", f"data.source.paths={tmp_path}/tiny.txt", "data.vocab_size=270"],
                     tmp_path / "logs", shared_cache)
    _assert_one_line_error(proc, ["data.batch_size"])


@pytest.mark.parametrize("content,must_contain", [
    ('{"zero_optimization": {"stage": 3,}', ["invalid JSON", "line 1"]),
    ('{"zero_optimization": {"stage": 7}}', ["zero_optimization.stage=7", "0, 1, 2, 3"]),
    ('{"zero_optimization": {"stage": 2, "overlap_comm": "often"}}', ["zero_optimization.overlap_comm"]),
    ('[1, 2]', ["top level must be a JSON object"]),
    ('{"train_batch_size": 1000, "zero_optimization": {"stage": 2}}', ["train_batch_size=1000"]),
])
def test_bad_ds_config_json(content, must_contain, tmp_path, shared_cache):
    path = tmp_path / "ds_config.json"
    path.write_text(content)
    proc = run_train(FAST + ["strategy=deepspeed_json", f"strategy.config={path}"], tmp_path / "logs", shared_cache)
    _assert_one_line_error(proc, [str(path)] + must_contain)
