"""Rules for a check's arguments: what a value must be, and how to say so in the one-line error.

A rule is ``(test, valid)``: ``test(value) -> bool`` and the text that ends the error
``callbacks.<name>.<key>=<value> is invalid; valid: <valid>``. ``DebugCallback.check_args``
applies them::

    self.check_args(every_n_steps=(every_n_steps, integer(0, note="0 = off")),
                    ema_beta=(ema_beta, number(0, 1, open_low=True, open_high=True)),
                    policy=(policy, one_of("warn", "skip")))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any, Callable

__all__ = ["Rule", "boolean", "either", "integer", "is_int", "is_number", "number", "one_of", "optional", "seconds",
           "string", "strings", "subset_of"]

Rule = tuple[Callable[[Any], bool], str]


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


def integer(low: int | None = None, high: int | None = None, note: str = "") -> Rule:
    """An int (not a bool) in ``[low, high]``."""
    return (lambda v: is_int(v) and _within(v, low, high, False, False),
            _noted(_bounds("an int", low, high, False, False), note))


def number(low: float | None = None, high: float | None = None, open_low: bool = False, open_high: bool = False,
           note: str = "", finite: bool = True) -> Rule:
    """An int or float (not a bool, not NaN; not +-inf unless ``finite=False``) between ``low`` and ``high``
    (closed unless ``open_*``)."""
    return (lambda v: is_number(v) and (not finite or math.isfinite(v)) and _within(v, low, high, open_low, open_high),
            _noted(_bounds("a number", low, high, open_low, open_high), note))


def seconds(note: str = "0 = off") -> Rule:
    """null or a number of seconds >= 0."""
    return (lambda v: v is None or (is_number(v) and v >= 0), f"null or seconds >= 0 ({note})")


def boolean() -> Rule:
    return (lambda v: isinstance(v, bool), "true, false")


def one_of(*choices: Any, any_case: bool = False, note: str = "") -> Rule:
    """One of ``choices``; with ``any_case`` a value matches whatever its case (``info`` for ``INFO``)."""
    def test(v: Any) -> bool:
        return (str(v).upper() if any_case and v is not None else v) in choices

    return (test, _noted(", ".join("null" if c is None else str(c) for c in choices), note))


def string(valid: str) -> Rule:
    """A string; ``valid`` says which (``"latest, or a run dir"``)."""
    return (lambda v: isinstance(v, str), valid)


def strings(valid: str = "a list of strings") -> Rule:
    """A list (or tuple) of strings, not a single string."""
    return (lambda v: not isinstance(v, (str, bytes, Mapping)) and hasattr(v, "__iter__")
            and all(isinstance(p, str) for p in v), valid)


def subset_of(*choices: str) -> Rule:
    """A list (or tuple) of strings, each one of ``choices`` (empty: none)."""
    return (lambda v: not isinstance(v, (str, bytes, Mapping)) and hasattr(v, "__iter__")
            and all(isinstance(p, str) and p in choices for p in v), f"a list of: {', '.join(choices)}")


def optional(rule: Rule, note: str = "") -> Rule:
    """null, or what ``rule`` accepts."""
    test, valid = rule
    return (lambda v: v is None or test(v), f"null{' (' + note + ')' if note else ''} or {valid}")


def either(*rules: Rule, valid: str = "") -> Rule:
    """What any of ``rules`` accepts (``either(integer(1), integer(-1, -1), valid="an int >= 1, or -1 = off")``);
    ``valid`` replaces the joined texts."""
    return (lambda v: any(test(v) for test, _ in rules), valid or ", or ".join(text for _, text in rules))
