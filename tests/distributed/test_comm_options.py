"""Communication options as configuration: DDP comm hooks and ZeRO comm keys from
conf/strategy/, the bytes each collective is handed, and the run's ``comm/comm_setting`` finding.

The unit tests register the real torch hooks on a 1-process gloo DDP model and count the bytes
its buckets send; ONE 2-process run (fp16 gradient communication: torch's bf16 hook refuses
gloo) checks that the run's ``comm/bytes_per_step/all_reduce`` is half of what plain fp32 DDP
sends (4 bytes x #parameters) and that the run reports its comm setting.
"""

from __future__ import annotations

import socket

import pytest
import torch
from hydra.utils import instantiate

from dsdebug.distributed.timing import CommTracker, payload_bytes
from dsdebug.errors import ConfigError
from dsdebug.trainer.comm_options import build_ddp_hook
from tests.helpers.runs import TINY_NET, assert_ok, metrics, only_run_dir, run_train
from tests.helpers.findings import read_findings
from tests.helpers.shared_runs import TWO_PROC
from tests.config.test_configs import _compose


def _strategy(*overrides: str):
    try:
        return instantiate(_compose(list(overrides)).strategy)
    except Exception as e:  # Hydra wraps the error; train.py's CLI unwraps it the same way
        while e is not None and not isinstance(e, ConfigError):
            e = e.__cause__ or e.__context__
        if e is None:
            raise
        raise e


@pytest.mark.parametrize("strategy, hook", [("ddp", "none"), ("ddp_fp16_comm", "fp16"), ("ddp_powersgd", "powersgd")])
def test_ddp_comm_configs_compose(strategy, hook):
    obj = _strategy(f"strategy={strategy}", "strategy.bucket_cap_mb=5", "strategy.gradient_as_bucket_view=true")
    assert obj.comm_hook == hook
    assert obj._ddp_kwargs["bucket_cap_mb"] == 5 and obj._ddp_kwargs["gradient_as_bucket_view"] is True


@pytest.mark.parametrize("overrides, match", [
    (["strategy=ddp_bf16_comm"], r"^strategy\.comm_hook=bf16 needs CUDA \+ NCCL.*valid on CPU: none, fp16, powersgd$"),
    (["strategy=ddp", "strategy.comm_hook=int8"], r"^strategy\.comm_hook='int8' is invalid; valid: none, fp16, bf16"),
    (["strategy=ddp_powersgd", "strategy.powersgd_start_iter=1"], r"^strategy\.powersgd_start_iter=1 is invalid"),
    (["strategy=ddp", "strategy.bucket_cap_mb=0"], r"^strategy\.bucket_cap_mb=0 is invalid"),
    (["strategy=zero2", "+strategy.zero_quantized_gradients=true"], r"^strategy\.zero_quantized_gradients is ZeRO\+\+"
                                                                    r" and needs strategy=zero3"),
    (["strategy=zero3", "strategy.zero_quantized_weights=true"], r"^strategy\.zero_quantized_weights=true .*needs CUDA"),
    (["strategy=zero2", "strategy.communication_data_type=fp8"], r"^strategy\.communication_data_type='fp8' is invalid"),
    (["strategy=zero2", "strategy.reduce_bucket_size=0"], r"^strategy\.reduce_bucket_size=0 is invalid.* or \"auto\"$"),
    (["strategy=zero2", "strategy.allgather_bucket_size=auto"], r"^strategy\.allgather_bucket_size='auto' is invalid"),
])
def test_unsupported_comm_options_are_one_line_errors(overrides, match):
    if torch.cuda.is_available() and "CUDA" in match:
        pytest.skip("supported on this machine")
    with pytest.raises(ConfigError, match=match) as err:
        _strategy(*overrides)
    assert "\n" not in str(err.value)


def test_zero_comm_keys_reach_the_ds_config():
    obj = _strategy("strategy=zero3", "strategy.overlap_comm=false", "strategy.reduce_bucket_size=1000",
                    "strategy.communication_data_type=fp16", "strategy.zero_hpz_partition_size=2")
    zero = obj.config["zero_optimization"]
    assert zero["overlap_comm"] is False and zero["reduce_bucket_size"] == 1000 and zero["zero_hpz_partition_size"] == 2
    assert obj.config["communication_data_type"] == "fp16"


def test_hf_style_auto_bucket_size_passes_the_check():
    """HF's public ds_configs say "reduce_bucket_size": "auto" (filled from hidden_size at setup)."""
    obj = _strategy("strategy=zero3", "strategy.reduce_bucket_size=auto")
    assert obj.config["zero_optimization"]["reduce_bucket_size"] == "auto"


def test_payload_bytes_per_collective():
    t = torch.zeros(10, dtype=torch.float16)
    assert payload_bytes("all_reduce", (t,), {}) == 20
    assert payload_bytes("all_reduce", (), {"tensor": t}) == 20  # deepspeed.comm passes keywords
    assert payload_bytes("all_gather_into_tensor", (torch.zeros(20), t), {}) == 20  # this rank's shard
    assert payload_bytes("reduce_scatter", (t, [t, t]), {}) == 40
    assert payload_bytes("barrier", (), {}) == 0


def _destroy_world() -> None:
    """torch's destroy_process_group leaves DeepSpeed's cached groups (deepspeed.utils.groups: the
    clone of the world an earlier in-process DeepSpeed fit made) pointing at the dead group, and the
    next in-process DeepSpeed fit of this pytest process fails with "Group ... is not registered".
    deepspeed.comm.destroy_process_group releases them, but only once deepspeed.comm has a backend."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    dist.destroy_process_group()
    groups._release_process_group_references(group=None)  # what deepspeed.comm's destroy does after torch's


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if dist.is_initialized():  # an earlier in-process fit in this pytest process left its group
        _destroy_world()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    _destroy_world()


POWERSGD = {"powersgd_rank": 1, "powersgd_warm_start": True, "powersgd_start_iter": 2}


@pytest.mark.parametrize("hook, bytes_per_param", [("none", 4), ("fp16", 2), ("powersgd", None)])
def test_bucket_bytes_are_counted_from_the_registered_hook(one_rank_group, hook, bytes_per_param):
    """The real torch hook on a DDP model: the tracker sees the bucket's all_reduce and its bytes."""
    from torch.nn.parallel import DistributedDataParallel

    from dsdebug.distributed.timing import _timed_allreduce_hook

    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)))
    n_params = sum(p.numel() for p in model.parameters())
    tracker = CommTracker.acquire()
    try:
        state, fn = build_ddp_hook(hook, POWERSGD, None, on_cuda=False)
        if fn is None:  # plain DDP: comm_debug's timed fp32 allreduce hook
            state, fn = (tracker, model.process_group), _timed_allreduce_hook
        model.register_comm_hook(state, fn)
        for _ in range(4):  # PowerSGD compresses from its 3rd step (powersgd_start_iter=2)
            before = dict(tracker.bytes)
            model(torch.randn(4, 16)).sum().backward()
            sent = tracker.bytes["all_reduce"] - before.get("all_reduce", 0)
    finally:
        tracker.release()
    if bytes_per_param is not None:
        assert sent == bytes_per_param * n_params
    else:  # rank-1 factors P, Q of both weight matrices + the biases uncompressed, fp32
        assert sent == 4 * ((32 + 16) + (8 + 32) + (32 + 8)), (sent, 4 * n_params)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.slow
def test_fp16_comm_halves_gradient_bytes_in_a_2_process_run(tmp_path, shared_cache):
    from tests.planted.data import HealthyTinyLM

    proc = run_train([*TWO_PROC, *TINY_NET, "strategy=ddp_fp16_comm", "+callbacks=comm_debug",
                      "callbacks.comm_debug.hang_timeout_s=0"], tmp_path, shared_cache)
    assert_ok(proc)
    run_dir = only_run_dir(tmp_path)
    fp32_bytes = 4 * sum(p.numel() for p in HealthyTinyLM().parameters())  # plain DDP's gradient allreduce
    sent = metrics(run_dir)["comm/bytes_per_step/all_reduce"]
    # the gradient buckets in fp16, plus at most a few scalars (logging, the always-on checks)
    assert fp32_bytes / 2 <= sent <= fp32_bytes / 2 + 1024, (sent, fp32_bytes)
    setting = [f for f in read_findings(run_dir) if (f["check"], f["code"]) == ("comm", "comm_setting")]
    assert len(setting) == 1 and setting[0]["details"]["comm_hook"] == "fp16", setting
    assert setting[0]["details"]["world_size"] == 2 and setting[0]["details"]["backend"] == "gloo"
