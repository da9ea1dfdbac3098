"""A clean console (src/distributed/console.py): no line of a default run is printed twice, no compiler
lines, no advertisement, no "Epoch 0/-2", and the known third-party warnings are filtered.

What "a line" is here: stdout and stderr split at newlines and carriage returns (a progress bar
redraws with ``\\r``), right-stripped. Not counted: blank lines, progress-bar frames (bar glyphs,
tqdm's ``it/s]``, the bar's ``key: value`` continuation lines) and tables (borders, and rows,
whose wrapped cells can repeat: the findings summary). "Printed twice": the same line twice (two
handlers with the same format: the same timestamp), or a line without Hydra's ``[time][host][logger][LEVEL] - `` prefix that
repeats the message of a prefixed one (a second handler with its own format: Lightning's)."""

from __future__ import annotations

import io
import logging
import re
import warnings
from collections import Counter

import pytest

from dsdebug.distributed import console
from dsdebug.trainer.progress import ThrottledRichProgressBar
from tests.helpers.runs import SMALL_DEEPSEEK, assert_ok, run_train
from tests.helpers.shared_runs import healthy_run

PREFIX = re.compile(r"^\[[^\]]*\]\[[^\]]*\]\[[^\]]*\]\[[A-Z]+\] - ")
_BAR_METRIC = re.compile(r"^[\w/.\- ]+: [-+\w.]+$")
_BOX = re.compile(r"^[\s─━│┃┌┐└┘├┤┬┴┼┏┓┗┛┡┩╇╈┳┻╋═=-]+$")  # also the profiler tables' ---- rules


def console_lines(text: str) -> list[str]:
    out = []
    for line in re.split(r"[\r\n]", text):
        line = line.rstrip()
        if (not line.strip() or "━" in line or "it/s]" in line or _BOX.match(line) or _BAR_METRIC.match(line.strip())
                or line.lstrip().startswith(("│", "┃"))):  # a table's row: wrapped cells may repeat
            continue
        out.append(line)
    return out


def printed_twice(text: str) -> list[str]:
    lines = console_lines(text)
    twice = [line for line, n in Counter(lines).items() if n > 1]
    messages = {PREFIX.sub("", line) for line in lines if PREFIX.match(line)}
    return twice + [line for line in lines if not PREFIX.match(line) and line in messages]


def test_a_planted_second_handler_is_caught_and_single_handler_removes_it():
    root, lightning = logging.getLogger(), logging.getLogger("lightning.pytorch")
    saved = (root.handlers[:], root.level, lightning.handlers[:], lightning.propagate)
    buf = io.StringIO()
    hydra_console = logging.StreamHandler(buf)
    hydra_console.setFormatter(logging.Formatter("[%(asctime)s][host][%(name)s][%(levelname)s] - %(message)s"))
    try:
        root.handlers[:] = [hydra_console]
        root.setLevel(logging.INFO)
        lightning.addHandler(logging.StreamHandler(buf))  # what importing lightning does (planted)
        lightning.propagate = True
        lightning.info("GPU available: False, used: False")
        assert printed_twice(buf.getvalue()) == ["GPU available: False, used: False"]
        buf.seek(0), buf.truncate()
        console.single_handler()
        lightning.info("GPU available: False, used: False")
        assert len(console_lines(buf.getvalue())) == 1 and printed_twice(buf.getvalue()) == []
    finally:
        root.handlers[:], lightning.handlers[:] = saved[0], saved[2]
        root.setLevel(saved[1])
        lightning.propagate = saved[3]


def test_known_warnings_are_filtered_with_a_reason():
    assert all(len(why) > 20 for *_, why in console.KNOWN_WARNINGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.filter_known_warnings()
        warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning,
                               "_pytree.py", 21, module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit("torch.distributed.nn.functional.all_gather is deprecated, use ...", FutureWarning,
                               "distributed.py", 247, module="lightning.fabric.utilities.distributed")
        warnings.warn("an unknown warning stays", UserWarning)
    assert [str(w.message) for w in caught] == ["an unknown warning stays"]


def test_step_limited_bar_has_no_negative_epoch_count():
    class _Trainer:
        max_epochs = -1

    bar = ThrottledRichProgressBar()
    bar._trainer = _Trainer()
    assert bar._get_train_description(0).strip() == "Epoch 0"
    _Trainer.max_epochs = 3
    assert bar._get_train_description(1).strip() == "Epoch 1/2"


def _assert_clean(text: str) -> None:
    assert printed_twice(text) == [], "\n".join(printed_twice(text))
    for noise in ("Epoch 0/-", "💡", "litlogger", "compilers.C", "gcc ", "LeafSpec", "is deprecated",
                  "requires_grad=True to a scalar"):
        assert noise not in text, f"{noise!r} in the console:\n{text[-3000:]}"


@pytest.mark.slow
def test_default_run_console_prints_each_line_once(tmp_path, shared_cache):
    """The default run (DeepSeek-V3, smaller; ZeRO-2, progress bar, TensorBoard), 2 steps."""
    proc = run_train([*SMALL_DEEPSEEK, "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                      "data.max_tokens=60000", "export.hf=false"], tmp_path, shared_cache)
    assert_ok(proc)
    _assert_clean(proc.stdout + "\n" + proc.stderr)
    assert "Epoch 0" in proc.stdout + proc.stderr  # the bar was there


def test_two_process_console_prints_each_line_once(tmp_path_factory, shared_cache):
    """The shared healthy 2-process DDP run (debug=full): rank 1's lines too."""
    run_dir, proc = healthy_run("ddp", tmp_path_factory, shared_cache)
    _assert_clean(proc.stdout + "\n" + proc.stderr)
    # rank 1's info lines (often rank 0's to the millisecond) stay in its own log file
    assert "first batch on rank 0" in proc.stdout + proc.stderr
    assert "first batch on rank 1" not in proc.stdout + proc.stderr
    assert "first batch on rank 1" in (run_dir / "rank1.log").read_text()
    # malloc_tuning (default true) is applied on every rank, the child ranks too
    tuned = "host allocator: glibc malloc keeps freed memory (mmap threshold 32 MiB, heap never trimmed"
    assert tuned in (run_dir / "rank1.log").read_text() and tuned in proc.stdout + proc.stderr


def test_deepspeed_cpu_device_count_no_longer_resets_the_warning_registry_each_step():
    """Why every torch FutureWarning printed at every step: ZeRO-3 asks DeepSpeed's CPU accelerator
    for device_count() at each gradient reduction, which starts `numactl` in a subprocess; starting a
    subprocess enters warnings.catch_warnings (os.get_exec_path), and that resets every 'print once'
    registry. The strategy asks once and keeps the answer (trainer/strategy.py cache_cpu_device_count)."""
    from deepspeed.accelerator import get_accelerator

    from dsdebug.trainer.strategy import cache_cpu_device_count

    mutations = []
    real = warnings._filters_mutated

    def counting():
        mutations.append(1)
        real()

    accelerator = get_accelerator()
    warnings._filters_mutated = counting
    try:
        if not hasattr(accelerator, "_dsdebug_device_count"):  # the cause, shown before the fix is applied
            before = accelerator.device_count()
            assert mutations, "device_count() did not reset the warning filters: the cause is gone?"
        cache_cpu_device_count()
        mutations.clear()
        counts = {accelerator.device_count() for _ in range(3)}
        assert mutations == [] and counts == {accelerator._dsdebug_device_count}
        assert "before" not in locals() or counts == {before}  # the same answer, asked once
    finally:
        warnings._filters_mutated = real


def test_deepspeeds_torch_deprecations_are_filtered():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.filter_known_warnings()
        for name, replacement in (("all_gather_into_tensor", "all_gather_single"),
                                  ("reduce_scatter_tensor", "reduce_scatter_single")):
            warnings.warn_explicit(f"`torch.distributed.{name}` is deprecated. Please use "
                                   f"`torch.distributed.{replacement}` instead.", FutureWarning, "c10d_logger.py", 83,
                                   module="torch.distributed.c10d_logger")
        warnings.warn_explicit("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning, "mine.py", 1,
                               module="my_project.train")  # the user's own call is theirs to see
    assert [w.filename for w in caught] == ["mine.py"]


# ---- the end of a run: one verdict line, the report path last; nothing printed more than twice ----
def _assert_run_end(text: str, last_stream: str, run_dir) -> None:
    """``text``: all the console showed; ``last_stream``: the stream the run ends on."""
    repeated = {line: n for line, n in Counter(console_lines(text)).items() if n > 2}
    assert not repeated, repeated  # a line per rank at most (the per-step warnings printed 244 times)
    assert "FutureWarning" not in text
    last = [line for line in re.split(r"[\r\n]", last_stream) if line.strip()][-1]
    assert last.startswith("verdict: ") and last.endswith(f"report: {run_dir / 'report.html'}"), last
    assert sum(1 for line in text.splitlines() if line.startswith("verdict: ")) == 1


def test_zero3_debug_full_run_ends_with_one_verdict_and_no_repeated_line(tmp_path_factory, shared_cache):
    """The shared 2-process ZeRO-3 debug=full run (the card's command, 6 steps): stdout ends with the
    verdict, every stdout+stderr line at most twice, the two torch deprecations DeepSpeed triggers
    at every step not at all."""
    run_dir, proc = healthy_run("zero3", tmp_path_factory, shared_cache)
    _assert_run_end(proc.stdout + "\n" + proc.stderr, proc.stdout, run_dir)
    assert proc.stdout.strip().splitlines()[-1].startswith("verdict: healthy: no warning or error (")


@pytest.mark.slow  # a 2-process ZeRO-3 run of the default model (~1-2 min on 2 cores); the fast cover: above
def test_the_cards_command_console(tmp_path, shared_cache):
    """`python train.py strategy=zero3 debug=full trainer=ddp_sim` as the card gives it (default model, data,
    progress bar; short), from a shell without PYTHONHASHSEED, stdout and stderr as a terminal interleaves
    them: no line more than twice, no hash-seed advice it cannot follow, the verdict last with the report path."""
    import os
    import subprocess
    import sys

    from tests.helpers.runs import REPO, only_run_dir

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(DSDEBUG_CACHE_DIR=str(shared_cache), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "strategy=zero3", "debug=full", "trainer=ddp_sim",
                           "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                           "data.max_tokens=60000", "export.hf=false", f"paths.log_dir={tmp_path}"],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    _assert_run_end(proc.stdout, proc.stdout, only_run_dir(tmp_path))
    assert "reproducibility/hash_seed_late" not in proc.stdout  # the command set PYTHONHASHSEED itself
