"""model=hf_pretrained trains on the model's own tokenizer (three families: GPT-2, Llama, Qwen2),
ships it in export/hf, keeps its token ids apart in the cache, and refuses a tokenizer that does
not fit the model with one line (exit 2)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from dsdebug.data import tokenizer as tokmod
from dsdebug.data.corpus import KJVCorpus, TextFilesCorpus
from dsdebug.data.datamodule import LMDataModule
from dsdebug.errors import ConfigError
from tests.helpers.bad_input import assert_one_line_error, cli_error_lines
from tests.helpers.runs import CONF, REPO, SMOKE, TINY_NET, train_in_process
from tests.helpers.tokenizer_families import FAMILIES, build_model, build_tokenizer, save_model_dir

SAMPLES = ["In the beginning God created the heaven and the earth.",
           "  Odd  spacing,\ttabs and ünïcödé 🙂 日本語のテキスト",
           "<|endoftext|> and </s> typed inside a text"]


@pytest.fixture(scope="module")
def texts():
    return list(KJVCorpus().documents())[:12]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, texts):
    """Ten chapters, one per file: ~32 KB, ~10k tokens for these tokenizers."""
    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(texts[:10]):
        (d / f"ch{i:02d}.txt").write_text(text)
    return d


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, texts):
    root = tmp_path_factory.mktemp("models")
    return {family: save_model_dir(family, root / family, texts[:4]) for family in FAMILIES}


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# -- training on the model's own tokenizer, and its export ----------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_dir_trains_on_its_own_tokenizer_and_exports_it(family, model_dirs, corpus_dir, texts,
                                                                   tmp_path):
    model_dir, cache = model_dirs[family], tmp_path / "cache"
    overrides = SMOKE + [
        "model=hf_pretrained", f"model.net.name_or_path={model_dir}", "data=text_files",
        f"data.source.paths={corpus_dir}", "strategy=ddp", "trainer.max_steps=2", "trainer.val_check_interval=2",
        "export.fp32=true", "export.hf=true"]
    m = train_in_process(overrides, tmp_path / "run", cache)
    assert m["status"] == "completed" and m["global_step"] == 2

    tok = _tokenizer(model_dir)
    vocab = max(tok.get_vocab().values()) + 1
    (entry,) = (cache / "data").iterdir()  # one cache entry: the model's tokenizer, no BPE was trained
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["tokenizer"]["dir"] == str(model_dir) and meta["vocab_size"] == vocab
    # the ids trained on are the tokenizer's: the first document (ch00.txt) is tokenizer(text) + EOS
    tokens = np.load(entry / "tokens.npy")
    expected = tok(texts[0].strip())["input_ids"] + [tok.eos_token_id]
    assert tokens[: len(expected)].tolist() == expected
    assert int((tokens == tok.eos_token_id).sum()) == 10 and tokens.max() < vocab
    if family == "llama":
        assert expected[0] == tok.bos_token_id == 1  # the tokenizer's own BOS starts each document
    bpe = tokmod.wrap(tokmod.train_bpe(texts[:10], 300))  # what the project's BPE would have fed it
    assert bpe(texts[0].strip())["input_ids"] != expected[:-1]

    resolved = (tmp_path / "run" / "config_resolved.yaml").read_text()
    assert f"vocab_size: {vocab}" in resolved and f"tokenizer: {model_dir}" in resolved  # no '***'

    export = tmp_path / "run" / "export" / "hf"
    exported = _tokenizer(export)
    assert type(exported) is type(tok)
    for text in SAMPLES + [texts[11]]:
        assert exported(text)["input_ids"] == tok(text)["input_ids"], text
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (export / f).read_bytes() == (model_dir / f).read_bytes()  # shipped as it was
    exported_config = json.loads((export / "config.json").read_text())
    assert exported_config["eos_token_id"] == tok.eos_token_id


# -- the cache: one entry per (corpus, tokenizer files) ------------------------------------------


def test_two_tokenizers_on_one_corpus_never_share_ids(model_dirs, corpus_dir, texts, tmp_path, monkeypatch):
    # a second GPT-2-style tokenizer: same class, same vocabulary size, other training text
    other = tmp_path / "gpt2_other"
    build_tokenizer("gpt2", texts[6:12]).save_pretrained(other)
    source, cache = TextFilesCorpus(str(corpus_dir)), tmp_path / "cache"
    names = {"gpt2": model_dirs["gpt2"], "gpt2_other": other, "qwen2": model_dirs["qwen2"], "bpe": None}

    def datamodule(name):
        dm = LMDataModule(source, vocab_size=400, seq_len=16, batch_size=2, cache_dir=str(cache),
                          tokenizer=None if names[name] is None else str(names[name]))
        dm.setup("fit")
        return dm

    dms = {name: datamodule(name) for name in names}
    assert dms["gpt2"].vocab_size == dms["gpt2_other"].vocab_size == 400
    entries = {name: dm.cache_path for name, dm in dms.items()}
    assert len(set(entries.values())) == 4 and len(list(cache.iterdir())) == 4
    ids = {name: np.asarray(dm.train_dataset.tokens) for name, dm in dms.items()}
    assert not np.array_equal(ids["gpt2"][:200], ids["gpt2_other"][:200])
    assert tokmod.cache_key(source.fingerprint(), 400) == entries["bpe"].name  # the BPE's key is unchanged

    def boom(*args, **kwargs):
        raise AssertionError("re-encoded although the cache entry exists")

    monkeypatch.setattr("dsdebug.data.pretrained_tokenizer.PretrainedTokenizer.encode", boom)
    again = datamodule("gpt2")
    assert again.cache_path == entries["gpt2"]
    assert np.array_equal(np.asarray(again.train_dataset.tokens), ids["gpt2"])
    # an edited tokenizer file is another tokenizer: a new entry
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    with pytest.raises(AssertionError, match="re-encoded"):
        datamodule("gpt2_other")


def test_tokenizer_without_eos_is_refused_after_loading_too(tmp_path, corpus_dir, texts):
    """The same rule on the loaded tokenizer (what hub ids and class defaults rely on)."""
    from transformers import PreTrainedTokenizerFast

    no_eos = tmp_path / "no_eos"
    PreTrainedTokenizerFast(tokenizer_object=build_tokenizer("gpt2", texts[:4]).backend_tokenizer).save_pretrained(no_eos)
    with pytest.raises(ConfigError) as err:
        LMDataModule(TextFilesCorpus(str(corpus_dir)), cache_dir=str(tmp_path / "c"), tokenizer=str(no_eos))
    message = str(err.value)
    assert "no eos_token" in message and str(no_eos / "tokenizer_config.json") in message
    assert "<|endoftext|>" in message  # the candidates


def test_hub_id_tokenizer_from_the_local_hf_cache(model_dirs, corpus_dir, tmp_path, monkeypatch):
    """A hub id is fetched (here: found offline in a Hugging Face cache) and known only once loaded:
    data.vocab_size, and the random-init model that interpolates it, follow it at build time."""
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--fake-org--gpt2-tok" / "snapshots" / ("0" * 40)
    shutil.copytree(model_dirs["gpt2"], snapshot, ignore=shutil.ignore_patterns("*.safetensors", "*config.json"))
    shutil.copy(model_dirs["gpt2"] / "tokenizer_config.json", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    overrides = SMOKE + [
        *TINY_NET, "+model.tokenizer=fake-org/gpt2-tok", "data=text_files", f"data.source.paths={corpus_dir}",
        "strategy=ddp", "trainer.max_steps=1", "export.hf=false"]
    m = train_in_process(overrides, tmp_path / "run", tmp_path / "cache")
    assert m["status"] == "completed"
    state = torch.load(tmp_path / "run" / "export" / "model_fp32.pt", weights_only=True)["state_dict"]
    assert state["net.embed.weight"].shape[0] == 400  # model.net.vocab_size=${data.vocab_size} followed
    (entry,) = (tmp_path / "cache" / "data").iterdir()
    assert json.loads((entry / "meta.json").read_text())["tokenizer"]["name"] == "fake-org/gpt2-tok"
    # the config the run wrote is the one it used (the report and a resume read it); the plan says why
    written = OmegaConf.load(tmp_path / "run" / "config_resolved.yaml")
    assert written.data.vocab_size == written.model.net.vocab_size == 400
    plan = json.loads((tmp_path / "run" / "run_plan.json").read_text())
    assert plan["vocab_size"] == 400
    assert [a["used"] for a in plan["adjustments"] if a["key"] == "data.vocab_size"] == [400]
    # ... so a resume in place compares equal configs and continues
    again = train_in_process([*overrides[:-2], "trainer.max_steps=2", "export.hf=false", "resume=auto"],
                             tmp_path / "run", tmp_path / "cache")
    assert again["status"] == "completed" and again["global_step"] == 2 and again["resumed_from"]
    resume = json.loads((tmp_path / "run" / "run_plan.json").read_text())["resume"]
    assert resume["in_place_step"] == 1 and resume["checkpoint"] == again["resumed_from"], resume
    # checked against the built model too: a fixed embedding smaller than the tokenizer
    with pytest.raises(ConfigError, match="data.tokenizer=fake-org/gpt2-tok: the tokenizer has 400 token ids but "
                                          r"vocab_size=300 in the model's config \(model.net\)"):
        train_in_process([*overrides, "model.net.vocab_size=300"], tmp_path / "run2", tmp_path / "cache")


def test_hub_tokenizer_that_cannot_be_fetched(corpus_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as err:
        LMDataModule(TextFilesCorpus(str(corpus_dir)), cache_dir=str(tmp_path), tokenizer="no-org/not-cached")
    message = str(err.value)
    assert message.startswith("data.tokenizer=no-org/not-cached: cannot fetch the tokenizer of hub id")
    assert "valid: a local tokenizer directory, or a hub id that is cached or reachable" in message


# -- the choice of tokenizer, settled before anything is built -----------------------------------


def _settled(overrides, monkeypatch):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dsdebug.config.tokenizer_check import settle_tokenizer
    from dsdebug.config.validate import validate_config

    monkeypatch.setenv("PROJECT_ROOT", str(REPO))
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    GlobalHydra.instance().clear()
    validate_config(cfg)
    settle_tokenizer(cfg)
    return cfg


def test_which_tokenizer_is_used(model_dirs, tmp_path, texts, caplog, monkeypatch):
    bare = tmp_path / "bare"  # a pretrained model saved without its tokenizer
    save_model_dir("gpt2", bare, texts[:4], with_tokenizer=False)
    with caplog.at_level(logging.WARNING, logger="dsdebug.config.tokenizer_check"):
        cfg = _settled(["model=hf_pretrained", f"model.net.name_or_path={bare}", "data.vocab_size=300"], monkeypatch)
        assert cfg.data.tokenizer is None and cfg.data.vocab_size == 300  # today's fresh BPE...
        (warning,) = [r.getMessage() for r in caplog.records]  # ...with a warning that says so
        assert f"model.net.name_or_path={bare} has no tokenizer files" in warning
        assert "model.tokenizer=" in warning
        caplog.clear()
        cfg = _settled(["model=hf_pretrained", f"model.net.name_or_path={model_dirs['gpt2']}", "model.tokenizer=null",
                        "data.vocab_size=300"], monkeypatch)
        assert cfg.data.tokenizer is None and caplog.records[0].getMessage().startswith("model.tokenizer=null: the corpus is encoded with a BPE")
        caplog.clear()
        # the model's own tokenizer: data.vocab_size follows it (no warning)
        cfg = _settled(["model=hf_pretrained", f"model.net.name_or_path={model_dirs['qwen2']}"], monkeypatch)
        assert cfg.data.tokenizer == str(model_dirs["qwen2"]) and cfg.data.vocab_size == 453
        # another tokenizer for the same model, and a pretrained tokenizer for a random-init model
        cfg = _settled(["model=hf_pretrained", f"model.net.name_or_path={bare}",
                        f"model.tokenizer={model_dirs['gpt2']}"], monkeypatch)
        assert cfg.data.tokenizer == str(model_dirs["gpt2"]) and cfg.data.vocab_size == 400
        cfg = _settled([f"+model.tokenizer={model_dirs['llama']}"], monkeypatch)
        assert cfg.data.vocab_size == cfg.model.net.vocab_size == 559
        # the default stays the BPE trained on the corpus; synthetic data has no tokenizer
        assert _settled([], monkeypatch).data.tokenizer is None
        cfg = _settled(["data=synthetic", f"+model.tokenizer={model_dirs['gpt2']}"], monkeypatch)
        assert "tokenizer" not in cfg.data and cfg.data.vocab_size == 4096
        assert caplog.records == []


# -- a tokenizer that does not fit the model: one line, exit code 2 ------------------------------


def _config_only_dir(path: Path, family: str, tokenizer, **config) -> Path:
    """config.json + tokenizer files, no weights: the checks read only these."""
    build_model(family, tokenizer, **config).config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("case", ["tokenizer_over_model_vocab", "eos_id_disagrees", "no_eos",
                                  "vocab_size_contradicts", "tokenizer_dir_without_tokenizer",
                                  "tokenizer_dir_missing", "tokenizer_json_garbled"])
def test_tokenizer_that_does_not_fit_the_model_is_one_line(case, model_dirs, texts, tmp_path, shared_cache, capsys):
    from transformers import PreTrainedTokenizerFast

    gpt2 = build_tokenizer("gpt2", texts[:4])
    model_dir, extra = tmp_path / "model", []
    if case == "tokenizer_over_model_vocab":
        _config_only_dir(model_dir, "gpt2", gpt2, vocab_size=300)
        needles = [f"model.net.name_or_path={model_dir}: the tokenizer has 400 token ids but vocab_size=300 in "
                   f"{model_dir / 'config.json'}", "valid: a tokenizer with at most 300 ids"]
    elif case == "eos_id_disagrees":
        _config_only_dir(model_dir, "gpt2", gpt2, eos_token_id=50256)  # GPT-2's real id, not this tokenizer's
        needles = [f"{model_dir / 'config.json'}: eos_token_id=50256 disagrees with model.net.name_or_path="
                   f"{model_dir}, whose eos_token '<|endoftext|>' is id 0", "valid: eos_token_id=0"]
    elif case == "no_eos":
        _config_only_dir(model_dir, "gpt2", PreTrainedTokenizerFast(tokenizer_object=gpt2.backend_tokenizer))
        needles = ["the tokenizer has no eos_token, but packing separates documents with it",
                   str(model_dir / "tokenizer_config.json"), "<|endoftext|>"]
    elif case == "vocab_size_contradicts":
        shutil.copytree(model_dirs["gpt2"], model_dir)
        extra = ["data.vocab_size=4096"]
        needles = [f"data.vocab_size=4096 contradicts model.net.name_or_path={model_dir}, which has 400 token ids",
                   "drop the override (or give data.vocab_size=400)"]
    elif case == "tokenizer_dir_without_tokenizer":
        shutil.copytree(model_dirs["gpt2"], model_dir)
        (tmp_path / "empty").mkdir()
        extra = [f"model.tokenizer={tmp_path / 'empty'}"]
        needles = [f"model.tokenizer={tmp_path / 'empty'} holds no tokenizer", "tokenizer.save_pretrained"]
    elif case == "tokenizer_dir_missing":
        shutil.copytree(model_dirs["gpt2"], model_dir)
        extra = [f"model.tokenizer={tmp_path / 'nope'}"]
        needles = [f"model.tokenizer={tmp_path / 'nope'}: no such directory", "hub id 'org/name'"]
    else:
        shutil.copytree(model_dirs["gpt2"], model_dir)
        (model_dir / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0,}}}')
        needles = [f"model.net.name_or_path={model_dir}: {model_dir / 'tokenizer.json'} is unreadable or not JSON"]
    lines = cli_error_lines(SMOKE + ["model=hf_pretrained", f"model.net.name_or_path={model_dir}", *extra],
                            tmp_path / "logs", shared_cache, capsys)
    assert_one_line_error(lines, needles)
