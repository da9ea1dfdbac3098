"""Packing documents (src/data/packing.py): positions restart per document, no attention across documents.

The probe changes one document and measures the other documents' logits on a DeepSeek-V3 net (weights
drawn at std 0.3 so that attention matters at this size): 0 with the document mask, ~10 for the plain
causal mask with running positions (today's fixed blocks) -- the planted case. A document alone and the
same document inside a pack give the same logits (float rounding)."""

from __future__ import annotations

import pytest
import torch

from dsdebug.data.packing import (
    cross_document_change,
    document_mask,
    pack_documents,
    padding_fraction,
    positions_not_reset,
)
from dsdebug.models.deepseek import build_deepseek_v3

LENGTHS = (10, 7, 12, 5)


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    model = build_deepseek_v3(vocab_size=128, hidden_size=64, num_hidden_layers=2, max_position_embeddings=64).eval()
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, 0, 0.3)
    return model


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in LENGTHS]
    return docs, pack_documents(docs, 32)


def test_every_document_lands_whole_with_positions_from_zero(batch):
    docs, b = batch
    assert b["input_ids"].shape == (2, 32)  # 12+10+7 in one row, 5 in the next (first fit decreasing)
    placed = sorted(b["input_ids"][r, b["doc_ids"][r] == d].tolist() for r in range(2) for d in range(3)
                    if (b["doc_ids"][r] == d).any())
    assert placed == sorted(docs)
    assert positions_not_reset(b["position_ids"], b["doc_ids"]) == []
    starts = (b["position_ids"] == 0) & (b["doc_ids"] >= 0)
    assert (b["labels"][starts] == -100).all() and (b["labels"][b["doc_ids"] < 0] == -100).all()
    assert padding_fraction(b["doc_ids"]) == pytest.approx((64 - sum(LENGTHS)) / 64)


def test_running_positions_are_named():
    b = pack_documents([[1, 2, 3], [4, 5]], 8)
    running = torch.arange(8).expand(1, 8)  # what fixed blocks of a token stream give
    assert positions_not_reset(running, b["doc_ids"]) == [(0, 1)]


def test_a_long_document_is_split_into_documents_of_their_own():
    b = pack_documents([list(range(1, 20))], 8)
    assert b["input_ids"].shape[0] == 3 and positions_not_reset(b["position_ids"], b["doc_ids"]) == []


def test_mask_is_causal_within_documents_only():
    doc_ids = torch.tensor([[0, 0, 1, 1, -1]])
    m = document_mask(doc_ids)[0, 0]
    assert m[1, 0] and not m[0, 1] and not m[2, 1] and m[3, 2] and not m[4, 3] and m[4, 4]


def test_no_document_sees_another_with_the_mask(net, batch):
    _, b = batch  # the mask alone (running positions): HF's own detection from restarting positions is not used
    assert max(cross_document_change(net, b, 0, d, reset_positions=False) for d in range(3)) < 1e-4
    assert max(cross_document_change(net, b, 0, d) for d in range(3)) < 1e-4  # mask + positions, as meant


def test_hf_models_also_separate_documents_from_restarting_positions_alone(net, batch):
    _, b = batch  # transformers >= 4.54 builds the block-diagonal mask from position_ids that restart
    assert max(cross_document_change(net, b, 0, d, use_mask=False) for d in range(3)) < 1e-4


def test_the_probe_catches_attention_across_documents(net, batch):
    _, b = batch  # plain causal mask and running positions: the first documents leak into the later ones
    leak = [cross_document_change(net, b, 0, d, use_mask=False, reset_positions=False) for d in range(3)]
    assert leak[0] > 1 and leak[1] > 1 and leak[2] < 1e-4  # the last document has no one after it


def test_a_document_in_a_pack_computes_what_it_computes_alone(net, batch):
    _, b = batch
    where = b["doc_ids"][0] == 1
    with torch.no_grad():
        alone = net(input_ids=b["input_ids"][0:1, where]).logits
        packed = net(input_ids=b["input_ids"][0:1], attention_mask=document_mask(b["doc_ids"][0:1]),
                     position_ids=b["position_ids"][0:1]).logits[:, where]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
