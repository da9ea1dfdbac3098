"""Reading local text files for `TextFilesCorpus` (src/data/corpus.py): which files a pattern
names, and each file's documents.

- A directory is scanned recursively for `.txt` and `.jsonl` files only. A path or glob the user
  gives names files of any suffix (`LICENSE`, `Apache-2.0`, `notes.md`): each is read as `.txt`
  unless it ends in `.jsonl`.
- A file must be UTF-8 (else a one-line ConfigError with the byte offset). Valid UTF-8 can still be
  binary (NUL bytes are valid UTF-8; so is UTF-16 text without a BOM): a file whose first
  `SNIFF_CHARS` characters hold a NUL or more than `CONTROL_SHARE` control characters gets one
  warning naming the file and the evidence, and is still used (CJK text, emoji and other
  non-Latin text are letters, not control characters).
"""

from __future__ import annotations

import glob
import json
import logging
import re
import unicodedata
from pathlib import Path
from typing import Iterator

from dsdebug.errors import ConfigError

__all__ = ["CONTROL_SHARE", "SNIFF_CHARS", "TEXT_SUFFIXES", "TextFileReader", "binary_evidence", "match_files"]

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".jsonl")  # what a directory scan picks up
SNIFF_CHARS = 8192
CONTROL_SHARE = 0.10
_WHITESPACE_CONTROLS = set("\t\n\r\x0b\x0c")


def match_files(pattern: Path) -> list[Path]:
    """Files named by one pattern: a directory (its .txt/.jsonl files), a path or a glob."""
    if pattern.is_dir():
        return [p for s in TEXT_SUFFIXES for p in pattern.rglob(f"*{s}") if p.is_file()]
    return [p for p in map(Path, glob.glob(str(pattern), recursive=True)) if p.is_file()]


def binary_evidence(text: str) -> str | None:
    """Why the start of `text` looks binary rather than text, or None."""
    head = text[:SNIFF_CHARS]
    nul = head.count("\x00")
    if nul:
        utf16 = " (UTF-16 text? convert it to UTF-8)" if _alternating_nul(head) else ""
        return f"{nul} NUL bytes in its first {len(head)} characters (first at character {head.index(chr(0))}){utf16}"
    controls = [c for c in head if c not in _WHITESPACE_CONTROLS and unicodedata.category(c) == "Cc"]
    if head and len(controls) > CONTROL_SHARE * len(head):
        return (f"{len(controls)} of its first {len(head)} characters are control characters "
                f"({len(controls) / len(head):.0%}, e.g. {controls[0]!r})")
    return None


def _alternating_nul(head: str) -> bool:
    """Every other character NUL, the rest not: ASCII text in UTF-16 (LE or BE) without a BOM."""
    def share(chars: str) -> float:
        return chars.count("\x00") / max(1, len(chars))

    even, odd = share(head[0::2]), share(head[1::2])
    return (odd > 0.9 and even < 0.1) or (even > 0.9 and odd < 0.1)


class TextFileReader:
    """Reads files as documents; warns once per file that looks binary."""

    def __init__(self, text_field: str = "text", split_on_blank_lines: bool = False):
        self.text_field = text_field
        self.split_on_blank_lines = bool(split_on_blank_lines)
        self._warned: set[Path] = set()

    def documents(self, f: Path) -> Iterator[str]:
        yield from self._jsonl_documents(f) if f.suffix == ".jsonl" else self._txt_documents(f)

    def read(self, f: Path) -> str:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"data file {f} is not valid UTF-8 (byte {e.start})") from None
        if f not in self._warned:
            evidence = binary_evidence(text)
            if evidence is not None:
                self._warned.add(f)
                log.warning("data file %s looks binary, not text: %s; it is trained on as it is; remove it from "
                            "data.source.paths if it is not text", f, evidence)
        return text

    def _txt_documents(self, f: Path) -> Iterator[str]:
        text = self.read(f)
        if not text.strip():
            raise ConfigError(f"data file {f} is empty")
        if self.split_on_blank_lines:
            yield from (p.strip() for p in re.split(r"\n\s*\n", text) if p.strip())
        else:
            yield text.strip()

    def _jsonl_documents(self, f: Path) -> Iterator[str]:
        n = 0
        field = self.text_field
        for lineno, line in enumerate(self.read(f).splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data file {f} line {lineno} is not valid JSON: {e.msg}") from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"data file {f} line {lineno} has no field data.source.text_field={field!r} (found: {keys})")
            value = record[field]
            if not isinstance(value, str):
                raise ConfigError(
                    f"data file {f} line {lineno}: field {field!r} must be a string, got {type(value).__name__}")
            if value.strip():
                n += 1
                yield value
        if n == 0:
            raise ConfigError(f"data file {f} is empty (no non-empty {field!r} values)")
