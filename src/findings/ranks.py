"""Naming groups of ranks in one short phrase: ``rank 3``, ``ranks 0-7, 9``, ``ranks 0-7 (host-a), 8-15 (host-b)``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["name_ranks", "rank_ranges"]


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and out[-1].rsplit("-", 1)[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def name_ranks(ranks: Iterable[int], hosts: Mapping[int, str] | None = None, max_hosts: int = 4) -> str:
    """``rank 1 (host node-b)`` / ``ranks 0-7 (host node-a), 8 (host node-b)``; hosts grouped, at most
    ``max_hosts`` named (then ``+N more hosts``)."""
    ranks = sorted(set(ranks))
    word = "rank" if len(ranks) == 1 else "ranks"
    if not hosts:
        return f"{word} {rank_ranges(ranks)}"
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(str(hosts.get(r, "?")), []).append(r)
    parts = [f"{rank_ranges(rs)} (host {host})" for host, rs in list(by_host.items())[:max_hosts]]
    if len(by_host) > max_hosts:
        rest = [r for rs in list(by_host.values())[max_hosts:] for r in rs]
        parts.append(f"{rank_ranges(rest)} (+{len(by_host) - max_hosts} more hosts)")
    return f"{word} {', '.join(parts)}"
