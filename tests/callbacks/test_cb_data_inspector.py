"""data_inspector: first batch saved and decoded, identical batches across ranks, train/val
overlap, data order vs an earlier run with the same seed, label shift sanity. The 2-process
cases read the shared planted and healthy DDP runs (tests/helpers/shared_runs.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dsdebug.callbacks.data_inspector import DataInspector
from dsdebug.callbacks.data_inspector.fingerprint import find_overlap, label_pattern, window_hashes
from dsdebug.errors import ConfigError
from tests.helpers.findings import of, read_findings
from tests.helpers.shared_runs import data_run, healthy_run, planted_ddp_run


def test_first_batch_is_saved_with_decoded_text_and_healthy_run_is_silent(tmp_path_factory, shared_cache):
    run_dir, findings = data_run("healthy", tmp_path_factory, shared_cache)
    assert of(findings, "data_inspector") == []
    first = json.loads((run_dir / "data_inspector" / "first_batch_rank0.json").read_text())
    assert first["tensors"]["input_ids"]["shape"] == [8, 128] and first["tensors"]["input_ids"]["dtype"] == "int64"
    assert first["padding_ratio"] == 0.0 and first["labels"]["pattern"] == "same"
    assert len(first["decoded"]) == 2 and all(sum(c.isalpha() for c in t) > 50 for t in first["decoded"])
    saved = torch.load(run_dir / "data_inspector" / "first_batch_rank0.pt")
    assert saved["input_ids"].shape == (8, 128)
    assert first["decoded"][0][:40] in (run_dir / "train.log").read_text()  # printed, not only saved
    order = json.loads((run_dir / "data_inspector" / "data_order_rank0.json").read_text())
    assert order["seed"] == "42" and len(order["batches"]) == 5 and order["data_fingerprint"]


def test_same_seed_same_order_is_silent_and_workers_are_reported(tmp_path_factory, shared_cache):
    _, findings = data_run("healthy_again", tmp_path_factory, shared_cache)  # data.num_workers=1
    assert of(findings, "data_inspector") == []
    match = [f for f in findings if f["code"] == "data_order_matches"]
    assert match and "batches 0..4" in match[0]["message"]
    workers = [f for f in findings if f["code"] == "workers"]
    assert workers and workers[0]["details"]["num_workers"] == 1
    assert workers[0]["details"]["worker_init_fn"] == "seed_worker" and "every rank" in workers[0]["message"]


def test_planted_data_bugs_are_found_and_named(tmp_path_factory, shared_cache):
    _, findings = data_run("planted", tmp_path_factory, shared_cache)
    bad = {f["code"]: f for f in of(findings, "data_inspector")}
    # a sampler that ignores the seed: same seed + data as the earlier run, different order
    changed = bad["data_order_changed"]
    assert changed["rank"] == 0 and "batch 0 differs" in changed["message"] and "same seed 42" in changed["message"]
    # val = train text shifted by half a block: no exact copy, every val block shares a span
    leak = bad["train_val_overlap"]
    assert leak["details"]["ngram_overlap"] == leak["details"]["val_samples"] > 0
    assert "val sample 0 / train sample" in leak["message"] and leak["details"]["example"]["text"]
    # pre-shifted labels + CausalLMModule's own shift
    assert bad["label_double_shift"]["severity"] == "error" and "t+2" in bad["label_double_shift"]["message"]
    assert set(bad) == {"data_order_changed", "train_val_overlap", "label_double_shift"}


def test_disabled_distributed_sampler_gives_identical_batches_named(tmp_path_factory, shared_cache):
    run_dir, _ = planted_ddp_run(tmp_path_factory, shared_cache)  # trainer.use_distributed_sampler=false
    bad = of(read_findings(run_dir), "data_inspector")
    assert [f["code"] for f in bad] == ["identical_batches_across_ranks"]
    f = bad[0]
    assert f["severity"] == "error" and f["step"] == 0 and f["rank"] is None
    assert "rank 0 and rank 1" in f["message"] and "step 0" in f["message"]
    assert (run_dir / "data_inspector" / "data_order_rank1.json").is_file()


def test_healthy_ddp_two_ranks_is_silent(tmp_path_factory, shared_cache):
    run_dir, _ = healthy_run("ddp", tmp_path_factory, shared_cache)
    assert of(read_findings(run_dir), "data_inspector") == []
    orders = [json.loads((run_dir / "data_inspector" / f"data_order_rank{r}.json").read_text())["batches"]
              for r in (0, 1)]
    assert not set(orders[0]) & set(orders[1])  # the distributed sampler gives each rank other batches


def test_overlap_scan_finds_exact_copies_and_shared_spans():
    rng = np.random.default_rng(0)
    train = [rng.integers(0, 1000, 64) for _ in range(50)]
    val = [train[7].copy(), np.concatenate([rng.integers(0, 1000, 20), train[3][10:54]]), rng.integers(0, 1000, 64)]
    r = find_overlap(train, val, 32)
    assert r["exact"] == 1 and r["ngram_overlap"] == 2 and r["example"]["train_index"] == 7
    hashes, sample, offset = window_hashes(train[:2], 16)
    assert len(hashes) == 2 * (64 - 16 + 1) and set(sample.tolist()) == {0, 1} and offset.max() == 48
    assert find_overlap(train, [rng.integers(0, 1000, 64)], 32)["ngram_overlap"] == 0


def test_short_samples_that_repeat_by_chance_are_not_a_leak_but_copies_beyond_that_rate_are():
    """2-token samples of natural text repeat within train as often as between train and val: the text's own
    repetition (data.seq_len=2 gave a train_val_overlap warning on a clean split). A copied val set of such
    samples, or any copy among unique long samples, is still a leak."""
    from dsdebug.callbacks.data_inspector.dataset_checks import judge_overlap

    rng = np.random.default_rng(0)
    zipf = lambda n: np.minimum(rng.zipf(1.6, size=(n, 2)), 50).astype(np.int64)  # noqa: E731 - natural-ish bigrams
    train, val = list(zipf(2000)), list(zipf(200))
    r = find_overlap(train, val, 13)
    assert r["exact"] > 0 and r["train_self_duplicates"] > 0.5
    assert judge_overlap(r, 0.01) == (False, True)
    unique = [rng.integers(0, 4096, 8) for _ in range(900)]
    some_repeats = unique + [unique[i].copy() for i in range(100)]  # 200 of 1000 train samples repeat
    leaked = find_overlap(some_repeats, [unique[i] for i in range(300, 400)], 13)  # a copied val set
    assert abs(leaked["train_self_duplicates"] - 0.2) < 1e-9 and leaked["exact"] == 100
    assert judge_overlap(leaked, 0.01) == (True, False)  # 100 % copies against 20 % repetition: a leak
    copied = find_overlap(unique, [unique[3], rng.integers(0, 4096, 8)], 13)  # unique samples: any copy
    assert copied["train_self_duplicates"] == 0.0 and judge_overlap(copied, 0.01) == (True, False)


def test_label_patterns():
    ids = torch.arange(12).reshape(2, 6)
    assert label_pattern(ids, ids.clone()) == "same"
    shifted = torch.full_like(ids, -100)
    shifted[:, :-1] = ids[:, 1:]
    assert label_pattern(ids, shifted) == "shifted"
    assert label_pattern(ids, torch.full_like(ids, -100)) == "ignored"


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"compare_with": "/no/such/run"},
                                    {"overlap_warn_fraction": 2}])
def test_bad_values_are_config_errors(kwargs):
    with pytest.raises(ConfigError, match=r"callbacks\.data_inspector\.\w+=.*valid"):
        DataInspector(**kwargs)



# ---- batch content: a corrupt batch among text batches, from the first steps ------------------------

@pytest.mark.parametrize("mode, onset, kind", [("zeros", 3, "one_token"), ("random", 8, "random_ids")])
def test_a_corrupt_batch_is_named_at_its_step(mode, onset, kind, tmp_path, shared_cache):
    """On the tiny MLP, whose loss barely moves on these batches (loss_spike cannot tell them from noise),
    the batch's own tokens name it: one token fills it, or its ids look random. Healthy steps: silent."""
    from tests.helpers.runs import SMOKE, TINY_NET, train_in_process

    run_dir = tmp_path / "run"
    train_in_process(SMOKE + TINY_NET + ["+callbacks=data_inspector", f"trainer.max_steps={onset + 3}",
                                         "export.hf=false", "export.fp32=false", "trainer.val_check_interval=100",
                                         "+callbacks.plant._target_=tests.planted.early.CorruptBatch",
                                         f"+callbacks.plant.step={onset}", f"+callbacks.plant.mode={mode}"],
                     run_dir, shared_cache)
    found = [r for r in read_findings(run_dir, "data_inspector") if r["code"] == "batch_unlike_the_others"]
    assert [(r["step"], r["details"]["kind"]) for r in found] == [(onset, kind)], found


def test_batch_content_rules_on_numbers():
    from dsdebug.callbacks.data_inspector.batch_content import BatchContent

    torch.manual_seed(0)  # the Zipf samples draw from the global generator
    text = BatchContent()
    g = torch.Generator().manual_seed(0)
    zipf = torch.distributions.Categorical(probs=1 / torch.arange(1, 4097).float())
    for step in range(4):  # Zipf-like "text" batches
        assert text.measure(zipf.sample((8, 128)), None, step, step) == []
    assert text.measure(torch.randint(0, 4096, (8, 128), generator=g), None, 4, 4) == []  # queued: read later
    assert text.measure(torch.zeros(8, 128, dtype=torch.long), None, 5, 5) == []
    found = text.flush()  # one host read for the queue; each batch judged in order, at its own step
    assert [(f["kind"], f["step"]) for f in found] == [("random_ids", 4), ("one_token", 5)]
    labels = torch.full((8, 128), -100)
    text.measure(zipf.sample((8, 128)), labels, 6, 6)
    assert [f["kind"] for f in text.flush()] == ["no_tokens"]
    every = BatchContent(read_every=3)  # the queue is read by itself every read_every batches
    assert every.measure(zipf.sample((8, 128)), None, 0, 0) == [] and every.measure(zipf.sample((8, 128)), None, 1, 1) == []
    assert every.measure(zipf.sample((8, 128)), torch.full((8, 128), -100), 2, 2)[0]["kind"] == "no_tokens"
    assert every._queued == []
    short = BatchContent()  # a short text batch among long ones has more distinct ids: no evidence of random ids
    for step in range(6):
        short.measure(zipf.sample((8, 512)), None, step, step)
    short.measure(zipf.sample((1, 64)), None, 6, 6)
    assert short.flush() == []
    d, median = short.distinct[-1], sorted(short.distinct[:-1])[2]
    assert d >= 1.8 * median and d >= median + 0.2, (d, median)  # what would have been called random ids
    synthetic = BatchContent()  # random-token data judged against its own batches: silent
    for step in range(6):
        assert synthetic.measure(torch.randint(0, 4096, (8, 128), generator=g), None, step, step) == []
    assert synthetic.flush() == []
