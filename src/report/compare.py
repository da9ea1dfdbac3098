"""`compare(run_a, run_b, out_dir)`: what differs between two runs, as ``compare.html`` / ``.md``.

Config (flattened keys of config_resolved.yaml), environment (rank 0's repro record), loss
curves overlaid, the first step where train/loss differs (exact comparison: two runs meant to be
identical must match bit for bit on CPU), and findings present in one run only (by check/code).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dsdebug.report import plots
from dsdebug.report.doc import Document
from dsdebug.report.load import RunData, load_run, read_repro
from dsdebug.report.render import all_findings, command, flatten

__all__ = ["build", "compare", "diff_dicts", "first_loss_difference"]

log = logging.getLogger(__name__)
_MISSING = "(absent)"
_ENV_SKIP = {"rank", "rng_state_file"}


def diff_dicts(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, a's value, b's value) for every flattened key whose values differ."""
    fa, fb = flatten(a), flatten(b)
    return [(k, fa.get(k, _MISSING), fb.get(k, _MISSING)) for k in sorted(set(fa) | set(fb))
            if fa.get(k, _MISSING) != fb.get(k, _MISSING)]


def first_loss_difference(a: RunData, b: RunData, key: str = "train/loss") -> dict[str, Any]:
    """Exact comparison over the steps both runs logged."""
    sa, sb = dict(zip(*a.series(key))), dict(zip(*b.series(key)))
    common = sorted(set(sa) & set(sb))
    for step in common:
        va, vb = sa[step], sb[step]
        if not (va == vb or (va != va and vb != vb)):  # nan == nan counts as equal here
            return {"step": step, "a": va, "b": vb, "common": len(common)}
    return {"step": None, "common": len(common)}


def _env(run: RunData) -> dict[str, Any]:
    repro = read_repro(run.path)
    record = repro.get(0) or (repro[min(repro)] if repro else {})
    return {k: v for k, v in record.items() if k not in _ENV_SKIP}


def _section(doc: Document, title: str, body) -> None:
    doc.heading(title)
    try:
        body()
    except Exception as exc:  # noqa: BLE001 - a crashed run's partial files: keep the other sections
        log.warning("compare: section %r failed", title, exc_info=True)
        doc.note(f"this section could not be built: {type(exc).__name__}: {exc}")


def build(a: RunData, b: RunData, name_a: str = "A", name_b: str = "B") -> Document:
    doc = Document(f"Compare: {Path(a.path).name} vs {Path(b.path).name}")

    def runs() -> None:
        doc.table(["", name_a, name_b], [
            ["dir", str(a.path), str(b.path)], ["command", command(a), command(b)],
            ["status", a.status, b.status],
            ["steps", a.metrics.get("global_step"), b.metrics.get("global_step")],
            ["final train/loss", a.metrics.get("train/loss"), b.metrics.get("train/loss")],
            ["final val/loss", a.metrics.get("val/loss"), b.metrics.get("val/loss")],
            ["time_s", a.metrics.get("time_s"), b.metrics.get("time_s")]])

    def config() -> None:
        if not a.config and not b.config:
            doc.note("neither run has config_resolved.yaml")
            return
        rows = diff_dicts(a.config, b.config)
        if not rows:
            doc.para("identical resolved configs", "ok")
        else:
            doc.table(["key", name_a, name_b], [list(r) for r in rows], ["mismatch"] * len(rows))

    def env() -> None:
        ea, eb = _env(a), _env(b)
        if not ea and not eb:
            doc.note("not recorded: enable debug=repro in both runs (repro/rank0.json)")
            return
        rows = diff_dicts(ea, eb)
        if not rows:
            doc.para("identical rank-0 environment records", "ok")
        else:
            doc.table(["key", name_a, name_b], [list(r) for r in rows], ["mismatch"] * len(rows))

    def curves() -> None:
        png = plots.loss_overlay({name_a: a, name_b: b})
        if png is None:
            doc.note("neither run logged train/loss or val/loss")
        else:
            doc.image("loss_overlay", "loss curves", png)
        diff = first_loss_difference(a, b)
        if not diff["common"]:
            doc.note("no step logged train/loss in both runs")
        elif diff["step"] is None:
            doc.para(f"train/loss is bit-for-bit identical over all {diff['common']} steps both runs logged", "ok")
        else:
            doc.para(f"train/loss first differs at step {diff['step']}: {diff['a']!r} ({name_a}) vs "
                     f"{diff['b']!r} ({name_b})", "bad")

    def findings() -> None:
        fa, fb = all_findings(a), all_findings(b)
        ka = {(f.get("check"), f.get("code")) for f in fa}
        kb = {(f.get("check"), f.get("code")) for f in fb}
        rows = [[name_a, f"{f.get('check')}/{f.get('code')}", f.get("severity"), f.get("message")]
                for f in fa if (f.get("check"), f.get("code")) not in kb]
        rows += [[name_b, f"{f.get('check')}/{f.get('code')}", f.get("severity"), f.get("message")]
                 for f in fb if (f.get("check"), f.get("code")) not in ka]
        if not rows:
            doc.para(f"both runs have the same kinds of findings ({len(ka)} check/code pairs)", "ok")
        else:
            doc.table(["only in", "check/code", "severity", "message"], rows)

    for title, body in (("Runs", runs), ("Config differences", config), ("Environment differences", env),
                        ("Loss curves", curves), ("Findings in one run only", findings)):
        _section(doc, title, body)
    return doc


def compare(run_a: str | Path, run_b: str | Path, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``compare.html`` and ``compare.md`` into out_dir; returns their paths."""
    a, b = load_run(run_a), load_run(run_b)
    return build(a, b, f"A: {Path(run_a).name}", f"B: {Path(run_b).name}").write(out_dir, "compare")
