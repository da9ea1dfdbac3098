"""Incidents: the findings that share one cause, grouped, with the root cause first.

One NaN is seen by several checks (nan_triage reruns the step and names the module, grad_monitor
sees every gradient non-finite, loss_spike sees a non-finite loss, the report's advisor sees the
loss curve diverge) and, when the update is applied, again at every later step; one hang is seen
by several ranks. A person should read ONE line for it, naming where it arose. This module turns
finding records (``findings.jsonl`` dicts, every rank's) into incidents; the console's end-of-run
table, the verdict line and the report all read them from here. ``findings.jsonl`` keeps every
record: grouping is a view, never a filter on what is written.

Grouping (warnings and errors only; info findings are not incidents):

- a **cause** per finding (``cause_of``): ``nonfinite`` (NaN/Inf in loss or gradients, whichever
  check saw it), ``hang`` (a hang, a collective timeout or a dead rank, from any rank),
  ``ranks_differ`` (ranks composed different configs or seeds), ``updates_lost/<eps|clip|rounding|unknown>``
  (layers whose step is orders below what their optimizer should give: layer_health's ``layer_update_lost``), else the finding's own
  ``check/code`` (repeats of one finding collapse into one incident);
- the **root** of an incident: the finding that is not derived from others (the report's advisor
  rules read the same curves: never the root while a check's own finding exists), then the
  earliest step (setup first), then the check that localises the cause (nan_triage's rerun names the first
  module in forward order; grad_monitor only sees that every gradient went bad), then the module
  first in forward order (``details.forward_index``), then the origin rank;
- the **evidence**: every other finding of the incident, collapsed by ``check/code`` with a count,
  the steps and the ranks;
- a **consequence** (``_CONSEQUENCES``: parameters that did not learn, a layer whose updates are negligible, a clip
  that dominates the gradient norm) joins the incident of its cause when a finding of that cause falls in the steps
  it judged (and, where both list them, about a parameter in a layer the cause names): every update was skipped
  for non-finite gradients, or lost against the optimizer's step (an eps of 1, a clip orders below the norm: a
  clip that dominates joins a lost update of cause ``clip`` only), so nothing learned, and the advice to read is
  the cause's;
- the root prefers the finding that names the module or parameter (``details.module/layer/param``) among those
  of the earliest step: one planted NaN in a gradient hook is headed by grad_monitor's finding naming the
  parameter, not by a rerun that can only say "it arose in backward";
- a **diagnosis** (a finding whose ``details.explains`` lists causes: the advisor's ``lr_too_high`` reads the
  configured LR against its usual range and the curves the checks saw) takes those causes' findings into
  its own incident and is its root: the LR far too high is why the loss spiked, the gradients exploded and
  the loss went non-finite, and each of those checks stays one line of its evidence.

Ground floor: plain dicts in, plain data out; no torch, no rich (the renderers format).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["Evidence", "Incident", "cause_of", "group", "verdict"]

SEVERITY_RANK = {"error": 0, "warning": 1}

# (check, code) -> cause; codes a check emits only for non-finite values or hangs
_CAUSES: dict[tuple[str, str], str] = {
    ("nan_triage", "nan_reproducible"): "nonfinite", ("nan_triage", "nan_transient"): "nonfinite",
    ("nan_triage", "nan_step"): "nonfinite", ("grad_monitor", "nonfinite_grad"): "nonfinite",
    ("mixed_precision", "loss_scale_min"): "nonfinite", ("advisor", "mixed_precision_unstable"): "nonfinite",
    ("comm_debug", "hang"): "hang", ("liveness", "rank_died"): "hang", ("advisor", "nccl_timeout"): "hang",
    ("hang_watchdog", "hang"): "hang", ("hang_watchdog", "hang_detected"): "hang",
    # ranks that run different configs/seeds: consistency sees it at setup, replica_parity at its first check
    ("consistency", "config_mismatch"): "ranks_differ", ("consistency", "seed_mismatch"): "ranks_differ",
    ("replica_parity", "config_hash_mismatch"): "ranks_differ",
}
_LOST = "updates_lost"  # layer_health's layer_update_lost: updates_lost/<its cause> (eps, clip, rounding, unknown)
# who localises a cause best (lower = better root), per cause
_ROOT_ORDER: dict[str, tuple[str, ...]] = {
    "nonfinite": ("nan_triage", "grad_monitor", "mixed_precision", "loss_spike"),
    "hang": ("liveness", "comm_debug", "hang_watchdog"),
    "ranks_differ": ("consistency", "replica_parity"),
}
_TITLES = {"nonfinite": "non-finite values", "hang": "hang", "ranks_differ": "ranks run different configs",
           **{f"{_LOST}/{c}": f"updates far below the optimizer's step ({c})" for c in ("eps", "clip", "rounding",
                                                                                       "unknown")}}
_ROOT_TITLES = {"rank_died": "a rank died", "nccl_timeout": "collective timeout",  # by the root's code
                "lr_too_high": "learning rate far above its usual range"}
DERIVED_CHECKS = ("advisor",)  # report rules over curves and other findings: evidence, not a root
# (check, code) -> the causes whose incident it is a consequence of (the first that applies), when a finding of that
# cause falls in the steps it judged: parameters that "did not learn" over steps whose updates were skipped for
# non-finite gradients, or whose every step was lost (an eps of 1, a clip orders below the norm); a clip that
# dominates the gradient norm while the updates are lost is the same incident
_CONSEQUENCES: dict[tuple[str, str], tuple[str, ...]] = {
    ("freeze_verify", "not_updated"): ("nonfinite", f"{_LOST}/eps", f"{_LOST}/clip", f"{_LOST}/rounding",
                                       f"{_LOST}/unknown"),
    ("layer_health", "layer_update_negligible"): ("nonfinite",),
    ("grad_monitor", "clip_dominates"): (f"{_LOST}/clip",),
}


def _nonfinite_value(value: Any) -> bool:
    if isinstance(value, str):
        return value.lower() in ("nan", "inf", "-inf")
    return isinstance(value, float) and not math.isfinite(value)


def cause_of(record: dict[str, Any]) -> str:
    """The cause a finding belongs to: ``nonfinite``, ``hang`` or its own ``check/code``."""
    check, code = str(record.get("check")), str(record.get("code"))
    known = _CAUSES.get((check, code))
    if known:
        return known
    details = record.get("details") if isinstance(record.get("details"), dict) else {}
    message = str(record.get("message", ""))
    if check == "loss_spike" and (_nonfinite_value(details.get("loss")) or "non-finite" in message):
        return "nonfinite"
    if check == "advisor" and code == "loss_diverging" and "non-finite" in message:
        return "nonfinite"
    if (check, code) == ("layer_health", "layer_update_lost"):
        return f"{_LOST}/{details.get('cause') or 'unknown'}"
    return f"{check}/{code}"


@dataclass
class Evidence:
    """One ``check/code`` of an incident's other findings, its repeats collapsed."""
    check: str
    code: str
    severity: str
    count: int
    steps: list[int]
    ranks: list[int]
    message: str

    def text(self) -> str:
        steps = sorted(set(self.steps))
        where = "" if not steps else (f" step {steps[0]}" if len(steps) == 1 else f" steps {steps[0]}-{steps[-1]}")
        ranks = f", rank(s) {','.join(map(str, sorted(set(self.ranks))))}" if self.ranks else ""
        return f"{self.check}/{self.code} x{self.count}{where}{ranks}"


@dataclass
class Incident:
    cause: str
    severity: str
    root: dict[str, Any]
    evidence: list[Evidence] = field(default_factory=list)
    count: int = 1  # findings in the incident, root included

    @property
    def step(self) -> int | None:
        return self.root.get("step")

    @property
    def rank(self) -> int | None:
        return self.root.get("rank")

    @property
    def where(self) -> str | None:
        """Where it arose, as the root finding names it: a module, 'the loss', a layer or parameter."""
        details = self.root.get("details") if isinstance(self.root.get("details"), dict) else {}
        if details.get("module"):
            return str(details["module"])
        if details.get("arose_in") == "loss":
            return "the loss"
        for key in ("layer", "param", "parameter"):
            if details.get(key):
                return str(details[key])
        return None

    def title(self) -> str:
        """A few words: what, from which step, where, on which rank."""
        what = (_ROOT_TITLES.get(str(self.root.get("code"))) or _TITLES.get(self.cause)
                or f"{self.root.get('check')}/{self.root.get('code')}")
        text = what + (f" from step {self.step}" if self.step is not None and self.count > 1 else
                       f" at step {self.step}" if self.step is not None else " at setup")
        if self.where:
            text += f" in {self.where}"
        if self.rank is not None:
            text += f" on rank {self.rank}"
        return text

    def source(self) -> str:
        return f"{self.root.get('check')}/{self.root.get('code')}"

    def evidence_text(self) -> str:
        return "; ".join(e.text() for e in self.evidence)

    def sort_key(self) -> tuple:
        step = self.step
        return (SEVERITY_RANK.get(self.severity, 9), step if isinstance(step, int) else -1)


def _explains(record: dict[str, Any]) -> list[str]:
    """The causes a diagnosis accounts for (``details.explains``); [] for any other finding."""
    details = record.get("details") if isinstance(record.get("details"), dict) else {}
    explains = details.get("explains")
    return [str(c) for c in explains] if isinstance(explains, list) else []


def _locates(details: dict[str, Any]) -> bool:
    """Whether a finding names where its cause arose (a module, a layer or a parameter)."""
    return any(details.get(key) for key in ("module", "layer", "param", "parameter"))


def _window(record: dict[str, Any]) -> tuple[int, int] | None:
    """The steps a finding judged: ``details.steps`` steps up to its own step (freeze_verify's window)."""
    details = record.get("details") if isinstance(record.get("details"), dict) else {}
    step, steps = record.get("step"), details.get("steps")
    if not isinstance(step, int):
        return None
    return (step - steps if isinstance(steps, int) else 0, step)


def _related(consequence: dict[str, Any], cause: dict[str, Any]) -> bool:
    """Whether a consequence is about what its cause's finding names: some parameter it lists lies in a layer the
    cause lists (``details.params`` / ``details.layers``); true when either does not list them."""
    params = (consequence.get("details") or {}).get("params") if isinstance(consequence.get("details"), dict) else None
    layers = (cause.get("details") or {}).get("layers") if isinstance(cause.get("details"), dict) else None
    if not isinstance(params, list) or not isinstance(layers, list) or not params or not layers:
        return True
    return any(str(p) == str(la) or str(p).startswith(f"{la}.") for p in params for la in layers)


def _root_key(cause: str, record: dict[str, Any]) -> tuple:
    order = _ROOT_ORDER.get(cause, ())
    check = record.get("check")
    details = record.get("details") if isinstance(record.get("details"), dict) else {}
    step, rank = record.get("step"), record.get("rank")
    forward = details.get("forward_index")
    # no step: at setup, before every step -- except a hang's (ranks stuck at different steps)
    unknown = math.inf if cause == "hang" else -1
    return (not _explains(record),  # a diagnosis is the root of what it explains
            check in DERIVED_CHECKS,
            step if isinstance(step, int) else unknown,
            not _locates(details),  # the finding that names the module or parameter heads the incident
            order.index(check) if check in order else len(order),
            not details.get("module"),
            forward if isinstance(forward, int) else math.inf,
            rank if isinstance(rank, int) else math.inf,
            SEVERITY_RANK.get(record.get("severity"), 9),
            record.get("time") or 0.0)


def group(records: Iterable[dict[str, Any]]) -> list[Incident]:
    """Warnings and errors -> incidents, errors first, then by first step."""
    loud = [r for r in records if r.get("severity") in SEVERITY_RANK]
    absorbed: dict[str, str] = {}  # cause -> the diagnosis's cause that explains it (the first diagnosis wins)
    for record in loud:
        for cause in _explains(record):
            absorbed.setdefault(cause, cause_of(record))
    by_cause: dict[str, list[dict[str, Any]]] = {}
    for record in loud:
        own = cause_of(record)
        by_cause.setdefault(own if _explains(record) else absorbed.get(own, own), []).append(record)
    for key, causes in _CONSEQUENCES.items():  # a consequence joins its cause's incident, under its cause's advice
        own = f"{key[0]}/{key[1]}"
        for cause in causes:
            target = absorbed.get(cause, cause)
            roots = [r for r in by_cause.get(target, []) if cause_of(r) == cause]
            for record in list(by_cause.get(own, [])):
                window = _window(record)
                if window and any(isinstance(r.get("step"), int) and window[0] <= r["step"] <= window[1]
                                  and _related(record, r) for r in roots):
                    by_cause[own].remove(record)
                    by_cause[target].append(record)
        if not by_cause.get(own, True):
            del by_cause[own]
    incidents = []
    for cause, members in by_cause.items():
        ordered = sorted(members, key=lambda r: _root_key(cause, r))
        root, rest = ordered[0], ordered[1:]
        collapsed: dict[tuple[str, str], Evidence] = {}
        for r in rest:
            key = (str(r.get("check")), str(r.get("code")))
            e = collapsed.get(key)
            if e is None:
                e = collapsed[key] = Evidence(key[0], key[1], str(r.get("severity")), 0, [], [], str(r.get("message")))
            e.count += 1
            if isinstance(r.get("step"), int):
                e.steps.append(r["step"])
            if isinstance(r.get("rank"), int):
                e.ranks.append(r["rank"])
            if SEVERITY_RANK.get(r.get("severity"), 9) < SEVERITY_RANK.get(e.severity, 9):
                e.severity = str(r.get("severity"))
        severity = min((str(r.get("severity")) for r in members), key=lambda s: SEVERITY_RANK.get(s, 9))
        incidents.append(Incident(cause, severity, root, list(collapsed.values()), len(members)))
    return sorted(incidents, key=Incident.sort_key)


def verdict(records: list[dict[str, Any]], report: str | None = None, status: str | None = None) -> str:
    """The one line a run ends with (and the report opens with): healthy, or N incidents and the
    worst in a few words; the report path last. A run that did not complete (``status``) is never
    called healthy."""
    incidents = group(records)
    info = sum(1 for r in records if r.get("severity") not in SEVERITY_RANK)
    ended = "" if status in (None, "completed") else f"{status}; "
    if not incidents:
        text = (f"healthy: no warning or error ({info} info finding(s) in the report)" if not ended else
                f"{ended}no check reported a warning or error")
    else:
        errors = sum(1 for i in incidents if i.severity == "error")
        counts = ", ".join(f"{n} {s}{'s' if n > 1 else ''}" for s, n in (("error", errors),
                                                                         ("warning", len(incidents) - errors)) if n)
        worst = incidents[0]
        more = f", {worst.count - 1} related finding(s)" if worst.count > 1 else ""
        text = (f"{ended}{len(incidents)} incident{'s' if len(incidents) > 1 else ''} ({counts}); worst: "
                f"{worst.title()} [{worst.source()}{more}]")
    return f"verdict: {text}" + (f"; report: {report}" if report else "")
