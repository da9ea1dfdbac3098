"""The hang watchdog's analysis (reads, never acts): which ranks stalled or are waiting (from their heartbeats),
where a thread is (its stack, in a collective or not), and the one message naming them.
Re-exported from hang_watchdog.py (the thread that acts on it)."""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

__all__ = ["analyze", "describe_hang", "is_waiting", "where_is"]


_COMM_PATHS = ("torch/distributed/", "deepspeed/comm/", "torch/nn/parallel/distributed.py")


def analyze(beats: dict[int, dict], world_size: int, now: float, stale_s: float) -> dict[str, list[int]]:
    """Which ranks are behind. A rank is *behind* if it completed fewer steps or entered
    fewer collectives than the most advanced rank; with equal counts, a rank that is not in
    a collective while others wait in one is behind (it never arrived). *Unresponsive*:
    no heartbeat, or a stale one (its watchdog thread cannot run: dead, or the GIL is held)."""
    unresponsive = [r for r in range(world_size)
                    if r not in beats or (not beats[r].get("fired") and now - beats[r].get("now", 0) > stale_s)]
    alive = {r: b for r, b in beats.items() if r not in unresponsive}
    behind: list[int] = []
    if alive:
        def key(b: dict) -> tuple[int, int]:
            return int(b.get("step", -1)), int(b.get("seq") or 0)
        top = max(key(b) for b in alive.values())
        behind = [r for r, b in alive.items() if key(b) < top]
        if not behind:
            waiting = [r for r, b in alive.items() if is_waiting(b)]
            if waiting and len(waiting) < len(alive):
                behind = [r for r in alive if r not in waiting]
    return {"behind": sorted(behind), "unresponsive": unresponsive,
            "culprits": sorted(set(behind) | set(unresponsive)),
            "waiting": sorted(r for r in alive if r not in behind)}


def is_waiting(beat: dict) -> bool:
    """In a collective: one is in flight, or the training thread's stack is in comm code."""
    return bool(beat.get("inflight")) or bool((beat.get("where") or {}).get("in_comm"))


def describe_hang(analysis: dict, beats: dict[int, dict], timeout_s: float) -> str:
    """One message naming who is behind and where every rank is."""
    def at(r: int, key: str = "user") -> str:
        where = (beats.get(r) or {}).get("where") or {}
        text = where.get(key) or where.get("innermost") or "unknown (no heartbeat)"
        return text.split("site-packages/")[-1]

    parts = [f"no training progress for {analysis['stalled_s']:.0f} s (hang_timeout_s={timeout_s:g})"]
    parts += [f"rank {r} is behind (step {beats[r].get('step')}, {beats[r].get('seq')} collectives entered), "
              f"stuck at {at(r)}" for r in analysis["behind"]]
    parts += [f"rank {r} is unresponsive (no fresh heartbeat: dead, or its Python is blocked)"
              for r in analysis["unresponsive"]]
    for r in analysis["waiting"]:
        inflight = (beats[r].get("inflight") or [{}])[0]
        what = f"{inflight.get('name')} (collective #{inflight.get('seq')})" if inflight else at(r, "innermost")
        parts.append(f"rank {r} waits in {what}")
    if not analysis["culprits"]:
        parts.append("no rank is behind: every rank is blocked at the same point (a collective that never "
                     "completes: network/NCCL, or mismatched collectives)")
    return "; ".join(parts)


def _frame_text(fs: traceback.FrameSummary) -> str:
    return f"{fs.filename}:{fs.lineno} in {fs.name}: {(fs.line or '').strip()}"


def where_is(thread: threading.Thread) -> dict[str, Any]:
    """A thread's innermost frame, innermost frame of project code, and whether it's in comm code."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return {}
    stack = traceback.extract_stack(frame)
    in_tracker = bool(stack) and stack[-1].filename.endswith("comm_debug.py") and stack[-1].name == "timed"
    if in_tracker and len(stack) > 1:
        stack = stack[:-1]  # CommTracker's wrapper: show the caller of the collective
    user = [fs for fs in stack if "site-packages" not in fs.filename and "/lib/python" not in fs.filename]
    return {
        "innermost": _frame_text(stack[-1]),
        "user": _frame_text(user[-1]) if user else None,
        "in_comm": in_tracker or any(p in fs.filename for fs in stack[-4:] for p in _COMM_PATHS),
    }
