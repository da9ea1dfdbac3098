"""Planted bugs for the preflight doctor's probes (tests/doctor/), and healthy witnesses.

Each net is a small causal LM (``forward(input_ids) -> logits [B, T, V]``) with one bug in one
named module, so a probe must name that module. Runs name them by ``_target_``, e.g.
``model.net._target_=tests.planted.doctor_nets.NoMaskLM``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Single-head self-attention; ``causal=False`` is the planted missing mask."""

    def __init__(self, hidden: int, causal: bool = True) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal))


class TinyCausalLM(nn.Module):
    """Healthy: embedding -> pre-norm attention block -> MLP -> head (a random init near ln V)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, causal: bool = True, **_: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, causal)
        self.mix = nn.Identity()
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab_size)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + self.attn(self.norm1(h))
        h = self.mix(h)
        h = h + self.mlp(self.norm2(h))
        return self.head(h)


class NoMaskLM(TinyCausalLM):
    """Causality broken by attention without a causal mask: culprit ``attn`` (its inner op)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden, causal=False)


class LookAhead(nn.Module):
    """Adds the next position's features (a roll the wrong way): a future-token leak."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.roll(x, shifts=-1, dims=1)


class LookAheadLM(TinyCausalLM):
    """Causality broken by a look-ahead after a causal attention: culprit ``mix``."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.mix = LookAhead()


class SequenceContext(nn.Module):
    """Adds the mean over the whole sequence to every position (a 'global context' vector): each
    position sees the average of the future too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.mean(dim=1, keepdim=True)


class SequenceContextLM(TinyCausalLM):
    """Causality broken by a sequence mean (not attention, not a shift): culprit ``mix``."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.mix = SequenceContext()


class BatchCenter(nn.Module):
    """Subtracts the batch mean (a 'centering' written over dim 0): samples depend on each other in
    train and eval mode alike."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


class BatchCenterLM(TinyCausalLM):
    """Sample independence broken without batch norm or a reshape: culprit ``mix``."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.mix = BatchCenter()


class TokenBatchNorm(nn.Module):
    """BatchNorm over every token of the batch (statistics shared by all samples in train mode)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        return self.bn(x.reshape(b * t, h)).reshape(b, t, h)


class BatchNormLM(TinyCausalLM):
    """Samples coupled through batch statistics (and train != eval): culprit ``mix`` (its ``bn``)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.mix = TokenBatchNorm(hidden)


class ViewMixer(nn.Module):
    """A [B, T, H] tensor viewed as [T, B, H] (view instead of transpose), smoothed over the
    'time' dim, viewed back: rows of different samples are mixed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = x.reshape(t, b, h)
        y = y + 0.5 * torch.cat([y[:1], y[:-1]], dim=0)  # "previous time step" of the wrong axis
        return y.reshape(b, t, h)


class ViewMixLM(TinyCausalLM):
    """Sample independence broken by a reshape mixing batch and sequence: culprit ``mix``."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.mix = ViewMixer()


class HotHeadLM(TinyCausalLM):
    """Logits far too large at init (head std 3 instead of 0.02): init loss far above ln V, culprit ``head``."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        nn.init.normal_(self.head.weight, std=3.0)
        nn.init.normal_(self.embed.weight, std=1.0)


class ScaledDrop(nn.Module):
    """A hand-written dropout (rate in ``rate``, not a 'dropout' attribute, its own randomness): train drops and
    rescales by 1/(1 - rate) (inverted dropout), and eval scales by (1 - rate) as well -- the two conventions
    mixed up, so eval is (1 - rate) x what train gives on average."""

    def __init__(self, rate: float = 0.3) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return x * (torch.rand_like(x) >= self.rate) / (1 - self.rate)
        return x * (1 - self.rate)


class HandDropLM(TinyCausalLM):
    """Train and eval part at ``mix``."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.mix = ScaledDrop()


class DropPath(nn.Module):
    """Stochastic depth (timm's drop_path): each sample's branch is kept with probability 1 - rate and rescaled
    by 1/(1 - rate) in train, identity in eval. ``eval_off=True`` is the planted bug: eval drops the branch
    altogether (a rate read as "always drop when not training")."""

    def __init__(self, rate: float = 0.2, eval_off: bool = False) -> None:
        super().__init__()
        self.rate, self.eval_off = rate, eval_off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return torch.zeros_like(x) if self.eval_off else x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - self.rate)
        return x * keep / (1 - self.rate)


class DropPathLM(TinyCausalLM):
    """Healthy stochastic depth on the MLP branch (train stays random with every dropout off); ``eval_off``:
    eval drops the branch, culprit ``mlp_drop``."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, eval_off: bool = False, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.mlp_drop = DropPath(0.2, eval_off)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + self.attn(self.norm1(h))
        h = h + self.mlp_drop(self.mlp(self.norm2(h)))
        return self.head(h)


class BranchOffInEvalLM(DropPathLM):
    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden, eval_off=True)


class NanoGPTAttention(nn.Module):
    """nanoGPT's attention: the rate read from a config object (no float attribute named dropout on the module),
    passed to SDPA only in train mode, and an ``nn.Dropout`` on the residual."""

    def __init__(self, hidden: int, config: object) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.config, self.resid_dropout = config, nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.config.attn_p if self.training else 0, is_causal=True)
        return self.resid_dropout(self.c_proj(y))


class FunctionalDropoutLM(TinyCausalLM):
    """Healthy: every dropout functional, its rate where the author kept it -- SDPA's dropout_p from a config, a
    constant ``F.dropout`` in the MLP, ``torch.dropout`` on the embeddings."""

    class Config:
        attn_p = 0.2

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.attn = NanoGPTAttention(hidden, self.Config())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = torch.dropout(self.embed(input_ids), 0.1, self.training)
        h = h + self.attn(self.norm1(h))
        h = h + F.dropout(self.mlp(self.norm2(h)), 0.3, self.training)
        return self.head(h)


class EvalNormalizer(nn.Module):
    """Divides by a running variance that is only updated in train mode (0 at init): eval is inf/NaN."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.register_buffer("running_var", torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return x
        return x / self.running_var.sqrt()


class EvalNaNLM(TinyCausalLM):
    """The eval forward is not finite; culprit ``mix``."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.mix = EvalNormalizer(hidden)


class DeadBranchLM(TinyCausalLM):
    """A trainable projection that never reaches the loss (its output is computed and dropped): no gradient."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.unused = nn.Linear(hidden, hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        self.unused(h.detach())
        return super().forward(input_ids)


class InPlaceFrozenLM(TinyCausalLM):
    """A frozen 'scale' parameter updated in place by forward (a running statistic kept as a parameter)."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.scale = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.99)
        return super().forward(input_ids)


def _drop_embed(module: nn.Module, state_dict: dict, prefix: str, local_metadata: object) -> None:
    state_dict.pop(prefix + "embed.weight", None)


class DropsFrozenFromStateDict(TinyCausalLM):
    """A frozen embedding left out of state_dict (as some adapter savers do; a state-dict hook, so a
    parent module's state_dict drops it too) and a non-strict load."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 32, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.embed.weight.requires_grad_(False)
        self._register_state_dict_hook(_drop_embed)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: ANN001
        return super().load_state_dict(state_dict, strict=False, assign=assign)


def build_tiny_gpt2(vocab_size: int = 4096, hidden: int = 64, layers: int = 2, heads: int = 2,
                    max_positions: int = 128, **_: object) -> nn.Module:
    """A healthy HF family (GPT-2) from a config, random init: ``model.net._target_=...build_tiny_gpt2``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions)
    return GPT2LMHeadModel(config)


def build_tiny_llama(vocab_size: int = 4096, hidden: int = 64, layers: int = 2, heads: int = 2,
                     max_positions: int = 128, **_: object) -> nn.Module:
    """A healthy Llama (RoPE, RMSNorm, SwiGLU, grouped KV heads) from a config, random init."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
                         max_position_embeddings=max_positions)
    return LlamaForCausalLM(config)


def build_tiny_mixtral(vocab_size: int = 4096, hidden: int = 64, layers: int = 2, heads: int = 2,
                       max_positions: int = 128, **_: object) -> nn.Module:
    """A healthy Mixtral-style MoE (4 experts, top-2) from a config, random init."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=max_positions)
    return MixtralForCausalLM(config)
