"""Which tokenizer encodes the corpus, and whether it fits the model: decided and checked from the
composed config and the tokenizer's files, before torch, Lightning or transformers are imported.

The choice (``data.tokenizer``, which the data configs read from ``model.tokenizer``):

- ``model=hf_pretrained``: ``model.tokenizer`` defaults to the model directory itself, so a
  save_pretrained directory with tokenizer files trains on its own tokenizer's ids. A directory
  without any is today's behaviour: a BPE freshly trained on the corpus, with a warning. Another
  tokenizer directory or hub id can be given (``model.tokenizer=<dir|org/name>``); ``null`` asks
  for the fresh BPE (warned as well: the model has never seen those ids).
- any other model: a BPE trained on the corpus (``data.vocab_size`` tokens), unless
  ``+model.tokenizer=<dir|org/name>`` is given.

The rules, each a one-line ``ConfigError`` naming the key or file (the same functions run again
on the loaded tokenizer and the built model in ``src/trainer/entry.py``, which covers hub ids and
what only transformers knows, such as a tokenizer class's default EOS):

- the tokenizer's ids fit the model: max id + 1 <= ``vocab_size`` in its config.json;
- ``eos_token_id`` / ``bos_token_id`` / ``pad_token_id`` in config.json agree with the
  tokenizer's, where both set them (a list in config.json must contain the tokenizer's id);
- the tokenizer has an EOS token: packing separates documents with it;
- ``data.vocab_size`` follows the tokenizer: a config default that differs is replaced (one log
  line), a value given on the command line that differs is an error.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from dsdebug.errors import ConfigError
from dsdebug.data.tokenizer_facts import ROLES, check_has_eos, TOKENIZER_MARKERS, TokenizerFacts, facts_from_files, tokenizer_files

__all__ = ["TokenizerChoice", "check_fits_model", "check_tokenizer", "check_vocab_size", "choose_tokenizer",
           "settle_tokenizer", "settle_vocab_size"]

log = logging.getLogger(__name__)

# -- the rules ------------------------------------------------------------------------------


def check_fits_model(facts: TokenizerFacts, label: str, model_config: dict, where: str) -> None:
    """The tokenizer against a model config (config.json's dict): vocabulary and special ids."""
    model_vocab = model_config.get("vocab_size")
    if facts.vocab_size and _is_int(model_vocab) and facts.vocab_size > model_vocab:
        raise ConfigError(
            f"{label}: the tokenizer has {facts.vocab_size} token ids but vocab_size={model_vocab} in {where} "
            f"(ids would index past the embedding); valid: a tokenizer with at most {model_vocab} ids (the one "
            "the model was trained with)")
    for role in ROLES:
        token, token_id = facts.roles.get(role, (None, None))
        want = model_config.get(f"{role}_token_id")
        if token_id is None or want is None:
            continue
        if token_id in want if isinstance(want, list) else token_id == want:
            continue
        raise ConfigError(
            f"{where}: {role}_token_id={want} disagrees with {label}, whose {role}_token {token!r} is id "
            f"{token_id}; valid: {role}_token_id={token_id} in the model's config.json, or the tokenizer the "
            "model was trained with (model.tokenizer=<dir or hub id>)")


def check_vocab_size(cfg: DictConfig, vocab_size: int, label: str) -> None:
    """A ``data.vocab_size`` typed on the command line must agree with the tokenizer."""
    given = cfg.data.vocab_size
    if given != vocab_size and _given_on_command_line("data.vocab_size"):
        raise ConfigError(
            f"data.vocab_size={given} contradicts {label}, which has {vocab_size} token ids; with a pretrained "
            f"tokenizer data.vocab_size follows it: drop the override (or give data.vocab_size={vocab_size})")


def settle_vocab_size(cfg: DictConfig, vocab_size: int, label: str) -> None:
    """``data.vocab_size`` := the tokenizer's id range (model configs interpolate it)."""
    check_vocab_size(cfg, vocab_size, label)
    if cfg.data.vocab_size != vocab_size:
        if _is_rank_zero():
            log.info("data.vocab_size=%s -> %d: it follows %s", cfg.data.vocab_size, vocab_size, label)
        with open_dict(cfg):
            cfg.data.vocab_size = vocab_size


# -- the choice -----------------------------------------------------------------------------


@dataclass
class TokenizerChoice:
    """``name``: a directory or hub id, None for a fresh BPE. ``label``: ``key=name`` for messages.
    ``own``: it is the pretrained model's own directory. ``local_dir``: set for a directory."""

    name: str | None
    label: str
    own: bool = False
    local_dir: Path | None = None

    @property
    def files(self) -> list[Path]:
        return tokenizer_files(self.local_dir) if self.local_dir is not None else []


def choose_tokenizer(cfg: DictConfig) -> TokenizerChoice | None:
    """The tokenizer ``data.tokenizer`` names, or None when the data has no tokenizer key (or is
    synthetic). A local path that does not exist, or that is not a tokenizer directory (unless it
    is the model's own, which falls back to a fresh BPE), is a ConfigError."""
    data, model = cfg.data, cfg.model
    if "tokenizer" not in data or str(data.get("source", {}).get("_target_", "")).endswith("SyntheticCorpus"):
        return None
    name = data.tokenizer
    net = model.get("net")
    model_path = net.get("name_or_path") if isinstance(net, DictConfig) else None
    from_model = "tokenizer" in model and model.tokenizer == name
    own = from_model and name is not None and model_path is not None and str(name) == str(model_path)
    key = "model.net.name_or_path" if own else "model.tokenizer" if from_model else "data.tokenizer"
    if name is None:
        return TokenizerChoice(None, f"{key}=null")
    name = str(name)
    choice = TokenizerChoice(name, f"{key}={name}", own=own)
    path = Path(os.path.expanduser(name))
    if not path.exists():
        if name.startswith(("/", "./", "../", "~")):
            raise ConfigError(f"{key}={name}: no such directory; valid: a directory with tokenizer files "
                              "(tokenizer.json, tokenizer_config.json, ...) or a Hugging Face hub id 'org/name'")
        return choice  # a hub id: checked once loaded
    if not path.is_dir():
        raise ConfigError(f"{key}={name} is a file; valid: the directory that holds the tokenizer's files")
    choice.local_dir = path
    if not own and not choice.files:
        raise ConfigError(
            f"{key}={name} holds no tokenizer (none of {', '.join(TOKENIZER_MARKERS[:4])}, ...); valid: a "
            "directory written by tokenizer.save_pretrained, or a Hugging Face hub id")
    return choice


def check_tokenizer(cfg: DictConfig, model_config: dict | None, where: str) -> bool:
    """Before anything is built: the chosen tokenizer's files against the model (``model_config``:
    its config.json, or the random-init model's ``model.net``; None: not known yet). Returns
    whether a pretrained tokenizer (not a fresh BPE) will encode the corpus."""
    choice = choose_tokenizer(cfg)
    if choice is None or choice.name is None:
        return False
    if choice.local_dir is None:
        return True  # a hub id: its files are checked once fetched (src/trainer/entry.py)
    if not choice.files:
        return False  # the model's own directory without a tokenizer: a fresh BPE
    facts = facts_from_files(choice.local_dir, choice.label)
    check_has_eos(facts, choice.label, choice.local_dir / "tokenizer_config.json")
    if model_config is not None:
        check_fits_model(facts, choice.label, model_config, where)
    if facts.vocab_size is not None:
        check_vocab_size(cfg, facts.vocab_size, choice.label)
    return True


def settle_tokenizer(cfg: DictConfig) -> None:
    """Fix ``data.tokenizer`` to what will be used (None = fresh BPE, warned for a pretrained model)
    and ``data.vocab_size`` to the tokenizer's id range when the files tell it."""
    choice = choose_tokenizer(cfg)
    if choice is None:
        return
    net = cfg.model.get("net")
    pretrained = isinstance(net, DictConfig) and "name_or_path" in net
    fallback = choice.name is None or (choice.own and choice.local_dir is not None and not choice.files)
    if fallback:
        if pretrained and _is_rank_zero():
            why = " has no tokenizer files" if choice.name is not None else ""
            log.warning(
                "%s%s: the corpus is encoded with a BPE freshly trained on it (data.vocab_size=%s), whose ids "
                "mean nothing to the pretrained embeddings; give model.tokenizer=<the tokenizer the model was "
                "trained with> (a directory or hub id)", choice.label, why, cfg.data.vocab_size)
        with open_dict(cfg):
            cfg.data.tokenizer = None
        return
    with open_dict(cfg):
        cfg.data.tokenizer = choice.name
    if choice.local_dir is not None:
        facts = facts_from_files(choice.local_dir, choice.label)
        if facts.vocab_size is not None:
            settle_vocab_size(cfg, facts.vocab_size, choice.label)


# -- helpers --------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_rank_zero() -> bool:
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def _given_on_command_line(key: str) -> bool:
    """Whether ``key=...`` (or ``+key=``/``++key=``) is one of this run's overrides."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except (ValueError, AttributeError):  # not under Hydra (a direct call in a test)
        return False
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)
