"""model.gradient_checkpointing (src/models/grad_ckpt.py): the maths is unchanged, in both torch modes, on the
Hugging Face path (the DeepSeek nets) and the generic path (a net of one's own with an nn.ModuleList of blocks).

With the RNG replayed (torch's default) the recompute is the same computation, so on CPU loss and every
gradient are BITWISE equal to the run without checkpointing -- also with dropout on. The known silent
failure is reproduced here as the property the check (tests/callbacks/test_cb_grad_checkpointing.py) relies
on: reentrant + frozen embeddings on the generic path gives the blocks no gradient at all."""

from __future__ import annotations

import pytest
import torch

from dsdebug.errors import ConfigError
from dsdebug.models.deepseek import build_deepseek_v2, build_deepseek_v3
from dsdebug.models.grad_ckpt import (
    CKPT_ATTR,
    checkpointed_blocks,
    checkpointing_mode,
    checkpointing_suspended,
    enable_gradient_checkpointing,
)
from tests.planted.ckpt import BlockLM
from tests.planted.data import HealthyTinyLM

NETS = {
    "deepseek_v3": lambda: build_deepseek_v3(vocab_size=256, hidden_size=64, num_hidden_layers=3,
                                             max_position_embeddings=32),
    "deepseek_v2_dropout": lambda: build_deepseek_v2(vocab_size=256, hidden_size=64, num_hidden_layers=3,
                                                     max_position_embeddings=32, attention_dropout=0.2),
    "block_lm": lambda: BlockLM(vocab_size=256),
}


def _step(name: str, mode, freeze_embedding: bool = False):
    torch.manual_seed(0)
    net = NETS[name]().train()
    if freeze_embedding:
        (net.get_input_embeddings() if hasattr(net, "get_input_embeddings") else net.embed).weight.requires_grad_(False)
    blocks = enable_gradient_checkpointing(net, mode)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # dropout draws
    out = net(input_ids=ids)
    logits = out.logits if hasattr(out, "logits") else out
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in net.named_parameters() if p.requires_grad}, blocks


@pytest.mark.parametrize("name", sorted(NETS))
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_loss_and_gradients_bitwise_equal_to_the_run_without(name, mode):
    base_loss, base_grads, off = _step(name, False)
    loss, grads, blocks = _step(name, mode)
    assert off == [] and len(blocks) == 3, blocks
    assert torch.equal(loss, base_loss)
    assert grads.keys() == base_grads.keys()
    differ = [n for n in grads if grads[n] is None or not torch.equal(grads[n], base_grads[n])]
    assert differ == []


def test_dropout_really_draws_so_equality_is_not_vacuous():
    first, _, _ = _step("deepseek_v2_dropout", False)
    torch.manual_seed(0)
    net = NETS["deepseek_v2_dropout"]().train()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(6)  # other dropout draws: another loss
    logits = net(input_ids=ids).logits
    other = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    assert not torch.equal(first, other.detach())


def test_reentrant_with_frozen_embeddings_gives_the_blocks_no_gradient_on_a_plain_net():
    _, base, _ = _step("block_lm", False, freeze_embedding=True)
    _, non_reentrant, _ = _step("block_lm", "non_reentrant", freeze_embedding=True)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        _, reentrant, _ = _step("block_lm", "reentrant", freeze_embedding=True)
    in_blocks = [n for n in base if n.startswith("layers.")]
    assert in_blocks and all(base[n] is not None and non_reentrant[n] is not None for n in in_blocks)
    assert all(reentrant[n] is None for n in in_blocks)  # silently untrained: the check's reason to exist
    assert reentrant["head.weight"] is not None


def test_hf_models_make_the_embedding_output_require_grad_so_reentrant_is_safe_there():
    _, base, _ = _step("deepseek_v3", False, freeze_embedding=True)
    _, reentrant, _ = _step("deepseek_v3", "reentrant", freeze_embedding=True)
    assert all(reentrant[n] is not None and torch.equal(reentrant[n], base[n]) for n in base)


def test_blocks_are_marked_with_their_mode_and_listed_in_order():
    net = NETS["deepseek_v3"]()
    names = enable_gradient_checkpointing(net, "reentrant")
    assert names == ["model.layers.0", "model.layers.1", "model.layers.2"]
    found = checkpointed_blocks(net)
    assert list(found) == names and {mode for _, mode in found.values()} == {"reentrant"}
    plain = BlockLM(vocab_size=64)
    assert enable_gradient_checkpointing(plain, True) == ["layers.0", "layers.1", "layers.2"]
    assert getattr(plain.layers[0], CKPT_ATTR) == "non_reentrant"


def test_a_ds_config_activation_checkpointing_section_keeps_the_users_mode_and_marks_what_it_turns_on():
    """strategy=deepspeed_json with an "activation_checkpointing" section: a net the user checkpointed
    (reentrant here) keeps that mode; otherwise its blocks are checkpointed non-reentrant AND marked, so
    the grad_checkpointing check judges what really runs (HF nets and plain nets of blocks alike)."""
    from dsdebug.trainer.strategy import enable_activation_checkpointing

    section = {"activation_checkpointing": {"partition_activations": False}}
    mine = NETS["deepseek_v3"]()
    enable_gradient_checkpointing(mine, "reentrant")
    enable_activation_checkpointing(section, mine, is_global_zero=True)
    assert {mode for _, mode in checkpointed_blocks(mine).values()} == {"reentrant"}
    for name, blocks in (("deepseek_v3", 3), ("block_lm", 3)):
        net = NETS[name]()
        enable_activation_checkpointing(section, net, is_global_zero=True)
        found = checkpointed_blocks(net)
        assert len(found) == blocks and {mode for _, mode in found.values()} == {"non_reentrant"}, name
    untouched = NETS["block_lm"]()
    enable_activation_checkpointing({}, untouched, is_global_zero=True)  # no section: nothing
    assert checkpointed_blocks(untouched) == {}


def test_off_leaves_the_net_untouched():
    net = BlockLM(vocab_size=64)
    assert enable_gradient_checkpointing(net, False) == [] and checkpointed_blocks(net) == {}
    assert "forward" not in net.layers[0].__dict__


def test_suspended_forward_runs_without_checkpointing():
    net = BlockLM(vocab_size=64).train()
    enable_gradient_checkpointing(net, "non_reentrant")
    h = torch.randn(2, 4, 64, requires_grad=True)
    with checkpointing_suspended(net.layers[0]) as forward:
        out = forward(h)
    assert out.grad_fn is not None and "Checkpoint" not in type(out.grad_fn).__name__
    assert torch.equal(out, net.layers[0](h))


@pytest.mark.parametrize("value, mode", [(False, None), ("false", None), (None, None), (True, "non_reentrant"),
                                         ("true", "non_reentrant"), ("reentrant", "reentrant"),
                                         ("NON_REENTRANT", "non_reentrant")])
def test_values(value, mode):
    assert checkpointing_mode(value) == mode


def test_bad_value_and_a_net_without_blocks_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"model.gradient_checkpointing='sometimes' is invalid; valid: false, true"):
        checkpointing_mode("sometimes")
    with pytest.raises(ConfigError, match=r"HealthyTinyLM has no Hugging Face gradient checkpointing and no "
                                          r"nn.ModuleList"):
        enable_gradient_checkpointing(HealthyTinyLM(vocab_size=64), True)
