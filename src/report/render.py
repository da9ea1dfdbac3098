"""`write_report(run_dir)`: ``report.html`` (self-contained) and ``report.md`` (+ ``report_files/``).

Sections: run summary, findings by severity (the run's own and the advisor rules'), figures,
profiler top ops, environment across ranks (mismatches highlighted), resolved config. A run that
crashed leaves partial files: each section is built on its own and a section that fails says so
in the report instead of taking the report down.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from dsdebug.report import plots, rules
from dsdebug.report.doc import Document
from dsdebug.findings.ranks import name_ranks
from dsdebug.report.load import RunData, load_run, read_overrides, read_ranks, read_repro, read_top_ops

__all__ = ["CHECK_CLASSES", "PRESET_CLASSES", "SECTIONS", "SEVERITY_ORDER", "TOP_OPS_ROWS", "all_findings", "build",
           "command", "findings_source", "flatten", "in_plain_words", "last_value", "moe_line", "ranks_fields",
           "write_report"]

log = logging.getLogger(__name__)

SEVERITY_ORDER = ("error", "warning", "info")
_REPRO_SKIP = {"rank", "rng_state_file"}  # differ by design
TOP_OPS_ROWS = 15


def command(run: RunData) -> str:
    """What was run: metrics.json's ``command`` (rank 0's argv, a plain Lightning run), else dsdebug-train's
    overrides (``.hydra/overrides.yaml``)."""
    if isinstance(run.metrics.get("command"), str):
        return run.metrics["command"]
    if run.plain:
        return "unknown (a plain Lightning run that left no metrics.json)"
    overrides = read_overrides(run.path)
    if overrides is None:
        return "unknown (no .hydra/overrides.yaml)"
    return " ".join(["python train.py", *overrides])


def all_findings(run: RunData) -> list[dict[str, Any]]:
    """The run's findings plus the advisor rules' that the run did not record already."""
    seen = {(f.get("check"), f.get("code")) for f in run.findings}
    try:
        extra = [f for f in rules.evaluate(run) if (f["check"], f["code"]) not in seen]
    except Exception:  # noqa: BLE001 - rules over a partial run must not hide the rest
        log.warning("report: advisor rules failed", exc_info=True)
        extra = []
    found = list(run.findings) + extra
    return [in_plain_words(f) for f in found] if run.plain else found


# dsdebug-train's debug= presets -> the callback a plain Lightning project adds instead (conf/debug/*.yaml)
PRESET_CLASSES = {"data": "DataInspector()", "grads": "GradMonitor()", "comm": "CommDebug()", "logs": "LogSync()",
                  "profile": "Profiler()", "repro": "Reproducibility()", "freeze": "FreezeVerify()",
                  "light": "the dsdebug checks", "full": "every dsdebug check"}


# conf/callbacks/<name>.yaml -> the class (src/callbacks/__init__.py's table; the report layer cannot import it)
CHECK_CLASSES = {"reproducibility": "Reproducibility", "comm_debug": "CommDebug", "grad_monitor": "GradMonitor",
                 "data_inspector": "DataInspector", "profiler": "Profiler", "freeze_verify": "FreezeVerify",
                 "grad_checkpointing": "GradCheckpointing", "log_sync": "LogSync", "replica_parity": "ReplicaParity",
                 "loss_spike": "LossSpike", "layer_health": "LayerHealth", "moe_router": "MoERouter",
                 "memory": "MemoryMonitor", "throughput": "Throughput", "mixed_precision": "MixedPrecisionCheck",
                 "nan_triage": "NaNTriage", "grad_scale": "GradScaleCheck", "consistency": "ConsistencyCheck",
                 "outcome_monitor": "OutcomeMonitor", "model_graph": "ModelGraph", "preflight": "Preflight",
                 "packing": "PackingCheck", "train_mode": "TrainMode", "optimizer_coverage": "OptimizerCoverage",
                 "weight_norm": "WeightNorm"}


def in_plain_words(finding: dict[str, Any]) -> dict[str, Any]:
    """A finding of a plain Lightning run with ``debug=<preset>`` or ``+callbacks=<check>`` in its text said
    as the callback to add (``debug=data`` -> ``DataInspector()``): both exist only under dsdebug-train."""
    def say(text: Any) -> Any:
        if not isinstance(text, str) or ("debug=" not in text and "+callbacks=" not in text):
            return text
        text = re.sub(r"\bdebug=(\w+)", lambda m: PRESET_CLASSES.get(m.group(1), m.group(0)), text)
        return re.sub(r"\+callbacks=(\w+)", lambda m: f"{CHECK_CLASSES[m.group(1)]}()" if m.group(1) in CHECK_CLASSES
                      else m.group(0), text)

    return {**finding, "message": say(finding.get("message")), "advice": say(finding.get("advice"))}


def last_value(run: RunData, key: str) -> float | None:
    """metrics.json's value, else the last one in history.jsonl. val/loss at step 0 is the sanity
    check (val/loss_at_start), not a final val/loss: a run that validated only then has none."""
    if isinstance(run.metrics.get(key), (int, float)):
        return float(run.metrics[key])
    if key == "val/loss_at_start":
        first = run.history.get("val/loss", [])[:1]
        return first[0][1] if first and first[0][0] == 0 else None
    points = run.history.get(key, [])
    if key == "val/loss" and points and points[0][0] == 0:
        points = points[1:]  # the sanity check's row (the module logs it at step 0)
    return points[-1][1] if points else None


def moe_line(run: RunData) -> str | None:
    """'2 MoE layers (L1, L3) x 8 experts, top-2; aux loss: the model's own x 0.001', from metrics.json."""
    moe = run.metrics.get("moe")
    if not isinstance(moe, dict) or (not moe.get("layers") and moe.get("aux_source") is None):
        return None
    layers = moe.get("layers") or []
    text = (f"{len(layers)} MoE layer(s) ({', '.join(f'L{i}' for i in layers)}) x {moe.get('experts')} experts, "
            f"top-{moe.get('top_k')}" if layers else "routers not recognised")
    source = {"model": "the model's own", "project": "the project's"}.get(moe.get("aux_source"), "none")
    coef = moe.get("aux_coef")
    return f"{text}; aux loss: {source}" + (f" x {coef:g}" if isinstance(coef, (int, float)) else "") + \
        ("" if moe.get("metrics") else "; moe/* metrics off")


def _summary(doc: Document, run: RunData) -> None:
    m = run.metrics
    steps = m.get("global_step")
    if steps is None:
        logged = [s for points in run.history.values() for s, _ in points]
        steps = f"{max(logged)} (last logged; no metrics.json)" if logged else "unknown"
    strategy = m.get("strategy") or run.cfg("strategy._target_") or "unknown"
    stage = m.get("zero_stage", run.cfg("strategy.stage"))
    world = m.get("world_size")
    if world is None:
        devices, nodes = run.cfg("trainer.devices"), run.cfg("trainer.num_nodes", 1)
        world = f"{devices} x {nodes} node(s) (configured)" if devices is not None else "unknown"
    status = run.status
    pairs = [("command", command(run)), ("run dir", str(run.path)),
             ("status", status if status in ("completed", "preempted") else f"!{status}"),
             ("strategy", f"{strategy}" + (f" (ZeRO stage {stage})" if stage is not None else "")),
             ("world size", world), ("precision", m.get("precision") or run.cfg("trainer.precision") or "unknown"),
             ("steps", steps), ("time", f"{m['time_s']} s" if m.get("time_s") is not None else "unknown")]
    for key in ("train/loss", "val/loss", "val/loss_at_start"):
        value = last_value(run, key)
        if value is not None:
            pairs.append((key, f"{value:.4f}"))
    if moe_line(run):
        pairs.append(("MoE", moe_line(run)))
    pairs += ranks_fields(run)
    if m.get("error") and run.crash is None:  # a plain Lightning run that raised (report/run_record.py)
        pairs.append(("error", f"!{m['error']}"))
    if run.crash is not None:
        pairs.append(("exit code", f"!{run.crash.get('exit_code')}"))
        pairs.append(("error", f"!{run.crash.get('error') or run.crash.get('exception') or 'unknown'}"))
    doc.fields(pairs)
    tail = (run.crash or {}).get("traceback_tail")
    if tail:
        doc.details("traceback (tail)", tail if isinstance(tail, str) else "\n".join(map(str, tail)))


def ranks_fields(run: RunData) -> list[tuple[str, str]]:
    """Which ranks this run dir heard from (their findings and per-rank files are here) and which not."""
    world, heard = read_ranks(run.path)
    if world is None and not heard:
        return []
    everyone = {int(e["rank"]): e for e in (world or {}).get("ranks", []) if isinstance(e, dict) and "rank" in e}
    size = int((world or {}).get("world_size") or max((int(m.get("world_size") or 0) for m in heard.values()),
                                                      default=len(heard)))
    hosts = {r: str(e.get("host", "?")) for r, e in everyone.items()} | {r: str(m.get("host", "?"))
                                                                         for r, m in heard.items()}
    merged = sorted(r for r, e in everyone.items() if e.get("collected"))
    text = f"{len(heard)} of {size}: {name_ranks(heard, hosts)}" if heard else f"none of {size}"
    if merged:
        text += f"; {name_ranks(merged)} collected through the process group (node-local run dir)"
    missing = sorted(set(range(size)) - set(heard))
    if size <= 1 and not missing:
        return []  # a 1-process run: nothing to say
    fields = [("ranks heard from", text)]
    if missing:
        where = sorted({f"{everyone[r].get('host')}:{everyone[r].get('run_dir')}" for r in missing if r in everyone})
        fields.append(("ranks not heard from", f"!{name_ranks(missing, hosts)}: their findings and files are not in "
                       "this run dir (the run ended before they were collected)"
                       + (f"; look in {', '.join(where[:4])}" if where else "")))
    return fields


def findings_source(run: RunData) -> tuple[str, bool]:
    """Where the findings were looked for and read, and whether any findings file was read."""
    files = run.findings_files
    if not files:
        return (f"no findings file: none named findings.jsonl in {run.path} or any folder below it, so nothing "
                "here says whether the checks found anything (were checks in the run? is this the run's dir?)"), False
    shown = [str(p.relative_to(run.path)) if p.is_relative_to(run.path) else str(p) for p in files]
    if len(files) == 1:
        return f"read {shown[0]} (searched {run.path} and every folder below it)", True
    return (f"{len(files)} findings files merged (one per fit or logger folder; each row's source names its folder): "
            f"{', '.join(shown)}"), True


def _source(run: RunData, finding: dict[str, Any]) -> str:
    source = finding.get("source")
    if not source:
        return "advisor" if finding.get("check") == rules.CHECK else ""
    path = Path(source)
    return str(path.relative_to(run.path)) if path.is_relative_to(run.path) else source


def _findings(doc: Document, run: RunData) -> None:
    found = all_findings(run)
    where, read = findings_source(run)
    if not read:  # never an all-clear that no file backs
        doc.para(where, "bad")
    else:
        doc.note(where)
    if not found:
        if read:
            enable = ("add more checks to the Trainer's callbacks (dsdebug.callbacks)" if run.plain
                      else "debug=light or debug=full enables more checks")
            doc.note(f"no findings: no check reported anything ({enable})")
        return
    counts = {s: sum(1 for f in found if f.get("severity") == s) for s in SEVERITY_ORDER}
    doc.para(", ".join(f"{n} {s}" for s, n in counts.items()))
    _incidents(doc, found)
    groups = [(s, [f for f in found if f.get("severity") == s]) for s in SEVERITY_ORDER]
    groups.append(("other", [f for f in found if f.get("severity") not in SEVERITY_ORDER]))
    doc.fold(f"every finding ({len(found)}), by severity")  # the incidents above are the view; these the records
    for severity, group in groups:
        if not group:
            continue
        doc.heading(f"{severity} ({len(group)})", 3)
        several = len(run.findings_files) > 1
        rows = [[f"{f.get('check')}/{f.get('code')}", f.get("step"),
                 "all" if f.get("rank") is None else f.get("rank"), f.get("message"), f.get("advice")]
                + ([_source(run, f)] if several else []) for f in group]
        doc.table(["check/code", "step", "rank", "message", "advice"] + (["source"] if several else []), rows,
                  [severity] * len(rows))
    doc.unfold()


def _figures(doc: Document, run: RunData) -> None:
    for name, (title, figure, hint) in plots.FIGURES.items():
        doc.heading(title, 3)
        try:
            png = figure(run)
        except Exception as exc:  # noqa: BLE001 - odd data in one series must not cost the others
            log.warning("report: figure %s failed", name, exc_info=True)
            doc.note(f"could not draw: {type(exc).__name__}: {exc}")
            continue
        if png is None:
            doc.note(f"not recorded: {hint(run) if callable(hint) else hint}")
        else:
            doc.image(name, title, png)


def _first(read: Any, run: RunData) -> Any:
    """What ``read`` finds in the first of the run's artifact dirs that has it (plain runs: default_root_dir)."""
    for folder in run.artifact_dirs():
        found = read(folder)
        if found:
            return found
    return read(run.path)


def _top_ops(doc: Document, run: RunData) -> None:
    tables = _first(read_top_ops, run)
    if not tables:
        doc.note(f"not recorded: {plots.how_to_enable(run, 'profile', 'profiler', 'Profiler', 'top-ops tables')}")
        return
    for stem, record in tables.items():
        rows = [r for r in record["rows"] if isinstance(r, dict)][:TOP_OPS_ROWS]
        doc.heading(f"{stem} (sorted by {record.get('sort_by', '?')})", 3)
        headers = list(dict.fromkeys(k for r in rows for k in r))
        doc.table(headers, [[r.get(h) for h in headers] for r in rows])


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: node}


def _env(doc: Document, run: RunData) -> None:
    repro = _first(read_repro, run)
    if not repro:
        doc.note(f"not recorded: {plots.how_to_enable(run, 'repro', 'reproducibility', 'Reproducibility', 'repro/rank<r>.json')}"
                 + ("" if run.plain else " (reproducibility writes repro/rank<r>.json)"))
        return
    ranks = sorted(repro)
    flat = {r: {k: v for k, v in flatten(repro[r]).items() if k not in _REPRO_SKIP} for r in ranks}
    keys = sorted(set().union(*(set(f) for f in flat.values())))
    rows, classes, mismatched = [], [], []
    for key in keys:
        values = [flat[r].get(key, "(absent)") for r in ranks]
        differ = len({repr(v) for v in values}) > 1
        if differ:
            mismatched.append(key)
        rows.append([key, *values])
        classes.append("mismatch" if differ else "")
    if len(ranks) > 1:
        doc.para(f"{len(ranks)} ranks; " + (f"differ in: {', '.join(mismatched)}" if mismatched
                                             else "identical on every rank"), "bad" if mismatched else "ok")
    doc.table(["key", *(f"rank {r}" for r in ranks)], rows, classes)


def _config(doc: Document, run: RunData) -> None:
    path = Path(run.path) / "config_resolved.yaml"
    if not path.is_file() and run.plain:  # dsdebug composes no config here; a Hydra app's own is shown
        hydra_cfg = Path(run.path) / ".hydra" / "config.yaml"
        if hydra_cfg.is_file():
            doc.details(".hydra/config.yaml (the project's own Hydra config)", hydra_cfg.read_text(errors="replace"))
        else:
            doc.note("none: a plain Lightning run has no config_resolved.yaml (dsdebug-train writes it); "
                     "the Trainer's hyperparameters are with its logger (e.g. hparams.yaml)")
        return
    if not path.is_file():
        doc.note("not recorded: config_resolved.yaml is missing (the run stopped before composing it)")
        return
    doc.details("config_resolved.yaml", path.read_text(errors="replace"))


def _model_graph(doc: Document, run: RunData) -> None:
    svg = _first(lambda folder: _read_text(Path(folder) / "model_graph" / "model_graph.svg"), run)
    if not svg:
        hint = "ModelGraph() in the Trainer's callbacks" if run.plain else "+callbacks=model_graph"
        doc.note(f"no module tree in this run (opt-in: {hint} draws it, with parameters, trainable/frozen, ZeRO-3)")
        return
    doc.svg("model_graph", "module tree", svg)


def _read_text(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


SECTIONS = [("Run summary", _summary), ("Findings", _findings), ("Figures", _figures), ("Model", _model_graph),
            ("Profiler: top ops", _top_ops), ("Environment across ranks", _env), ("Resolved config", _config)]


def _banner(doc: Document, run: RunData) -> None:
    """The verdict the run's console ended with (findings/incidents.py), first thing in the report."""
    from dsdebug.findings.incidents import verdict

    read = bool(getattr(run, "findings_files", None)) or (Path(run.path) / "findings.jsonl").is_file()
    found = all_findings(run)
    if not read and not run.findings:
        doc.para("verdict: not known: no findings file was read (see Findings)", "bad")
        return
    text = verdict(found, status=None if run.status == "unknown" else run.status)
    doc.para(text, "ok" if text.startswith("verdict: healthy") else "bad")


def _incidents(doc: Document, found: list[dict[str, Any]]) -> None:
    """Warnings and errors grouped by cause: one row per incident, its root cause first, the other
    findings as evidence with counts (every finding is still in the tables below and findings.jsonl)."""
    from dsdebug.findings.incidents import group

    incidents = group(found)
    if not incidents:
        return
    doc.heading(f"incidents ({len(incidents)}): root cause first", 3)
    rows = [[i.title(), i.source(), i.step, "all" if i.rank is None else i.rank, i.root.get("message"),
             i.root.get("advice"), i.evidence_text() or "-"] for i in incidents]
    doc.table(["incident", "root finding", "step", "rank", "message", "advice", "also seen as"], rows,
              [i.severity for i in incidents])


def build(run: RunData) -> Document:
    doc = Document(f"Run report: {Path(run.path).name}")
    try:
        _banner(doc, run)
    except Exception:  # noqa: BLE001 - the sections below still say what is known
        log.warning("report: verdict failed", exc_info=True)
    for title, section in SECTIONS:
        doc.heading(title)
        try:
            section(doc, run)
        except Exception as exc:  # noqa: BLE001 - a partial run dir still gets every other section
            log.warning("report: section %r failed", title, exc_info=True)
            doc.note(f"this section could not be built: {type(exc).__name__}: {exc}")
    return doc


def write_report(run_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` into the run dir; returns their paths."""
    run_dir = Path(run_dir)
    try:
        run = load_run(run_dir)
    except Exception:  # noqa: BLE001
        log.warning("report: could not read %s", run_dir, exc_info=True)
        run = RunData(path=run_dir)
    return build(run).write(run_dir, "report")
