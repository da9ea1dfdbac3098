"""What a tokenizer is, read from its files with json only (no transformers import), or from a
loaded transformers tokenizer: its files, its id range and its special tokens. The rules that use
these facts: ``tokenizer_check.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsdebug.errors import ConfigError

__all__ = ["ROLES", "TOKENIZER_FILES", "TOKENIZER_MARKERS", "TokenizerFacts", "check_has_eos", "facts_from_files",
           "facts_from_tokenizer", "tokenizer_files"]

# Files a tokenizer is made of (what save_pretrained writes, old and new formats); weights and the
# model's config.json are not among them. The first group marks a directory as holding a tokenizer.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                     "spiece.model", "sentencepiece.bpe.model")
TOKENIZER_FILES = TOKENIZER_MARKERS + ("special_tokens_map.json", "added_tokens.json", "merges.txt",
                                       "chat_template.jinja", "chat_template.json")
# Tokenizer classes without default special tokens: a key missing from tokenizer_config.json is unset.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
ROLES = ("eos", "bos", "pad")


def tokenizer_files(directory: Path) -> list[Path]:
    """The tokenizer's files in ``directory`` (sorted; empty if it holds no tokenizer)."""
    found = [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]
    if not any(p.name in TOKENIZER_MARKERS for p in found):
        return []
    return sorted(found + [p for p in directory.glob("*.tiktoken") if p.is_file()])


@dataclass
class TokenizerFacts:
    """What is known about a tokenizer. ``vocab_size`` is max id + 1 (None: unknown).
    ``roles`` holds only what is certain: role -> (token or None if unset, id or None if the
    token is not in the vocabulary)."""

    vocab_size: int | None = None
    roles: dict[str, tuple[str | None, int | None]] = field(default_factory=dict)
    special_tokens: list[str] = field(default_factory=list)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path, label: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{label}: {path} is unreadable or not JSON ({' '.join(str(e).split())[:160]}); "
                          "valid: the files tokenizer.save_pretrained writes") from None


def facts_from_files(directory: Path, label: str) -> TokenizerFacts:
    """Facts read from tokenizer.json / tokenizer_config.json / special_tokens_map.json with json
    only. What depends on transformers (a class's default tokens, slow-tokenizer formats) stays
    unknown and is checked after loading."""
    facts = TokenizerFacts()
    ids: dict[str, int] | None = None
    if (directory / "tokenizer.json").is_file():
        data = _read_json(directory / "tokenizer.json", label)
        vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
        if isinstance(vocab, dict):
            ids = {str(k): int(v) for k, v in vocab.items()}
        elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
            ids = {str(piece[0]): i for i, piece in enumerate(vocab) if piece}
        if ids is not None:
            for tok in data.get("added_tokens") or []:
                ids[tok["content"]] = int(tok["id"])
                if tok.get("special"):
                    facts.special_tokens.append(tok["content"])
    if ids is not None and (directory / "added_tokens.json").is_file():
        added = _read_json(directory / "added_tokens.json", label)
        ids.update({str(k): int(v) for k, v in added.items()} if isinstance(added, dict) else {})
    if ids:
        facts.vocab_size = max(ids.values()) + 1
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return facts  # the class (and its default tokens) comes from elsewhere: unknown here
    config = _read_json(config_file, label)
    config = config if isinstance(config, dict) else {}
    if (directory / "special_tokens_map.json").is_file():
        mapping = _read_json(directory / "special_tokens_map.json", label)
        config = {**config, **(mapping if isinstance(mapping, dict) else {})}
    generic = config.get("tokenizer_class") in _GENERIC_CLASSES
    for role in ROLES:
        key = f"{role}_token"
        if key not in config and not generic:
            continue  # the tokenizer class may supply a default
        token = _token_text(config.get(key))
        if token is not None and ids is None:
            continue  # set, but its id is unknown without the vocabulary
        facts.roles[role] = (token, None if token is None else ids.get(token))
    return facts


def facts_from_tokenizer(tok: Any) -> TokenizerFacts:
    """The same facts from a loaded transformers tokenizer (authoritative)."""
    vocab = tok.get_vocab()
    added = [str(t) for t in getattr(tok, "added_tokens_decoder", {}).values() if getattr(t, "special", False)]
    specials = list(dict.fromkeys(added + [str(t) for t in tok.all_special_tokens]))
    facts = TokenizerFacts(vocab_size=max(vocab.values()) + 1 if vocab else 0,
                           special_tokens=[t for t in specials if t in vocab])
    for role in ROLES:
        token = getattr(tok, f"{role}_token", None)
        token = None if token is None else str(token)
        facts.roles[role] = (token, None if token is None else vocab.get(token))
    return facts


def check_has_eos(facts: TokenizerFacts, label: str, config_file: Path | str) -> None:
    if "eos" not in facts.roles:
        return
    token, token_id = facts.roles["eos"]
    candidates = ", ".join(facts.special_tokens[:8]) or "none; add one to the tokenizer first"
    if token is None:
        raise ConfigError(
            f"{label}: the tokenizer has no eos_token, but packing separates documents with it; valid: a "
            f"tokenizer with an EOS token: set \"eos_token\" in {config_file} to the token that ends a "
            f"document (its special tokens: {candidates})")
    if token_id is None:
        raise ConfigError(f"{label}: eos_token {token!r} is not in the tokenizer's vocabulary; valid: set "
                          f"\"eos_token\" in {config_file} to one of its tokens (special ones: {candidates})")
