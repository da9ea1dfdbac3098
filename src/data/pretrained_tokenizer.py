"""A pretrained model's tokenizer as the data pipeline's encoder (``data.tokenizer``).

Loaded with ``AutoTokenizer.from_pretrained`` from a directory; a hub id is first fetched into the
local Hugging Face cache (tokenizer files only). Each document is encoded exactly as
``tokenizer(text)`` encodes it (with the tokenizer's own special tokens, e.g. a Llama BOS), then
followed by EOS unless it already ends with it, so packed blocks look like the model's pretraining
data. The cache key (``src/data/tokenizer.py``) holds ``fingerprint``: the sha256 of every
tokenizer file, the class transformers picked and the transformers/tokenizers versions, so two
tokenizers never share token ids.

Which tokenizer is chosen, and the checks against the model: ``src/config/tokenizer_check.py``.
Runs on every rank (each loads the tokenizer; the cache is built once, see tokenizer.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from pathlib import Path
from typing import Iterable

import numpy as np

from dsdebug.data.corpus import resolve_path
from dsdebug.data.tokenizer import ENCODE_BATCH, batched
from dsdebug.errors import ConfigError
from dsdebug.data.tokenizer_facts import TOKENIZER_FILES, check_has_eos, TOKENIZER_MARKERS, facts_from_tokenizer, tokenizer_files

__all__ = ["PretrainedTokenizer", "copy_tokenizer_files"]


class PretrainedTokenizer:
    """``name``: a directory with tokenizer files, or a hub id ('org/name').

    Attributes: ``tokenizer`` (the transformers tokenizer), ``local_dir``, ``files``, ``facts``
    (``TokenizerFacts``), ``vocab_size`` (max id + 1), ``eos_token_id``, ``pad_token_id``,
    ``fingerprint``.
    """

    def __init__(self, name: str):
        self.name = str(name)
        self.label = f"data.tokenizer={self.name}"
        self.local_dir = _local_dir(self.name, self.label)
        self.files = tokenizer_files(self.local_dir)
        if not self.files:
            raise ConfigError(
                f"{self.label}: {self.local_dir} holds no tokenizer (none of {', '.join(TOKENIZER_MARKERS[:4])}, "
                "...); valid: a directory written by tokenizer.save_pretrained, or model.tokenizer=null for a "
                "BPE trained on the corpus")
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.local_dir))
        except (OSError, ValueError, TypeError, KeyError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"{self.label}: transformers cannot load the tokenizer in {self.local_dir} "
                              f"({first}); valid: a directory written by tokenizer.save_pretrained") from None
        self.facts = facts_from_tokenizer(self.tokenizer)
        check_has_eos(self.facts, self.label, self.local_dir / "tokenizer_config.json")
        self.vocab_size = int(self.facts.vocab_size)
        self.eos_token_id = self.facts.roles["eos"][1]
        self.pad_token_id = self.facts.roles["pad"][1]
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.name}:{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
        versions = [f"{p}=={importlib.metadata.version(p)}" for p in ("transformers", "tokenizers")]
        h.update(f"{type(self.tokenizer).__name__}:{':'.join(versions)}".encode())
        return h.hexdigest()[:32]

    def encode(self, documents: Iterable[str], dtype: type) -> tuple[np.ndarray, int, int]:
        """Every document's ``tokenizer(text)`` ids + EOS, concatenated -> (ids, n_docs, n_chars)."""
        eos = self.eos_token_id
        chunks: list[np.ndarray] = []
        n_docs = n_chars = 0
        for batch in batched(documents, ENCODE_BATCH):
            encoded = self.tokenizer(batch, add_special_tokens=True, return_attention_mask=False, verbose=False)
            ids: list[int] = []
            for doc_ids in encoded["input_ids"]:
                ids.extend(doc_ids)
                if not doc_ids or doc_ids[-1] != eos:
                    ids.append(eos)
            chunks.append(np.asarray(ids, dtype=dtype))
            n_docs += len(batch)
            n_chars += sum(map(len, batch))
        return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)), n_docs, n_chars

    def copy_files(self, out_dir: str | os.PathLike) -> None:
        """The tokenizer's files, byte for byte (what export/hf ships and a cache entry records)."""
        copy_tokenizer_files(self.local_dir, out_dir)

    def meta(self) -> dict:
        return {"name": self.name, "dir": str(self.local_dir), "class": type(self.tokenizer).__name__,
                "fingerprint": self.fingerprint, "files": [f.name for f in self.files]}

    def __repr__(self) -> str:
        return f"PretrainedTokenizer({self.name!r}, {type(self.tokenizer).__name__}, {self.vocab_size} ids)"


def copy_tokenizer_files(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(f, out / f.name)) for f in tokenizer_files(Path(src_dir))]


def _local_dir(name: str, label: str) -> Path:
    """A directory as given (relative to the launch directory), or a hub id fetched into the HF cache."""
    path = resolve_path(name)
    if path.is_dir():
        return path
    if path.exists() or name.startswith(("/", "./", "../", "~")):
        raise ConfigError(f"{label}: {path} is not a directory; valid: a directory with tokenizer files "
                          "or a Hugging Face hub id 'org/name'")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return Path(snapshot_download(name, allow_patterns=[*TOKENIZER_FILES, "*.tiktoken"],
                                      local_files_only=offline))
    except Exception as e:  # noqa: BLE001 - hub errors: offline, not cached, no such repo, gated
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{label}: cannot fetch the tokenizer of hub id {name!r} ({type(e).__name__}: {first}); "
                          "valid: a local tokenizer directory, or a hub id that is cached or reachable") from None
