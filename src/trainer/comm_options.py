"""Communication options as configuration: DDP comm hooks and DeepSpeed's ZeRO comm keys.

DDP (``conf/strategy/ddp*.yaml``): ``bucket_cap_mb``, ``gradient_as_bucket_view``,
``static_graph`` go to ``DistributedDataParallel`` unchanged; ``comm_hook`` picks one of
torch's ``ddp_comm_hooks`` (none | fp16 | bf16 | powersgd), handed to Lightning's
``DDPStrategy(ddp_comm_state=, ddp_comm_hook=)``. Lightning registers hooks on CUDA only;
torch's fp16 and PowerSGD hooks work on gloo/CPU too, so `DebugDDPStrategy` registers them
there as well. torch's bf16 hook requires NCCL (or XCCL): on CPU it is a one-line error.

DeepSpeed (``conf/strategy/zero*.yaml``): Lightning's own arguments (``overlap_comm``,
``reduce_bucket_size``, ``allgather_bucket_size``, ``contiguous_gradients``) plus
``communication_data_type`` and ZeRO++ (``zero_quantized_weights``,
``zero_quantized_gradients``, ``zero_hpz_partition_size``), merged into the ds_config here.
On CPU (DeepSpeed 0.19.8, 2 gloo ranks) hpZ trains; qwZ/qgZ fail in DeepSpeed ("This op had
not been implemented on CPU backend"), so validation refuses them there in one line.

Either way the active setting is reported once at setup as an info finding
``comm/comm_setting`` (rank 0), whether or not ``comm_debug`` is on.
"""

from __future__ import annotations

from typing import Any

from dsdebug.errors import ConfigError
from dsdebug.findings.channel import Finding, get_channel

__all__ = ["COMM_HOOKS", "DS_COMM_DTYPES", "InOrder", "ZERO_PLUS_PLUS", "build_ddp_hook", "check_ddp_options",
           "check_ds_options", "ds_comm_setting", "report_comm_setting"]

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
DS_COMM_DTYPES = ("fp32", "fp16", "bf16")
ZERO_PLUS_PLUS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


def check_ddp_options(comm_hook: str, powersgd: dict[str, Any], ddp_kwargs: dict[str, Any]) -> None:
    """One-line ConfigError for an unknown hook or a bad value (device checks: `build_ddp_hook`)."""
    if comm_hook not in COMM_HOOKS:
        raise ConfigError(f"strategy.comm_hook={comm_hook!r} is invalid; valid: {', '.join(COMM_HOOKS)}")
    cap = ddp_kwargs.get("bucket_cap_mb")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
        raise ConfigError(f"strategy.bucket_cap_mb={cap!r} is invalid; valid: a number of MB > 0 (torch's default 25)")
    rank, start = powersgd["powersgd_rank"], powersgd["powersgd_start_iter"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"strategy.powersgd_rank={rank!r} is invalid; valid: an integer >= 1 (1-4 is typical)")
    if not isinstance(start, int) or isinstance(start, bool) or start < 2:
        # torch: error feedback and warm start need two plain allreduce steps first (DDP rebuilds buckets)
        raise ConfigError(f"strategy.powersgd_start_iter={start!r} is invalid; valid: an integer >= 2")


def build_ddp_hook(comm_hook: str, powersgd: dict[str, Any], process_group: Any, on_cuda: bool) -> tuple[Any, Any]:
    """(state, hook) for ``DDPStrategy(ddp_comm_state=, ddp_comm_hook=)``; (None, None) for none."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if comm_hook == "none":
        return None, None
    if comm_hook == "fp16":
        return process_group, default_hooks.fp16_compress_hook
    if comm_hook == "bf16":
        if not on_cuda:
            raise ConfigError("strategy.comm_hook=bf16 needs CUDA + NCCL (torch's bf16_compress_hook refuses gloo); "
                              "valid on CPU: none, fp16, powersgd")
        return process_group, default_hooks.bf16_compress_hook
    state = powerSGD_hook.PowerSGDState(
        process_group=process_group, matrix_approximation_rank=powersgd["powersgd_rank"],
        start_powerSGD_iter=powersgd["powersgd_start_iter"], warm_start=bool(powersgd["powersgd_warm_start"]),
        use_error_feedback=True)
    if on_cuda:
        return state, powerSGD_hook.powerSGD_hook
    return InOrder(state), _powersgd_in_order


class InOrder:
    """PowerSGD's state plus the previous bucket's future. PowerSGD launches a bucket's second
    all_reduce (Q) from the first one's completion callback, on gloo's thread, while the next
    bucket's hook launches its first from the autograd thread: on gloo the two ranks can issue
    them in different orders (seen: "Received data size doesn't match expected size" with the
    2-bucket default model). NCCL orders them on one stream; on gloo we finish each bucket
    before starting the next (correct, less overlap)."""

    def __init__(self, state: Any) -> None:
        self.state, self.last = state, None


def _powersgd_in_order(holder, bucket):  # unannotated: DDP rejects any annotation but its own types
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if holder.last is not None:
        holder.last.wait()
    holder.last = powerSGD_hook.powerSGD_hook(holder.state, bucket)
    return holder.last


def check_ds_options(config: dict, on_cuda: bool) -> None:
    """One-line ConfigError for a ZeRO comm key DeepSpeed cannot honour here."""
    zero = config.get("zero_optimization") or {}
    dtype = config.get("communication_data_type")
    if dtype is not None and dtype not in DS_COMM_DTYPES:
        raise ConfigError(f"strategy.communication_data_type={dtype!r} is invalid; valid: null, "
                          f"{', '.join(DS_COMM_DTYPES)}")
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        value = zero.get(key)
        if value == "auto" and key == "reduce_bucket_size":  # HF-style: resolved from the model at setup
            continue
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ConfigError(f"strategy.{key}={value!r} is invalid; valid: a number of elements > 0"
                              + (' or "auto"' if key == "reduce_bucket_size" else ""))
    wanted = [k for k in ZERO_PLUS_PLUS if zero.get(k) is True or (type(zero.get(k)) is int and zero[k] > 1)]
    if wanted and zero.get("stage") != 3:
        raise ConfigError(f"strategy.{wanted[0]} is ZeRO++ and needs strategy=zero3 (stage 3); "
                          f"stage {zero.get('stage')} is set")
    quantized = [k for k in wanted if k != "zero_hpz_partition_size"]
    if quantized and not on_cuda:  # DeepSpeed's CPU accelerator has no quantizer op (checked: 0.19.8)
        raise ConfigError(f"strategy.{quantized[0]}=true (ZeRO++ quantized communication) needs CUDA: DeepSpeed's "
                          "CPU accelerator has no quantizer op; valid on CPU: false (zero_hpz_partition_size works)")


def ds_comm_setting(config: dict) -> dict[str, Any]:
    zero = config.get("zero_optimization") or {}
    keys = ("stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
            "reduce_scatter", *ZERO_PLUS_PLUS)
    setting = {k: zero[k] for k in keys if k in zero}
    setting["communication_data_type"] = config.get("communication_data_type")
    return setting


def report_comm_setting(strategy: str, setting: dict[str, Any], world_size: int, backend: str | None) -> None:
    """The info finding every multi-process run carries (rank 0 only: the caller checks); one
    process communicates nothing, so it has none."""
    if world_size <= 1:
        return
    text = ", ".join(f"{k}={v}" for k, v in setting.items())
    get_channel().report(Finding(
        check="comm", severity="info", code="comm_setting",
        message=f"{strategy} over {backend or 'n/a'} on {world_size} rank(s): {text}",
        advice="compare comm/bytes_per_step/<collective> and comm/ms between settings (+callbacks=comm_debug)",
        details={"strategy": strategy, "backend": backend, "world_size": world_size, **setting}))
