"""Packing is exact: a row of packed documents (positions restarting, the 4-D document mask, labels -100
on each document's first token) gives the loss of the same documents run one at a time -- the sum of
their token losses over the count of their predicted tokens -- through ``CausalLMModule`` (the path
training takes), for the project's DeepSeek-V3 net and a Hugging Face GPT-2 (learned absolute
positions: it also needs the positions to restart) and Llama (RoPE), random init from a config, no
download. The same rows through a module that drops the mask and positions (the planted bug) do not.

And across ranks: the loss of a step whose ranks carry different token counts is the mean over all
ranks' tokens: two gloo processes with unequal batches end with the gradients of one process over
all the tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsdebug.data.packing import pack_documents
from dsdebug.models.deepseek import build_deepseek_v3
from dsdebug.models.lm_module import CausalLMModule
from tests.planted.packing import MaskDroppedLM

VOCAB = 128
LENGTHS = (23, 9, 31, 14, 6, 40, 17)


def _deepseek():
    return build_deepseek_v3(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=64)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


NETS = {"deepseek_v3": _deepseek, "gpt2": _gpt2, "llama": _llama}


def _docs(seed: int = 0, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _one_at_a_time(net, docs) -> torch.Tensor:
    total, count = torch.zeros((), dtype=torch.float64), 0
    for doc in docs:
        ids = torch.tensor([doc])
        logits = net(input_ids=ids).logits.float()
        total += F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").double()
        count += len(doc) - 1
    return total / count


def _module(cls, net):
    return cls(net=net, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), moe_aux_loss_coef=0)


@pytest.mark.parametrize("family", sorted(NETS))
def test_packed_loss_equals_the_documents_one_at_a_time(family):
    torch.manual_seed(0)
    net = NETS[family]().eval()
    docs = _docs()
    batch = pack_documents(docs, 64)
    assert batch["doc_ids"].amax(dim=1).max() >= 2  # rows of several documents
    reference = _one_at_a_time(net, docs)
    with torch.no_grad():
        for training in (True, False):  # training: the global token mean; eval: the plain mean
            loss, _ = _module(CausalLMModule, net)._losses(batch, training=training)
            assert float(loss) == pytest.approx(float(reference), rel=1e-5, abs=1e-6), (family, training)
        dropped, _ = _module(MaskDroppedLM, net)._losses(batch, training=True)
    assert abs(float(dropped) - float(reference)) > 1e-3  # the planted bug: documents see each other


class _Strategy:
    def reduce(self, tensor, reduce_op="sum"):
        import torch.distributed as dist

        out = tensor.clone()
        dist.all_reduce(out)
        return out


class _Trainer:
    world_size = 2
    strategy = _Strategy()


def _rank_grads(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    module = _module(CausalLMModule, _deepseek())
    module._trainer = _Trainer()
    docs = _docs(seed=1)
    mine = docs[:2] if rank == 0 else docs[2:]  # 30 vs 108 tokens: unequal counts
    loss, _ = module._losses(pack_documents(mine, 64), training=True)
    loss.backward()
    for p in module.parameters():  # what DDP / DeepSpeed do: average the gradients over the ranks
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 2
    if rank == 0:
        torch.save({n: p.grad for n, p in module.named_parameters() if p.grad is not None}, out)
    dist.destroy_process_group()


def test_two_ranks_with_unequal_tokens_get_the_gradient_of_one_process_over_all_tokens(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "grads.pt")
    mp.start_processes(_rank_grads, args=(port, out), nprocs=2, start_method="spawn")
    torch.manual_seed(0)
    module = _module(CausalLMModule, _deepseek())  # the same init
    loss, _ = module._losses(pack_documents(_docs(seed=1), 64), training=True)
    loss.backward()
    two = torch.load(out)
    assert two.keys() == {n for n, p in module.named_parameters() if p.grad is not None}
    worst = max(float((two[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-12))
                for n, p in module.named_parameters() if p.grad is not None)
    assert worst < 1e-4
