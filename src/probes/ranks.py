"""Every rank's probe results on every rank, merged to one result per probe (the worst, naming the
rank when ranks disagree). The probes themselves are local; ``gather`` is the one COLLECTIVE here:
every rank calls it, with its results in the same probe order."""

from __future__ import annotations

from dsdebug.distributed import collectives
from dsdebug.probes.result import ProbeResult

__all__ = ["gather", "merge", "RANK_ORDER"]

RANK_ORDER = {"fail": 0, "warn": 1, "pass": 2, "skip": 3}


def gather(results: list[ProbeResult]) -> list[list[ProbeResult]]:
    """Every rank's results, on every rank. COLLECTIVE (one process: just its own)."""
    return collectives.all_gather_object(results)


def merge(per_rank: list[list[ProbeResult]], world: int) -> list[ProbeResult]:
    """One result per probe: the worst over ranks, naming the rank when the ranks disagree."""
    merged = []
    for i, _ in enumerate(per_rank[0]):
        candidates = [(r, results[i]) for r, results in enumerate(per_rank) if i < len(results)]
        rank, worst = min(candidates, key=lambda c: RANK_ORDER[c[1].status])
        if len({c[1].status for c in candidates}) > 1 and world > 1:
            worst.details["rank"] = rank
            worst.message = f"rank {rank}: {worst.message}"
        worst.seconds = max(c[1].seconds for c in candidates)
        merged.append(worst)
    return merged
