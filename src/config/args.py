"""Rules for a check's arguments: what a value must be, and how to say so in the one-line error.

A rule is a :class:`Rule`: ``rule.test(value) -> bool`` and ``rule.valid``, the text that ends the error
``callbacks.<name>.<key>=<value> is invalid; valid: <valid>``. A rule is data (its kind and arguments),
so it can be declared on a check's class and written to the table that the config layer reads
without importing the check (``config/check_args.json``, config/callback_args.py)::

    class GradMonitor(DebugCallback):
        arg_rules = {"every_n_steps": integer(0, note="0 = off"),
                     "ema_beta": number(0, 1, open_low=True, open_high=True)}

        def __init__(self, every_n_steps=1, ema_beta=0.9, ...):
            self.check_declared(every_n_steps=every_n_steps, ema_beta=ema_beta)

A rule that depends on another argument's value (``streak_error >= streak_warn``) is not declared:
``__init__`` checks it with ``self.check_args(key=(value, rule))``, when the check is built.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable

__all__ = ["Rule", "boolean", "either", "integer", "is_int", "is_number", "number", "one_of", "optional", "seconds",
           "string", "strings", "subset_of"]


@dataclass(frozen=True)
class Rule:
    """One argument rule: ``kind`` names a builder below, ``args``/``kwargs`` its arguments (plain values, or
    rules for ``optional``/``either``)."""

    kind: str
    args: tuple = ()
    kwargs: tuple = ()  # (name, value) pairs

    @functools.cached_property
    def _built(self) -> tuple[Callable[[Any], bool], str]:
        return _BUILDERS[self.kind](*self.args, **dict(self.kwargs))

    @property
    def test(self) -> Callable[[Any], bool]:
        return self._built[0]

    @property
    def valid(self) -> str:
        return self._built[1]

    def __iter__(self):  # test, valid = rule
        return iter(self._built)

    def to_data(self) -> dict[str, Any]:
        """JSON-ready: ``{"rule": kind, "args": [...], "kwargs": {...}}``, nested rules likewise."""
        return {"rule": self.kind, "args": [_to_data(a) for a in self.args],
                "kwargs": {k: _to_data(v) for k, v in self.kwargs}}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Rule:
        if data.get("rule") not in _BUILDERS:
            raise ValueError(f"unknown argument rule {data.get('rule')!r}; valid: {', '.join(_BUILDERS)}")
        return cls(data["rule"], tuple(_from_data(a) for a in data.get("args", ())),
                   tuple((k, _from_data(v)) for k, v in data.get("kwargs", {}).items()))


def _to_data(value: Any) -> Any:
    return value.to_data() if isinstance(value, Rule) else list(value) if isinstance(value, tuple) else value


def _from_data(value: Any) -> Any:
    return Rule.from_data(value) if isinstance(value, dict) and "rule" in value else value


def _rule(kind: str, *args: Any, **kwargs: Any) -> Rule:
    return Rule(kind, args, tuple(sorted(kwargs.items())))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and value == value  # NaN is no number


def _bounds(kind: str, low: float | None, high: float | None, open_low: bool, open_high: bool) -> str:
    if low is not None and high is not None:
        return f"{kind} in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    if low is not None:
        return f"{kind} {'>' if open_low else '>='} {low}"
    if high is not None:
        return f"{kind} {'<' if open_high else '<='} {high}"
    return kind


def _within(value: Any, low: float | None, high: float | None, open_low: bool, open_high: bool) -> bool:
    if low is not None and (value <= low if open_low else value < low):
        return False
    return high is None or (value < high if open_high else value <= high)


def _noted(text: str, note: str) -> str:
    return f"{text} ({note})" if note else text


def _integer(low: int | None = None, high: int | None = None, note: str = "") -> _Built:
    """An int (not a bool) in ``[low, high]``."""
    return (lambda v: is_int(v) and _within(v, low, high, False, False),
            _noted(_bounds("an int", low, high, False, False), note))


def _number(low: float | None = None, high: float | None = None, open_low: bool = False, open_high: bool = False,
           note: str = "", finite: bool = True) -> _Built:
    """An int or float (not a bool, not NaN; not +-inf unless ``finite=False``) between ``low`` and ``high``
    (closed unless ``open_*``)."""
    return (lambda v: is_number(v) and (not finite or math.isfinite(v)) and _within(v, low, high, open_low, open_high),
            _noted(_bounds("a number", low, high, open_low, open_high), note))


def _seconds(note: str = "0 = off") -> _Built:
    """null or a number of seconds >= 0."""
    return (lambda v: v is None or (is_number(v) and v >= 0), f"null or seconds >= 0 ({note})")


def _boolean() -> _Built:
    return (lambda v: isinstance(v, bool), "true, false")


def _one_of(*choices: Any, any_case: bool = False, note: str = "") -> _Built:
    """One of ``choices``; with ``any_case`` a value matches whatever its case (``info`` for ``INFO``)."""
    def test(v: Any) -> bool:
        return (str(v).upper() if any_case and v is not None else v) in choices

    return (test, _noted(", ".join("null" if c is None else str(c) for c in choices), note))


def _string(valid: str) -> _Built:
    """A string; ``valid`` says which (``"latest, or a run dir"``)."""
    return (lambda v: isinstance(v, str), valid)


def _strings(valid: str = "a list of strings") -> _Built:
    """A list (or tuple) of strings, not a single string."""
    return (lambda v: not isinstance(v, (str, bytes, Mapping)) and hasattr(v, "__iter__")
            and all(isinstance(p, str) for p in v), valid)


def _subset_of(*choices: str) -> _Built:
    """A list (or tuple) of strings, each one of ``choices`` (empty: none)."""
    return (lambda v: not isinstance(v, (str, bytes, Mapping)) and hasattr(v, "__iter__")
            and all(isinstance(p, str) and p in choices for p in v), f"a list of: {', '.join(choices)}")


def _optional(rule: Rule, note: str = "") -> _Built:
    """null, or what ``rule`` accepts."""
    test, valid = rule
    return (lambda v: v is None or test(v), f"null{' (' + note + ')' if note else ''} or {valid}")


def _either(*rules: Rule, valid: str = "") -> _Built:
    """What any of ``rules`` accepts (``either(integer(1), integer(-1, -1), valid="an int >= 1, or -1 = off")``);
    ``valid`` replaces the joined texts."""
    return (lambda v: any(test(v) for test, _ in rules), valid or ", or ".join(text for _, text in rules))


_BUILDERS: dict[str, Callable[..., _Built]] = {
    "integer": _integer, "number": _number, "seconds": _seconds, "boolean": _boolean, "one_of": _one_of,
    "string": _string, "strings": _strings, "subset_of": _subset_of, "optional": _optional, "either": _either}


def integer(low: int | None = None, high: int | None = None, note: str = "") -> Rule:
    """An int (not a bool) in ``[low, high]``."""
    return _rule("integer", low, high, note=note)


def number(low: float | None = None, high: float | None = None, open_low: bool = False, open_high: bool = False,
           note: str = "", finite: bool = True) -> Rule:
    """An int or float (not a bool, not NaN; not +-inf unless ``finite=False``) between ``low`` and ``high``
    (closed unless ``open_*``)."""
    return _rule("number", low, high, open_low=open_low, open_high=open_high, note=note, finite=finite)


def seconds(note: str = "0 = off") -> Rule:
    """null or a number of seconds >= 0."""
    return _rule("seconds", note=note)


def boolean() -> Rule:
    return _rule("boolean")


def one_of(*choices: Any, any_case: bool = False, note: str = "") -> Rule:
    """One of ``choices``; with ``any_case`` a value matches whatever its case (``info`` for ``INFO``)."""
    return _rule("one_of", *choices, any_case=any_case, note=note)


def string(valid: str) -> Rule:
    """A string; ``valid`` says which (``"latest, or a run dir"``)."""
    return _rule("string", valid)


def strings(valid: str = "a list of strings") -> Rule:
    """A list (or tuple) of strings, not a single string."""
    return _rule("strings", valid)


def subset_of(*choices: str) -> Rule:
    """A list (or tuple) of strings, each one of ``choices`` (empty: none)."""
    return _rule("subset_of", *choices)


def optional(rule: Rule, note: str = "") -> Rule:
    """null, or what ``rule`` accepts."""
    return _rule("optional", rule, note=note)


def either(*rules: Rule, valid: str = "") -> Rule:
    """What any of ``rules`` accepts (``either(integer(1), integer(-1, -1), valid="an int >= 1, or -1 = off")``);
    ``valid`` replaces the joined texts."""
    return _rule("either", *rules, valid=valid)
