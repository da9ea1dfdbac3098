"""Probe: collectives. Every rank joins an all-reduce, an all-gather and a barrier with the expected
result, timed: a rank that computes a wrong sum, reports another rank id, or arrives seconds late
(a straggler at start) is named.

COLLECTIVE: every rank calls ``collectives()`` at the same point. One process: skipped."""

from __future__ import annotations

import time

import torch

from dsdebug.probes.result import ProbeResult

__all__ = ["collectives"]

NAME = "collectives"


def collectives(late_s: float = 5.0) -> ProbeResult:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ProbeResult(NAME, "skip", "one process: no collective to check")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    arrived = torch.tensor([time.time()], dtype=torch.float64, device=device)
    started = time.perf_counter()
    times = [torch.zeros_like(arrived) for _ in range(world)]
    dist.all_gather(times, arrived)
    gather_ms = (time.perf_counter() - started) * 1e3
    value = torch.tensor([float(rank + 1)], dtype=torch.float64, device=device)
    started = time.perf_counter()
    dist.all_reduce(value)
    reduce_ms = (time.perf_counter() - started) * 1e3
    ranks = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(ranks, torch.tensor([float(rank)], dtype=torch.float64, device=device))
    started = time.perf_counter()
    dist.barrier()
    barrier_ms = (time.perf_counter() - started) * 1e3
    arrivals = [float(t) for t in times]
    late = max(range(world), key=lambda r: arrivals[r])
    spread = max(arrivals) - min(arrivals)
    details = {"world": world, "all_gather_ms": round(gather_ms, 2), "all_reduce_ms": round(reduce_ms, 2),
               "barrier_ms": round(barrier_ms, 2), "arrival_spread_s": round(spread, 3)}
    expected = world * (world + 1) / 2
    if float(value) != expected:
        return ProbeResult(NAME, "fail", f"all-reduce of rank+1 gave {float(value)}, expected {expected}",
                           f"rank {rank}", "check the process group (backend, world size, ranks started twice)", details)
    wrong = [r for r, t in enumerate(ranks) if int(t) != r]
    if wrong:
        return ProbeResult(NAME, "fail", f"all-gather slot {wrong[0]} holds rank {int(ranks[wrong[0]])}: ranks are "
                           "numbered twice or out of order", f"rank {wrong[0]}", "check RANK/LOCAL_RANK of each "
                           "process (the launcher's environment)", details)
    if spread > late_s:
        return ProbeResult(NAME, "warn", f"rank {late} joined {spread:.1f} s after the first: a straggler at start",
                           f"rank {late}", f"look at rank {late}'s host (load, data loading, disk)", details)
    return ProbeResult(NAME, "pass", f"{world} ranks: all-reduce {reduce_ms:.1f} ms, all-gather {gather_ms:.1f} ms, "
                       f"barrier {barrier_ms:.1f} ms, results as expected", details=details)
