"""A corpus of short documents for packing tests: the paragraphs of CPython's own pydoc topics
(``pydoc_data/topics.py``, ~2,600 paragraphs of ~30 tokens; ships with every CPython, PSF licence),
one document per line of a .jsonl file. Rows of 128 tokens then hold several documents each."""

from __future__ import annotations

import json
from pathlib import Path


def write_short_documents(path: Path) -> Path:
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return path


def short_documents_data(corpus: Path) -> list[str]:
    """The overrides that train on ``corpus`` (made by ``write_short_documents``)."""
    return ["data=text_files", f"data.source.paths={corpus}"]
