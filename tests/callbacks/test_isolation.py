"""Fault isolation (src/callbacks/isolation.py): a check that raises is reported as ``<check>/check_failed``,
switched off on every rank, and the run goes on; strict mode re-raises; user errors pass through; the
checks make their collectives only through distributed/collectives.py (so they agree first).

The planted check (tests/planted/isolation.py) does an all-reduce every step and raises at a chosen step,
rank, hook and point (before or after its collective). The suite runs strict (tests/conftest.py); these
runs set DSDEBUG_STRICT=0 to show what a user gets.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.findings import read_findings
from tests.helpers.runs import REPO, SMOKE, TINY_NET, assert_ok, metrics, only_run_dir, run_train, train_in_process

RAISER = "+callbacks.{0}._target_=tests.planted.isolation.RaisingCheck"
BASE = SMOKE + TINY_NET + ["debug=light", "trainer.max_steps=6", "trainer.val_check_interval=6",
                           "export.hf=false", "export.fp32=false"]


def _raiser(name: str = "raiser", **kw: object) -> list[str]:
    return [RAISER.format(name), f"+callbacks.{name}.name={name}",
            *(f"+callbacks.{name}.{k}={'null' if v is None else v}" for k, v in kw.items())]


def _failed(run_dir: Path) -> list[dict]:
    return [f for f in read_findings(run_dir) if f["code"] == "check_failed"]


def _alive_steps(run_dir: Path, name: str = "raiser") -> list[int]:
    return sorted(f["details"]["step"] for f in read_findings(run_dir, name) if f["code"] == "alive")


# ---- one process, in this process ------------------------------------------------------------------
# id -> (planted check's arguments, the hook its finding names, its last `alive` step: the batch ends at
# global steps 1..6; a check switched off at step 3's batch end reports 1, 2; at the 4th batch's start 1..3)
CASES = {
    "before_its_collective": ({"step": 3, "hook": "on_train_batch_end", "where": "before"}, "on_train_batch_end", 2),
    "after_its_collective": ({"step": 3, "hook": "on_train_batch_end", "where": "after"}, "on_train_batch_end", 2),
    "hook_without_collective": ({"step": 3, "hook": "on_train_batch_start"}, "on_train_batch_start", 3),
    "forward_hook_on_the_model": ({"step": 3, "hook": "forward"}, "a forward hook on the model", 3),
    "writing_a_checkpoint": ({"step": 3, "hook": "state_dict", "error": "zero"}, "state_dict", 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_check_that_raises_is_reported_once_switched_off_and_the_run_completes(case, tmp_path, shared_cache,
                                                                                monkeypatch):
    monkeypatch.setenv("DSDEBUG_STRICT", "0")
    kw, hook, last_alive = CASES[case]
    extra = ["callbacks.model_checkpoint.every_n_train_steps=3"] if kw["hook"] == "state_dict" else []
    run_dir = tmp_path / "run"
    out = train_in_process(BASE + _raiser(**kw) + extra, run_dir, shared_cache)
    assert out["status"] == "completed" and out["global_step"] == 6
    failed = _failed(run_dir)
    assert len(failed) == 1, failed
    f = failed[0]
    assert f["check"] == "raiser" and f["severity"] == "error" and f["details"]["hook"] == hook
    assert f["message"].startswith("a check failed: raiser, ") and "switched off" in f["message"]
    if kw.get("error", "key") == "key":
        assert "KeyError 'grad_norm'" in f["message"]
    assert "Traceback" in f["details"]["traceback"] and "isolation.py" in f["details"]["traceback"]
    alive = _alive_steps(run_dir)  # off from the failure on: no later all-reduce, no later finding
    assert alive == list(range(1, last_alive + 1)), alive
    if kw["hook"] == "state_dict":  # the checkpoint at step 3 was still written, with the check's state left out
        assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
        assert f["step"] == 3
    # the other checks of debug=light ran to the end (the run's own summary findings are there)
    assert any(r["check"] == "loss_spike" and r["code"] == "loss_spike_summary" for r in read_findings(run_dir))


def test_checks_switched_off_mid_run_leave_nothing_running(tmp_path, shared_cache, monkeypatch):
    """Every check of debug=full (+ grad_checkpointing, the profiler inside its window) switched off at step 3
    through the guard's failure path: two steps later no hang watchdog (it would call the healthy run hung and
    end it with exit 124 once the heartbeats stopped), no logging handler, torch's deterministic flag as before,
    no profiler, no saved-tensors hook, no module hook or router observer of a check that is off."""
    monkeypatch.setenv("DSDEBUG_STRICT", "0")
    run_dir = tmp_path / "run"
    assert not torch.are_deterministic_algorithms_enabled()  # debug=full switches it on
    out = train_in_process(SMOKE + TINY_NET + [
        "debug=full", "+callbacks=grad_checkpointing", "callbacks.profiler.wait=1", "callbacks.profiler.active=4",
        "callbacks.comm_debug.hang_timeout_s=300", "trainer.max_steps=7", "trainer.val_check_interval=7",
        "export.hf=false", "export.fp32=false",
        "+callbacks.off._target_=tests.planted.isolation.SwitchAllOffAt", "+callbacks.off.step=3"], run_dir, shared_cache)
    assert out["status"] == "completed" and out["global_step"] == 7
    failed = {f["check"] for f in _failed(run_dir)}
    assert {"comm_debug", "log_sync", "reproducibility", "profiler", "moe_router", "grad_checkpointing",
            "freeze_verify"} <= failed, failed
    left = json.loads((run_dir / "left_behind.json").read_text())
    assert left == {"watchdog_threads": [], "log_handlers": [], "deterministic": False,
                    "profiler_on": False, "saved_tensors_hook": False, "model_hooks": [], "moe_observers": []}


def test_the_verdict_and_the_report_name_the_failed_check(tmp_path, shared_cache, monkeypatch):
    from dsdebug.findings import get_channel

    monkeypatch.setenv("DSDEBUG_STRICT", "0")
    run_dir = tmp_path / "run"
    train_in_process(BASE + _raiser(step=3), run_dir, shared_cache)
    lines = get_channel().summary_lines(run_dir / "report.html", "completed")
    text = "\n".join(lines)
    assert "a check failed: raiser, KeyError 'grad_norm' in on_train_batch_end at step 3" in text
    assert "switched off" in text and lines[-1].startswith("verdict:") and "raiser/check_failed" in lines[-1]
    report = (run_dir / "report.md").read_text()
    assert "a check failed: raiser, KeyError 'grad_norm'" in report


def test_strict_mode_re_raises_and_the_config_wins_over_the_environment(tmp_path, shared_cache, monkeypatch):
    monkeypatch.setenv("DSDEBUG_STRICT", "1")
    with pytest.raises(KeyError, match="grad_norm"):
        train_in_process(BASE + _raiser(step=2), tmp_path / "strict", shared_cache)
    out = train_in_process(BASE + _raiser(step=2) + ["debug.strict=false"], tmp_path / "lenient", shared_cache)
    assert out["status"] == "completed" and len(_failed(tmp_path / "lenient")) == 1
    from dsdebug.callbacks import isolation

    assert isolation.strict()  # the run's debug.strict=false ended with it: the environment decides again
    monkeypatch.setenv("DSDEBUG_STRICT", "0")
    with pytest.raises(KeyError, match="grad_norm"):
        train_in_process(BASE + _raiser(step=2) + ["debug.strict=true"], tmp_path / "strict_cfg", shared_cache)
    assert not isolation.strict()  # also after a run that raised


def test_a_user_error_a_check_finds_is_never_isolated(tmp_path, shared_cache, monkeypatch):
    from dsdebug.errors import ConfigError

    monkeypatch.setenv("DSDEBUG_STRICT", "0")
    with pytest.raises(ConfigError, match="callbacks.bad_argument.pattern"):
        train_in_process(BASE + ["+callbacks.bad._target_=tests.planted.isolation.BadArgumentCheck"],
                         tmp_path / "run", shared_cache)


def test_a_switched_off_check_pickles_and_a_new_fit_runs_it_again():
    import pickle

    from dsdebug.callbacks import isolation
    from tests.planted.isolation import RaisingCheck

    check = RaisingCheck()
    isolation._switch_off(check, "KeyError in on_train_batch_end")
    assert isolation.is_off(check)
    copy = pickle.loads(pickle.dumps(check))  # ddp_spawn sends callbacks to its processes
    assert isolation.is_off(copy)
    assert check.on_train_batch_start(None, None, None, 0) is None  # off: the hook does nothing


# ---- the rule: every collective of a check goes through distributed/collectives.py --------------------
_DIRECT = re.compile(r"\b(strategy\.(reduce|all_gather|broadcast|barrier|reduce_boolean_decision)|"
                     r"dist\.(all_reduce|all_gather|all_gather_object|gather_object|broadcast|broadcast_object_list|"
                     r"barrier|reduce|reduce_scatter|all_to_all|gather|scatter))\(")


def _direct_collectives(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            text = ast.unparse(node.func) + "("
            if _DIRECT.search(text):
                out.append(f"{path.relative_to(REPO)}:{node.lineno} {text}")
    return out


def test_checks_and_probes_make_collectives_only_through_the_agreeing_helpers():
    found = [hit for folder in ("src/callbacks", "src/probes") for p in sorted((REPO / folder).rglob("*.py"))
             for hit in _direct_collectives(p)]
    assert not found, "a check's collective that skips the side channel (use dsdebug.distributed.collectives):\n" \
                      + "\n".join(found)


def test_the_rule_catches_a_planted_direct_collective(tmp_path):
    planted = REPO / "src" / "callbacks" / "_planted_direct.py"
    planted.write_text("def f(trainer, t):\n    return trainer.strategy.reduce(t, reduce_op='sum')\n")
    try:
        assert _direct_collectives(planted) == [f"src/callbacks/_planted_direct.py:2 trainer.strategy.reduce("]
    finally:
        planted.unlink()


# ---- two processes: a check raising on rank 1 only, DDP and ZeRO-3 -----------------------------------
def _two_rank_isolation(strategy: str, tmp_path: Path, cache: Path) -> Path:
    """Three planted checks in one 2-process run: ``a`` raises on rank 1 before the all-reduce rank 0 is
    inside (step 3); ``b`` on rank 0 in a hook without a collective (step 4); ``c`` on every rank after
    its all-reduce (step 2). debug=light's checks make their collectives around them."""
    args = SMOKE + TINY_NET + ["debug=light", "trainer=ddp_sim", f"strategy={strategy}", "trainer.max_steps=6",
                               "trainer.val_check_interval=6", "trainer.limit_val_batches=1", "export.hf=false",
                               *_raiser("a", step=3, rank=1, where="before"),
                               *_raiser("b", step=4, rank=0, hook="on_train_batch_start"),
                               *_raiser("c", step=2, where="after")]
    proc = run_train(args, tmp_path / "logs", cache, timeout=300, env={"DSDEBUG_STRICT": "0"})
    assert_ok(proc)
    return only_run_dir(tmp_path / "logs")


def _assert_isolated_on_two_ranks(run_dir: Path) -> None:
    assert metrics(run_dir)["status"] == "completed" and metrics(run_dir)["global_step"] == 6
    failed = sorted((f["check"], f["rank"], f["step"]) for f in _failed(run_dir))
    assert failed == [("a", 1, 3), ("b", 0, 4), ("c", 0, 2), ("c", 1, 2)], failed
    # switched off on every rank from there: rank 0 reports no alive step of `a` past 2 (its all-reduce at
    # step 3 was dropped there, not left waiting), of `b` past 4 (rank 1's next all-reduce met the notice),
    # of `c` past 1 (step 2's value was reduced, then every rank raised)
    assert max(_alive_steps(run_dir, "a")) == 2 and max(_alive_steps(run_dir, "b")) == 4
    assert max(_alive_steps(run_dir, "c")) == 1
    spike = [r for r in read_findings(run_dir, "loss_spike") if r["code"] == "loss_spike_summary"]
    assert spike and spike[0]["details"]["steps_checked"] == 6  # the light checks' all-reduces kept pairing


def test_a_check_raising_on_rank_1_only_under_zero3_does_not_hang_the_run(tmp_path, shared_cache):
    _assert_isolated_on_two_ranks(_two_rank_isolation("zero3", tmp_path, shared_cache))


@pytest.mark.slow  # the same protocol as the ZeRO-3 run above (make test); DDP's own collectives differ
def test_a_check_raising_on_rank_1_only_under_ddp_does_not_hang_the_run(tmp_path, shared_cache):
    _assert_isolated_on_two_ranks(_two_rank_isolation("ddp", tmp_path, shared_cache))


@pytest.mark.slow  # a 2-process run that stops (~50 s); the protocol's fast 2-process run is the ZeRO-3 one
def test_a_check_failing_inside_a_block_of_collectives_stops_the_run_instead_of_hanging(tmp_path, shared_cache):
    """Rank 1 raises inside a collective_region while rank 0 is in the all-reduce within it: no notice can
    reach rank 0 there, so the failure is reported (in_region) and the run stops, in seconds, not at a timeout."""
    args = SMOKE + TINY_NET + ["debug=light", "trainer=ddp_sim", "strategy=ddp", "trainer.max_steps=6",
                               "trainer.val_check_interval=6", "export.hf=false",
                               *_raiser("a", step=3, rank=1, where="region")]
    proc = run_train(args, tmp_path / "logs", shared_cache, timeout=240, env={"DSDEBUG_STRICT": "0"})
    assert proc.returncode != 0, proc.stdout[-2000:]
    failed = _failed(only_run_dir(tmp_path / "logs"))
    assert [(f["check"], f["rank"], f["step"], f["details"]["in_region"]) for f in failed] == [("a", 1, 3, True)]
    assert "the run stops here" in failed[0]["message"] and "KeyError 'grad_norm'" in failed[0]["message"]


def test_grad_histograms_leave_non_finite_values_out(tmp_path):
    """TensorBoard refuses a histogram of NaN/Inf (it raised on rank 0 only, inside ZeRO's gathers): the finite
    values are written, a tensor with none is skipped."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import TensorBoardLogger

    from dsdebug.callbacks.grad_monitor import GradMonitor

    check = GradMonitor()
    check._factor = 1.0
    tb = TensorBoardLogger(tmp_path)
    trainer = SimpleNamespace(loggers=[tb], global_step=1)
    with pytest.raises(ValueError, match="histogram is empty"):  # what the check met before it filtered
        tb.experiment.add_histogram("raw", torch.full((3,), float("nan")), 0)
    check._histogram(trainer, "w", torch.tensor([float("nan"), 1.0, 2.0, float("inf")]))
    check._histogram(trainer, "all_nan", torch.full((3,), float("nan")))
    tb.experiment.flush()
    assert list(Path(tb.log_dir).glob("events.out.tfevents.*"))


def test_steps_queued_for_a_batched_read_are_judged_when_the_run_fails(tmp_path, shared_cache):
    """loss_spike reads its queue every 10 steps: an Inf loss at step 2 and the user's code failing at step 5
    must still leave the loss spike's finding (the steps queued are judged in on_exception, one process)."""
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="planted: the user's code failed"):
        train_in_process(BASE + ["+callbacks.plant._target_=tests.planted.degenerate.LossAt",
                                 "+callbacks.plant.kind='inf'", "+callbacks.plant.step=2",
                                 "+callbacks.crash._target_=tests.planted.isolation.CrashAt", "+callbacks.crash.step=5"],
                         run_dir, shared_cache)
    spikes = [f for f in read_findings(run_dir, "loss_spike") if f["severity"] in ("warning", "error")]
    assert [f["step"] for f in spikes] == [2], spikes
