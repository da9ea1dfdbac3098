"""Data pipeline: text sources (`corpus`), cached byte-level BPE (`tokenizer`), and the
packed-block `LMDataModule` (`datamodule`). Configs live in `conf/data/*.yaml`.

Importing the package imports nothing else: the config validation reads `tokenizer_facts`
(plain JSON files) before torch or Lightning may be imported, and the classes below load on
first use (``from dsdebug.data import LMDataModule``)."""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "HFDatasetCorpus": "corpus",
    "KJVCorpus": "corpus",
    "SyntheticCorpus": "corpus",
    "TextFilesCorpus": "corpus",
    "LMDataModule": "datamodule",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULES))
