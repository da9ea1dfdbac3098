"""Byte-level BPE trained on first use, plus the corpus' token ids, cached on disk.

Cache layout, one entry per (source fingerprint, vocab_size) for the BPE, and per (source
fingerprint, tokenizer fingerprint) for a pretrained tokenizer (`pretrained_tokenizer.py`)::

    <cache_dir>/<key>/tokenizer/   PreTrainedTokenizerFast.save_pretrained output (the BPE), or a
                                   byte-for-byte copy of the pretrained tokenizer's files
    <cache_dir>/<key>/tokens.npy   all documents' ids, each followed by EOS (uint16 / int32)
    <cache_dir>/<key>/meta.json    counts, dtype, build timings (and which pretrained tokenizer)

Atomicity: an entry is built in `<cache_dir>/.tmp-<key>-*` and moved into place with one
`os.replace` of the directory, so `<key>/` either does not exist or is complete. Two
processes (ranks on one node, or nodes sharing a filesystem) may both build; the first
rename wins, the loser finds the target non-empty, deletes its own copy and uses the
winner's. Nothing ever reads a `.tmp-*` directory.

Corruption: an entry whose files do not load (a truncated tokens.npy, a garbled tokenizer.json
or meta.json, a vocabulary of the wrong size) is a cache miss: it is renamed away atomically,
deleted, rebuilt, and a warning names the bad file. Nothing else is lost: it is a cache.

Runs on whichever process calls it; `LMDataModule.prepare_data` calls it on local rank 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from dsdebug.errors import ConfigError

__all__ = ["CACHE_FORMAT", "ENCODE_BATCH", "EOS_TOKEN", "MIN_VOCAB_SIZE", "PAD_TOKEN", "SPECIAL_TOKENS", "TokenCache",
           "batched", "cache_key", "encode_documents", "ensure_cache", "entry_problem", "find_cache", "token_dtype",
           "train_bpe", "wrap"]

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"  # end of document, also the separator between packed docs
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]  # ids 0 and 1
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens
CACHE_FORMAT = 1  # bump when the layout or the tokenizer recipe changes
ENCODE_BATCH = 1000


def cache_key(fingerprint: str, vocab_size: int, tokenizer_fingerprint: str | None = None) -> str:
    """The entry's name. A pretrained tokenizer's fingerprint (its files' hashes) makes a key of
    its own; without one (the BPE trained here) the key is what it always was."""
    content = {"fingerprint": fingerprint, "vocab_size": vocab_size, "format": CACHE_FORMAT}
    if tokenizer_fingerprint is not None:
        content["tokenizer"] = tokenizer_fingerprint
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()[:20]


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size < 65536 else np.int32


def train_bpe(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE; lossless for any text (every byte is a token)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer)
    return tok


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,  # decode(encode(s)) == s
    )


def encode_documents(
    tok: Tokenizer, documents: Iterable[str], dtype: type
) -> tuple[np.ndarray, int, int]:
    """Concatenate every document's ids, each followed by EOS -> (ids, n_docs, n_chars)."""
    eos = tok.token_to_id(EOS_TOKEN)
    chunks: list[np.ndarray] = []
    n_docs = n_chars = 0
    for batch in batched(documents, ENCODE_BATCH):
        ids: list[int] = []
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
        chunks.append(np.asarray(ids, dtype=dtype))
        n_docs += len(batch)
        n_chars += sum(map(len, batch))
    ids_all = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    return ids_all, n_docs, n_chars


def batched(items: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


class TokenCache:
    """One complete cache entry (a directory that only ever appears whole)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tokenizer_dir = self.path / "tokenizer"
        self.tokens_path = self.path / "tokens.npy"
        self.meta = json.loads((self.path / "meta.json").read_text())

    def load_tokenizer(self) -> PreTrainedTokenizerFast:
        return PreTrainedTokenizerFast.from_pretrained(str(self.tokenizer_dir))

    def load_tokens(self) -> np.ndarray:
        """Memory-mapped: pages are shared between ranks and dataloader workers."""
        return np.load(self.tokens_path, mmap_mode="r")


def _key(source, vocab_size: int, pretrained) -> str:
    return cache_key(source.fingerprint(), vocab_size, pretrained.fingerprint if pretrained is not None else None)


def find_cache(source, vocab_size: int, cache_dir: str | os.PathLike, pretrained=None) -> TokenCache | None:
    entry = Path(cache_dir) / _key(source, vocab_size, pretrained)
    return TokenCache(entry) if (entry / "meta.json").is_file() else None


def ensure_cache(source, vocab_size: int, cache_dir: str | os.PathLike, pretrained=None) -> TokenCache:
    """Return the cache entry for (source, vocab_size) -- or (source, pretrained tokenizer) when
    `pretrained` (a `PretrainedTokenizer`) is given -- building it if missing."""
    fingerprint = source.fingerprint()
    root = Path(cache_dir)
    entry = root / _key(source, vocab_size, pretrained)
    if (entry / "meta.json").is_file():
        problem = entry_problem(entry, vocab_size, pretrained=pretrained is not None)
        if problem is None:
            return TokenCache(entry)
        log.warning("data cache entry %s is corrupt (%s); rebuilding it", entry, problem)
        _discard(entry)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=root))
    except OSError as e:
        raise ConfigError(f"data.cache_dir={str(root)!r} is not writable: {e.strerror}") from None
    try:
        _build(source, fingerprint, vocab_size, tmp, pretrained)
        tmp.chmod(0o755)  # mkdtemp makes 0700; a shared cache should stay readable
        try:
            os.replace(tmp, entry)
            log.info("data cache built: %s (%s)", entry, source)
        except OSError:
            if not (entry / "meta.json").is_file():
                raise ConfigError(
                    f"data cache entry {entry} exists but is incomplete (no meta.json); delete it"
                ) from None
            log.info("data cache built concurrently by another process; using %s", entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when our rename won
    return TokenCache(entry)


def entry_problem(entry: Path, vocab_size: int, pretrained: bool = False) -> str | None:
    """What is wrong with a complete-looking cache entry, naming the file; None if it loads.
    Cheap: parses meta.json and tokenizer.json, reads the header of tokens.npy. A
    pretrained tokenizer is loaded from its own directory, not from the entry: only meta.json and
    tokens.npy matter there."""
    meta_path, tok_path, tokens_path = entry / "meta.json", entry / "tokenizer" / "tokenizer.json", entry / "tokens.npy"
    try:
        meta = json.loads(meta_path.read_text())
        num_tokens, dtype = int(meta["num_tokens"]), np.dtype(meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{meta_path}: {type(e).__name__}: {_first_line(e)}"
    if pretrained:
        if meta.get("vocab_size") != vocab_size:
            return f"{meta_path}: vocab_size {meta.get('vocab_size')}, expected {vocab_size}"
    else:
        try:
            learned = Tokenizer.from_file(str(tok_path)).get_vocab_size()
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
            return f"{tok_path}: {type(e).__name__}: {_first_line(e)}"
        if learned != vocab_size:
            return f"{tok_path}: {learned} tokens, expected {vocab_size}"
    try:
        tokens = np.load(tokens_path, mmap_mode="r")
    except (OSError, ValueError) as e:
        return f"{tokens_path}: {type(e).__name__}: {_first_line(e)}"
    if tokens.shape != (num_tokens,) or tokens.dtype != dtype:
        return f"{tokens_path}: {tokens.dtype}{list(tokens.shape)}, meta.json says {dtype}[{num_tokens}]"
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _discard(entry: Path) -> None:
    """Move a bad entry out of the way in one rename, then delete it. Another process may have
    done so already (or even rebuilt it): a failed rename is fine, the build handles both."""
    trash = entry.parent / f".tmp-corrupt-{entry.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(entry, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _build(source, fingerprint: str, vocab_size: int, out: Path, pretrained=None) -> None:
    if pretrained is not None:
        _build_pretrained(source, fingerprint, out, pretrained)
        return
    t0 = time.perf_counter()
    tok = train_bpe(source.documents(), vocab_size)
    train_s = time.perf_counter() - t0
    learned = tok.get_vocab_size()
    if learned != vocab_size:
        raise ConfigError(
            f"data.vocab_size={vocab_size} but BPE on {source!r} learned only {learned} tokens "
            f"(corpus too small); set data.vocab_size<={learned} or add text"
        )
    wrap(tok).save_pretrained(str(out / "tokenizer"))
    t1 = time.perf_counter()
    tokens, n_docs, n_chars = encode_documents(tok, source.documents(), token_dtype(vocab_size))
    _write_entry(out, source, tokens, n_docs, n_chars, {
        "fingerprint": fingerprint, "vocab_size": vocab_size,
        "eos_token_id": tok.token_to_id(EOS_TOKEN), "pad_token_id": tok.token_to_id(PAD_TOKEN),
        "train_seconds": round(train_s, 3), "encode_seconds": round(time.perf_counter() - t1, 3)})


def _build_pretrained(source, fingerprint: str, out: Path, pretrained) -> None:
    pretrained.copy_files(out / "tokenizer")
    t0 = time.perf_counter()
    tokens, n_docs, n_chars = pretrained.encode(source.documents(), token_dtype(pretrained.vocab_size))
    _write_entry(out, source, tokens, n_docs, n_chars, {
        "fingerprint": fingerprint, "vocab_size": pretrained.vocab_size, "tokenizer": pretrained.meta(),
        "eos_token_id": pretrained.eos_token_id, "pad_token_id": pretrained.pad_token_id,
        "encode_seconds": round(time.perf_counter() - t0, 3)})


def _write_entry(out: Path, source, tokens: np.ndarray, n_docs: int, n_chars: int, facts: dict) -> None:
    """tokens.npy and meta.json of a cache entry (meta.json last: it marks the entry complete)."""
    if n_docs == 0:
        raise ConfigError(f"data.source {source!r} produced no documents")
    np.save(out / "tokens.npy", tokens)
    meta = {"format": CACHE_FORMAT, **facts, "num_documents": n_docs, "num_chars": n_chars,
            "num_tokens": int(tokens.size), "dtype": np.dtype(tokens.dtype).name}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
