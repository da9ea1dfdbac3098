"""benchmarks/framework_vs_raw.py: the hand-written loop computes what train.py computes, the
step-time parser reads history.jsonl's stamps correctly, and the summary math.

The raw loop is designed as the same computation as the framework (same init seed, batches,
loss code, param groups, schedule, clipping, ZeRO-2 config), and it is: on one rank the two
give bitwise-identical losses at every step, so the real-run test asserts equality.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, only_run_dir

sys.path.insert(0, str(REPO / "benchmarks"))
import cpu_clock  # noqa: E402
import framework_vs_raw as fvr  # noqa: E402
import harness  # noqa: E402

SCRIPT = REPO / "benchmarks" / "framework_vs_raw.py"


def _history(path: Path, rows: list[dict], torn_tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn_tail)
    return path


def test_parse_history_keys_stamps_by_optimizer_steps_done(tmp_path):
    rows = [{"step": 0, "time": 100.0, "val/loss": 8.3}]  # sanity validation: no train/loss
    for s in (9, 19, 29):  # Lightning's rows with log_every_n_steps=10: LR monitor, then metrics
        rows.append({"step": s, "time": 1000.0 + s, "lr-AdamW/pg1": 1e-3})  # batch start
        rows.append({"step": s, "time": 1000.5 + s, "train/loss": 9.0 - s / 10})  # after step s+1
    rows.append({"step": 29, "time": 5000.0, "train/loss": 0.0})  # a later row of the same step
    stamps, losses = fvr.parse_history(_history(tmp_path / "history.jsonl", rows, '{"step": 39, "ti'))
    assert stamps == {10: 1009.5, 20: 1019.5, 30: 1029.5}
    assert losses == {10: pytest.approx(8.1), 20: pytest.approx(7.1), 30: pytest.approx(6.1)}
    assert fvr.mean_step_ms(stamps, warmup=10, steps=20) == pytest.approx(1000.0)
    with pytest.raises(fvr.BenchError, match=r"after step\(s\) \[40\]"):
        fvr.mean_step_ms(stamps, warmup=10, steps=30)
    assert fvr.block_ms({10: 0.0, 20: 1.0, 30: 3.0, 40: 3.5}, warmup=10, steps=30) == \
        pytest.approx([100.0, 200.0, 50.0])


def test_rounds_alternate_order_and_overhead_is_the_median():
    assert [fvr.round_order(r) for r in range(4)] == [["raw", "framework"], ["framework", "raw"]] * 2
    rounds = [{"raw_ms": 100.0, "framework_ms": 102.0, "raw_blocks_ms": [90.0, 110.0], "framework_blocks_ms": [99.0]},
              {"raw_ms": 100.0, "framework_ms": 110.0, "raw_blocks_ms": [80.0], "framework_blocks_ms": [88.0, 200.0]},
              {"raw_ms": 200.0, "framework_ms": 202.0, "raw_blocks_ms": [100.0], "framework_blocks_ms": [95.0]}]
    s = fvr.summarize(rounds)
    assert s["overheads"] == pytest.approx([0.02, 0.10, 0.01])
    assert s["overhead_fastest_blocks"] == pytest.approx(0.10)  # median of +10 %, +10 %, -5 %
    assert s["overhead"] == pytest.approx(0.02) and s["target_met"] is True
    assert (s["raw_ms"], s["framework_ms"]) == (100.0, 110.0)
    s2 = fvr.summarize(rounds[:2])  # even count: mean of the middle two
    assert s2["overhead"] == pytest.approx(0.06) and s2["target_met"] is False

    report = {"machine": {"date": "d", "cpu": "c", "cores": 2, "git": "g"}, "warmup": 10, "steps": 50,
              "target": 0.03, "wall_s": 1.0,
              "results": [{"ranks": 2, **s, "rounds": [{**r, "round": i, "order": fvr.round_order(i),
                                                         "loss": {"raw": {10: 6.0, 60: 5.0},
                                                                  "framework": {10: 6.0, 60: None}}}
                                                        for i, r in enumerate(rounds)]}]}
    md = fvr.results_md(report)
    assert "| 2 | 100.0 | 110.0 | +2.0% | r0 (raw first): 100.0 / 102.0, +2.0%; r1 (framework first)" in md
    assert "| +10.0% | yes |" in md and "| 2 | 6.000000 / 5.000000 | 6.000000 / - | 0 |" in md


def test_raw_constants_mirror_the_default_config(tmp_path):
    from omegaconf import OmegaConf

    from dsdebug.models.optim import resolve_fused
    from dsdebug.trainer.strategy import DebugDeepSpeedStrategy

    cfg = harness.compose(["strategy=zero2"], tmp_path)
    net = OmegaConf.to_container(cfg.model.net, resolve=True)
    net.pop("_target_")
    assert net == fvr.MODEL
    assert (cfg.seed, cfg.data.batch_size, cfg.data.seq_len, cfg.data.vocab_size) == \
        (fvr.SEED, fvr.BATCH_SIZE, fvr.SEQ_LEN, fvr.VOCAB)
    opt = cfg.optim
    assert (opt.lr, tuple(opt.optimizer.betas), opt.optimizer.eps, opt.optimizer.weight_decay) == \
        (fvr.LR, fvr.BETAS, fvr.EPS, fvr.WEIGHT_DECAY)
    assert (resolve_fused(opt.optimizer.fused, cfg.trainer.precision, cfg.strategy._target_), cfg.model.cross_entropy) \
        == (fvr.FUSED, fvr.CROSS_ENTROPY)
    assert (opt.scheduler.warmup_ratio, opt.scheduler.min_lr_ratio, opt.grad_clip, cfg.model.moe_aux_loss_coef) == \
        (fvr.WARMUP_RATIO, fvr.MIN_LR_RATIO, fvr.GRAD_CLIP, fvr.AUX_COEF)
    assert cfg.trainer.log_every_n_steps == fvr.LOG_EVERY
    assert DebugDeepSpeedStrategy(stage=2).config["zero_optimization"] == fvr.ZERO2


def test_cpu_window_and_side_summary_report_wall_and_cpu_ratios():
    stamps = {10: {"wall": 100.0, "cpu": 5.0, "threads": {"MainThread": 4.0, "rank-liveness": 0.01}},
              30: {"wall": 110.0, "cpu": 12.0, "threads": {"MainThread": 10.5, "rank-liveness": 0.02, "new": 0.3}}}
    rec = cpu_clock.window(stamps, 10, 30, rank=1, threads=1)
    assert (rec["wall_s"], rec["cpu_s"], rec["rank"]) == (10.0, 7.0, 1)
    assert rec["threads_cpu_s"] == {"MainThread": 6.5, "rank-liveness": 0.01, "new": 0.3}  # deltas over the window
    s = cpu_clock.summarize_ranks([{**rec, "rank": 0}, rec], steps=20)
    assert s["wall_ms"] == 500.0 and s["cpu_ms_per_rank"] == [350.0, 350.0] and s["cpu_ms"] == 700.0
    assert cpu_clock.stamp(threads=False).keys() == {"wall", "cpu", "rusage"}
    # page faults and system time per step: every rank's getrusage deltas over the window, summed
    a, b = cpu_clock.stamp(threads=False), None
    block = bytearray(64 << 20)  # touching 64 MiB of fresh pages faults them in
    b = cpu_clock.stamp(threads=False)
    assert b["rusage"]["minflt"] - a["rusage"]["minflt"] >= 1000 and len(block) == 64 << 20
    faulted = cpu_clock.window({10: a, 30: b}, 10, 30, rank=0, threads=1)
    s2 = cpu_clock.summarize_ranks([faulted, faulted], steps=20)
    assert s2["minflt_per_step"] == 2 * faulted["rusage"]["minflt"] / 20
    assert s2["sys_ms"] == 2 * faulted["rusage"]["stime"] / 20 * 1000.0
    assert cpu_clock.thread_cpu()["MainThread"] > 0

    assert fvr.round_order(1, ("raw", "framework", "no_preemption")) == ["framework", "no_preemption", "raw"]
    rounds = [{"sides": {"raw": {"ms": 100.0, "cpu_ms": 200.0}, "framework": {"ms": 110.0, "cpu_ms": 204.0}}},
              {"sides": {"raw": {"ms": 200.0, "cpu_ms": 200.0}, "framework": {"ms": 204.0, "cpu_ms": 202.0}}},
              {"sides": {"raw": {"ms": 100.0, "cpu_ms": 100.0}, "framework": {"ms": 103.0, "cpu_ms": 110.0}}}]
    v = fvr.side_summary(rounds, "framework")
    assert v["wall_overheads"] == pytest.approx([0.10, 0.02, 0.03]) and v["wall_overhead"] == pytest.approx(0.03)
    assert v["cpu_overheads"] == pytest.approx([0.02, 0.01, 0.10]) and v["cpu_overhead"] == pytest.approx(0.02)
    assert (v["wall_ms"], v["cpu_ms"]) == (110.0, 202.0)


def test_variants_flag_keeps_framework_first_and_names_the_valid_ones(capsys):
    assert fvr.parse_args(["--variants", "no_preemption,framework,no_preemption"]).variants == \
        ["framework", "no_preemption"]
    with pytest.raises(SystemExit):
        fvr.parse_args(["--variants", "nope"])
    err = capsys.readouterr().err
    assert "'nope'" in err and "no_collectives" in err and err.count("\n") == 1
    cmd = fvr.framework_command(fvr.parse_args(["--variants", "no_collectives"]), 2, Path("/x"), "no_collectives",
                                Path("/c"))
    assert "preemption.enabled=false" in cmd and "+callbacks.cpu_clock.ablate=[lightning_sigterm]" in cmd
    assert "+callbacks.cpu_clock.out=/c" in cmd and "trainer.devices=2" in cmd


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "1,0"], "argument --ranks: '1,0': give positive integers"),
    (["--steps", "25"], "argument --steps: '25' must be a multiple of 10"),
    (["--rounds", "x"], "argument --rounds: 'x' is not an integer"),
    (["--hidden-size", "66"], "--hidden-size 66 must be a multiple of 4"),
    (["--layers", "1"], "--layers 1: need >= 2"),
])
def test_bad_flags_are_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        fvr.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_raw_loop_computes_what_train_py_computes(tmp_path, shared_cache):
    """One rank, 3 steps of a shrunken DeepSeek: raw loop and train.py, started side by side."""
    env = {**fvr._env(1), "DSDEBUG_CACHE_DIR": str(shared_cache), "OMP_NUM_THREADS": "1"}  # PYTHONPATH: cpu_clock
    result = tmp_path / "raw.json"
    raw_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29547",
               str(SCRIPT), "--raw", "--total-steps", "3", "--warmup", "1", "--log-every", "1", "--result", str(result),
               "--hidden-size", "64", "--layers", "2"]
    fw_cmd = [sys.executable, str(REPO / "train.py"), "debug=none", "strategy=zero2", "trainer=cpu",
              "trainer.max_steps=3", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0",
              "export.fp32=false", "export.hf=false", f"paths.log_dir={tmp_path / 'fw'}",
              "model.net.hidden_size=64", "model.net.num_hidden_layers=2",
              "+callbacks.cpu_clock._target_=cpu_clock.CpuClock", f"+callbacks.cpu_clock.out={tmp_path / 'fw_cpu'}",
              "+callbacks.cpu_clock.start=1", "+callbacks.cpu_clock.end=3"]
    # (if the token cache is not built yet, both build it: builds are atomic, racing is safe)
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (raw_cmd, fw_cmd)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]

    raw = {int(k): v for k, v in json.loads(result.read_text())["losses"].items()}
    assert sorted(raw) == [1, 2, 3] and all(math.isfinite(v) for v in raw.values())
    assert raw[1] == pytest.approx(math.log(4096), abs=0.3)  # random init: ~uniform over the vocab
    assert raw[3] < raw[2] < raw[1]
    assert "step 2 loss" in outs[0]  # the raw loop prints its loss as it logs

    stamps, fw = fvr.parse_history(only_run_dir(tmp_path / "fw") / "history.jsonl")
    # same init, batches, loss code, optimizer path: identical losses, bit for bit
    assert fw == raw
    assert sorted(stamps) == [1, 2, 3] and stamps[1] < stamps[2] < stamps[3]

    # CPU time over the same window (steps 1..3] on both sides: present, positive, and no more than
    # the wall time x the cores the process could use (+ slack for the clocks' granularity)
    cores = os.cpu_count() or 1
    for records in (json.loads(result.read_text())["cpu"], cpu_clock.read_ranks(tmp_path / "fw_cpu")):
        assert len(records) == 1 and records[0]["rank"] == 0 and (records[0]["start"], records[0]["end"]) == (1, 3)
        r = records[0]
        assert 0 < r["cpu_s"] <= r["wall_s"] * cores + 0.05, r
        assert r["threads_cpu_s"]["MainThread"] > 0 and r["torch_threads"] == 1
        s = cpu_clock.summarize_ranks(records, steps=2)
        assert s["cpu_ms"] == pytest.approx(r["cpu_s"] / 2 * 1000) and s["wall_ms"] > 0
