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
