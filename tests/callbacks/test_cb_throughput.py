"""throughput: tokens/s, MFU, and the seed-002 findings on planted slow runs (1 process).

Planted: the train collate sleeps 1 s per batch (the box is shared: a step can take ~1 s) (tests.planted.data.BuggyDataModule with only
``slow_collate``) -> ``input_bound`` within 5 steps of the window filling; from step 8 every step
sleeps 4x its earlier median in backward (tests.planted.resources.SlowFrom) -> ``throughput_drop``
naming step 8 within 5 steps. The healthy steps before are silent."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dsdebug.callbacks.throughput import Throughput, _batch_size
from dsdebug.errors import ConfigError
from dsdebug.models.flops import flops_per_token, gpu_peak_flops
from tests.helpers.runs import SMOKE, TINY_NET, train_in_process

SHORT = SMOKE + ["export.fp32=false", "export.hf=false"]


def findings(run_dir, severities=("info", "warning", "error")) -> list[dict]:
    path = run_dir / "findings.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if r["check"] == "throughput" and r["severity"] in severities]


def test_bad_values_are_one_line_config_errors():
    for kwargs, key in (({"window": 2}, "window"), ({"data_wait_threshold": 1.5}, "data_wait_threshold"),
                        ({"drop_factor": 1.0}, "drop_factor"), ({"peak_tflops": -1}, "peak_tflops"),
                        ({"drop_patience": 0}, "drop_patience"), ({"on_error": "ignore"}, "on_error")):
        with pytest.raises(ConfigError, match=f"callbacks.throughput.{key}=.*valid: ") as e:
            Throughput(**kwargs)
        assert "\n" not in str(e.value)


def test_gpu_peak_table_and_flops_of_a_plain_net():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("Some Future GPU") is None
    net = torch.nn.Sequential(torch.nn.Linear(10, 10))  # no config, no embedding: 6 x params
    assert flops_per_token(net, 128) == 6 * 110
    assert _batch_size({"input_ids": torch.zeros(8, 128)}) == (1024, 8)


class _Trainer(SimpleNamespace):
    def __init__(self):
        super().__init__(global_rank=0, global_step=0, train_dataloader=None)


def test_drop_needs_patience_and_rearms(monkeypatch):
    cb = Throughput(window=4, drop_patience=3)
    seen = []
    monkeypatch.setattr(cb, "report", lambda trainer, sev, code, msg, *a, **k: seen.append((code, msg)))
    t = _Trainer()
    for step, s in enumerate([0.1] * 6 + [0.5, 0.5, 0.1] + [0.5] * 3 + [0.1] * 3):
        cb._judge_drop(t, step, s)
    assert [c for c, _ in seen] == ["throughput_drop"] and "since step 9" in seen[0][1]  # 2 slow steps: not yet


@pytest.mark.slow  # clock-bound (1 s per batch), throughput's planted slowdown runs in make test
def test_slow_collate_is_input_bound(tmp_path, shared_cache):
    overrides = SHORT + [*TINY_NET, "+callbacks=throughput", "trainer.max_steps=10", "callbacks.throughput.warmup_steps=1",
                         "callbacks.throughput.window=4", "data._target_=tests.planted.data.BuggyDataModule",
                         "+data.leak_val=false", "+data.urandom_order=false", "+data.shift_labels=false",
                         "+data.collate_delay=1.0", "trainer.val_check_interval=5"]
    m = train_in_process(overrides, tmp_path / "run", shared_cache)
    loud = findings(tmp_path / "run", ("warning", "error"))
    assert loud and {f["code"] for f in loud} == {"input_bound"}, loud
    f = loud[0]
    assert f["step"] <= 1 + 4 + 5 and f["rank"] == 0  # the window fills at step 5 (warm-up 1 + 4 steps)
    assert f["details"]["median_share"] > 0.3 and "collate_fn=slow_collate" in f["message"]
    assert "data.num_workers=0" in f["message"] and "num_workers" in f["advice"]
    assert m["global_step"] == 10


def test_slowdown_from_step_8_is_throughput_drop_and_summary(tmp_path, shared_cache):
    onset = 8
    overrides = SHORT + [*TINY_NET, "+callbacks=throughput", "trainer.max_steps=13", "callbacks.throughput.warmup_steps=1",
                         "callbacks.throughput.window=4", "callbacks.throughput.drop_patience=3",
                         "trainer.val_check_interval=100",
                         "+callbacks.planted._target_=tests.planted.resources.SlowFrom",
                         f"+callbacks.planted.step={onset}", "+callbacks.planted.factor=4"]
    train_in_process(overrides, tmp_path / "run", shared_cache)
    loud = findings(tmp_path / "run", ("warning", "error"))
    assert [f["code"] for f in loud] == ["throughput_drop"], loud
    f = loud[0]
    assert f["details"]["onset_step"] in (onset, onset + 1) and f["step"] <= onset + 5
    assert f"since step {f['details']['onset_step']}" in f["message"] and "rank 0" in f["message"]
    (summary,) = [r for r in findings(tmp_path / "run") if r["code"] == "throughput_summary"]
    med = summary["details"]["median"]
    assert med["tokens_per_s"] > 0 and 0 < med["mfu"] < 1 and "measured" in summary["details"]["peak_source"]
    assert "GPU utilisation not judged (CPU run)" in summary["message"]
    rows = (tmp_path / "run" / "csv" / "metrics.csv").read_text().splitlines()
    assert "throughput/tokens_per_s" in rows[0] and "throughput/mfu" in rows[0]


def test_comm_heavy_reads_comm_debugs_tracker_only_when_it_exists(monkeypatch):
    from dsdebug.distributed.timing import CommTracker

    cb = Throughput(window=3, comm_forward_ratio=0.2)
    seen = []
    monkeypatch.setattr(cb, "report", lambda trainer, sev, code, msg, *a, **k: seen.append((code, msg)))
    cb._fwd_end = 10.0
    monkeypatch.setattr(CommTracker, "_instance", None)
    assert cb._comm_ratio(9.0, 12.0) is None  # no comm measurement: not judged
    monkeypatch.setattr(CommTracker, "_instance", SimpleNamespace(busy_s=lambda lo, hi: 0.5 if (lo, hi) == (10.0, 12.0) else 0))
    assert cb._comm_ratio(9.0, 12.0) == 0.5  # 0.5 s of sync after a 1 s forward
    cb._ratios.extend([0.1, 0.5, 0.6])
    cb._judge(_Trainer(), 7, 1.0)
    assert [c for c, _ in seen] == ["comm_heavy"] and "gradient sync takes 50% of its forward time" in seen[0][1]


def test_comm_ratio_default_judges_cuda_only(monkeypatch):
    """The default (null, as in conf/callbacks/throughput.yaml) is 0.2 on CUDA and not judged on CPU,
    where gloo's healthy sync/forward ratio is 0.55-1.8: standalone and under Hydra alike."""
    for device, expected in (("cpu", []), ("cuda", ["comm_heavy"])):
        cb = Throughput(window=3)
        seen = []
        monkeypatch.setattr(cb, "report", lambda trainer, sev, code, msg, *a, **k: seen.append(code))
        cb._ratios.extend([0.6, 0.7, 0.8])
        trainer = _Trainer()
        trainer.strategy = SimpleNamespace(root_device=SimpleNamespace(type=device))
        cb._judge(trainer, 7, 1.0)
        assert seen == expected, device
