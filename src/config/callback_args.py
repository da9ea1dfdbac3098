"""A check's arguments, checked from the config before torch is imported.

Each check validates its arguments in ``__init__`` with ``self.check_args(key=(value, rule), ...)``
(rules: ``config/args.py``). Instantiating a check imports its module, and with it torch and
Lightning (~10 s), so ``callbacks.grad_monitor.every_n_steps=-1`` would only fail then. Here the
same ``check_args`` calls are read from the check's source (located without importing it, as
``config/targets.py`` does) and applied to the composed values: the same rules, the same one-line
error, in well under a second. There is no second copy of any rule to keep in step.

Read: the ``check_args`` calls at the top level of the class's own ``__init__`` (a call inside an
``if`` depends on other values and is left to ``__init__``); a value expression that is an argument
name or a simple expression of arguments (``str(x).upper()``); a rule expression built from the
rule functions and the module's literal constants. Anything else is skipped here and checked when
the check is built. Unknown keys (``+callbacks.grad_monitor.bogus=1``) are refused with the valid
ones, for a class whose ``__init__`` takes no ``**kwargs``.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from dsdebug.config import args as rules
from dsdebug.config.targets import _find_spec
from dsdebug.errors import ConfigError

__all__ = ["check_callback_args"]

_SAFE_BUILTINS = {"str": str, "int": int, "float": float, "bool": bool, "len": len, "tuple": tuple, "list": list,
                  "isinstance": isinstance, "abs": abs, "min": min, "max": max, "all": all, "any": any}
_RULES = {name: getattr(rules, name) for name in rules.__all__}
_MISSING = object()


def check_callback_args(cfg: DictConfig) -> None:
    """Every ``callbacks.<name>`` with a readable ``_target_`` class: unknown keys and the values its
    ``check_args`` refuses are a ConfigError, the same line ``__init__`` would raise."""
    group = cfg.get("callbacks")
    if not isinstance(group, DictConfig):
        return
    for key, conf in group.items():
        if not isinstance(conf, DictConfig) or not isinstance(conf.get("_target_"), str):
            continue
        spec = _init_spec(conf._target_)
        if spec is None:
            continue
        params, calls, constants, name, attrs = spec
        given = {k: _value(conf, k) for k in conf if not str(k).startswith("_")}
        if params is not None:
            unknown = [k for k in given if k not in params]
            if unknown:
                raise ConfigError(f"callbacks.{key}.{unknown[0]} is not an option of {conf._target_}; "
                                  f"valid: {', '.join(params)}")
        values = {**{p: d for p, d in (params or {}).items() if d is not _MISSING}, **given}
        for arg, value_expr, rule_expr in calls:
            value = _evaluate(value_expr, {**_SAFE_BUILTINS, **values})
            rule = _evaluate(rule_expr, {**_SAFE_BUILTINS, **constants, **_RULES, "self": SimpleNamespace(**attrs)})
            if value is _MISSING or rule is _MISSING or not _is_rule(rule):
                continue
            test, valid = rule
            if not test(value):
                raise ConfigError(f"callbacks.{name or key}.{arg}={value!r} is invalid; valid: {valid}")


def _value(conf: DictConfig, key: str) -> Any:
    try:
        value = conf[key]
    except Exception:  # noqa: BLE001 - an interpolation only Hydra resolves: left to __init__
        return _MISSING
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _is_rule(rule: Any) -> bool:
    return isinstance(rule, tuple) and len(rule) == 2 and callable(rule[0]) and isinstance(rule[1], str)


def _evaluate(node: ast.expr, namespace: dict[str, Any]) -> Any:
    """The expression's value when every name in it is in ``namespace``; else ``_MISSING``."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if not names <= set(namespace) or any(namespace[n] is _MISSING for n in names if n in namespace):
        return _MISSING
    if any(isinstance(n, (ast.Lambda, ast.NamedExpr)) for n in ast.walk(node)):
        return _MISSING
    try:
        return eval(compile(ast.Expression(node), "<check_args>", "eval"), {"__builtins__": {}}, dict(namespace))  # noqa: S307 - our own source, names checked
    except Exception:  # noqa: BLE001 - cannot tell here: __init__ decides
        return _MISSING


def _init_spec(target: str) -> tuple[dict[str, Any] | None, list, dict[str, Any], str | None, dict[str, Any]] | None:
    module_name, _, class_name = target.rpartition(".")
    spec = _find_spec(module_name)
    origin = getattr(spec, "origin", None)
    if spec is None or not origin or not origin.endswith(".py"):
        return None
    if origin.endswith("__init__.py") and _class_in(origin, class_name) is None:
        origin = origin[: -len("__init__.py")] + "check.py"  # a check's package: the class lives in check.py
    found = _read_class(origin, class_name)
    if found is None:
        return None
    params, calls, constants, name, bases, attrs = found
    if "DebugCallback" in bases:  # the base's own check_args (on_error), with this class's values
        base_spec = _find_spec("dsdebug.callbacks.base")
        base = _read_class(base_spec.origin, "DebugCallback") if base_spec and base_spec.origin else None
        if base is not None:  # a check's own rule for the same argument wins (it runs first in __init__)
            calls = [*calls, *(c for c in base[1] if c[0] not in {own[0] for own in calls})]
            constants = {**base[2], **constants}
            attrs = {**base[5], **attrs}  # class attributes (self.policies) override the base's
    return params, calls, constants, name, attrs


def _class_in(path: str, class_name: str) -> ast.ClassDef | None:
    tree = _parse(path)
    return next((n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef) and n.name == class_name), None)


@lru_cache(maxsize=None)
def _parse(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


@lru_cache(maxsize=None)
def _read_class(path: str, class_name: str) -> tuple[dict[str, Any] | None, list, dict[str, Any], str | None,
                                                    tuple[str, ...], dict[str, Any]] | None:
    tree = _parse(path)
    cls = _class_in(path, class_name)
    if tree is None or cls is None:
        return None
    constants = {}
    for node in tree.body:  # module-level literal constants (NCCL_DEBUG_LEVELS = ("VERSION", ...))
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except (ValueError, SyntaxError, TypeError):
                pass
    init = None
    attrs: dict[str, Any] = {}  # class-level constants: literals, or a module constant by name
    for node in cls.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and node.value is not None:
            value = _literal(node.value)
            if value is _MISSING and isinstance(node.value, ast.Name):
                value = constants.get(node.value.id, _MISSING)
            if value is not _MISSING:
                attrs[target.id] = value
        elif isinstance(node, ast.FunctionDef) and node.name == "__init__":
            init = node
    name = attrs.get("name") if isinstance(attrs.get("name"), str) else None
    if init is None:
        return None
    a = init.args
    params: dict[str, Any] | None = {}
    positional = a.posonlyargs + a.args
    defaults = [_MISSING] * (len(positional) - len(a.defaults)) + [_literal(d) for d in a.defaults]
    for arg, default in zip(positional, defaults):
        if arg.arg != "self":
            params[arg.arg] = default
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params[arg.arg] = _MISSING if default is None else _literal(default)
    if a.kwarg is not None:
        params = None  # **kwargs: keys we cannot list
    calls = []
    for stmt in init.body:  # top level only: a call under `if` depends on other values
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "check_args"):
            continue
        for kw in call.keywords:
            if kw.arg and isinstance(kw.value, ast.Tuple) and len(kw.value.elts) == 2:
                calls.append((kw.arg, kw.value.elts[0], kw.value.elts[1]))
    bases = tuple(b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases)
    return params, calls, constants, name, bases, attrs


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return _MISSING
