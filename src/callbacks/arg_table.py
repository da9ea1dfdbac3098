"""The table of every check's declared argument rules, as data: ``src/config/check_args.json``.

The config layer refuses a bad ``callbacks.<name>.<key>`` before torch is imported
(config/callback_args.py). It must not import a check (torch, Lightning: ~10 s) nor read a check's
source, so it reads this table: per check class, its config name, its ``__init__`` parameters (or
null when it takes ``**kwargs``) and its declared rules (``DebugCallback.declared_rules``, as
``Rule.to_data``). ``tests/config/test_callback_args.py`` fails when the table and the classes
disagree. After changing a check's arguments or rules::

    python -m dsdebug.callbacks.arg_table      # rewrites src/config/check_args.json
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

__all__ = ["TABLE_PATH", "build_table", "main"]

TABLE_PATH = Path(__file__).resolve().parents[1] / "config" / "check_args.json"


def build_table() -> dict[str, Any]:
    """``{class name: {"module", "name", "params", "rules"}}`` for every check of the facade."""
    import dsdebug.callbacks as callbacks
    from dsdebug.callbacks.base import DebugCallback

    table: dict[str, Any] = {}
    for class_name in sorted(callbacks._MODULES):
        cls = getattr(callbacks, class_name)
        if cls is DebugCallback or not issubclass(cls, DebugCallback):
            continue
        params: list[str] | None = []
        for p in inspect.signature(cls.__init__).parameters.values():
            if p.kind == p.VAR_KEYWORD:
                params = None
                break
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                params.append(p.name)
        rules = cls.declared_rules()
        if params is not None:  # a rule only for what __init__ takes (on_error: not every check exposes it)
            rules = {k: r for k, r in rules.items() if k in params}
        table[class_name] = {"module": cls.__module__, "name": cls.name, "params": params,
                             "rules": {k: r.to_data() for k, r in rules.items()}}
    return table


def render(table: dict[str, Any]) -> str:
    """One check per block, one rule per line (in the order ``__init__`` applies them)."""
    blocks = []
    for class_name, entry in table.items():
        rules = ",\n".join(f"   {json.dumps(k)}: {json.dumps(r)}" for k, r in entry["rules"].items())
        blocks.append(f" {json.dumps(class_name)}: {{\"module\": {json.dumps(entry['module'])}, "
                      f"\"name\": {json.dumps(entry['name'])},\n  \"params\": {json.dumps(entry['params'])},\n"
                      f"  \"rules\": {{\n{rules}\n  }}}}")
    return "{\n" + ",\n".join(blocks) + "\n}\n"


def main() -> None:
    TABLE_PATH.write_text(render(build_table()))
    print(f"wrote {TABLE_PATH}")


if __name__ == "__main__":
    main()
