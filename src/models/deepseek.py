"""Tiny DeepSeek-V3 / V2 language models, built offline with random init.

What the tiny models are for: exercising the real DeepSeek architecture (MLA attention with
low-rank q/kv projections, MoE layers with routed + shared experts, a dense first layer,
group-limited top-k routing) end to end -- DeepSpeed ZeRO stages, checkpoint conversion,
the debugging callbacks, the MoE load-balance loss -- in seconds on a 2-core CPU. They are not
meant to learn anything useful; the defaults (hidden 256, 4 layers, 8 routed + 1 shared
experts, top-2, vocab 4096) give ~8.7M parameters and a forward+backward of a few tenths of a
second for 8x128 tokens on 2 CPU cores.

Hydra builds them from ``conf/model/*.yaml``, e.g.::

    net:
      _target_: dsdebug.models.deepseek.build_deepseek_v3
      num_hidden_layers: 2          # any DeepseekV3Config field can be overridden here

Runs on every rank; nothing here calls a collective.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedModel,
)

from dsdebug.errors import ConfigError
from dsdebug.models.mla_attention import SDPA_PAD_V  # noqa: F401 - registers attn_implementation="sdpa_pad_v"

__all__ = ["FAST_EXPERTS_IMPLEMENTATION", "build_deepseek_v2", "build_deepseek_v3", "experts_implementation",
           "load_pretrained", "save_pretrained_dir"]

log = logging.getLogger(__name__)

# The HF default `grouped_mm`; NOTES.md measured `batched_mm` ~30x slower on CPU.
FAST_EXPERTS_IMPLEMENTATION = "grouped_mm"

# Config kwargs HF accepts that are not dataclass fields (popped in PreTrainedConfig.__init__).
_EXTRA_CONFIG_KWARGS = {
    "attn_implementation",
    "experts_implementation",
    "output_attentions",
    "name_or_path",
    "rope_scaling",
    "rope_theta",
}


def build_deepseek_v3(
    vocab_size: int = 4096,
    hidden_size: int = 256,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int | None = None,
    intermediate_size: int = 1024,
    moe_intermediate_size: int = 256,
    n_routed_experts: int = 8,
    n_shared_experts: int = 1,
    num_experts_per_tok: int = 2,
    first_k_dense_replace: int = 1,
    kv_lora_rank: int = 64,
    q_lora_rank: int | None = 128,
    qk_rope_head_dim: int = 16,
    qk_nope_head_dim: int = 32,
    v_head_dim: int = 32,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    n_group: int = 4,
    topk_group: int = 2,
    attn_implementation: str = "sdpa",
    use_cache: bool = False,
    **overrides: Any,
) -> DeepseekV3ForCausalLM:
    """Build a randomly initialised ``transformers.DeepseekV3ForCausalLM`` (no network access).

    The first ``first_k_dense_replace`` layers use a dense MLP (``intermediate_size``); the rest
    are MoE layers with ``n_routed_experts`` routed experts (sigmoid router, top
    ``num_experts_per_tok``, restricted to the best ``topk_group`` of ``n_group`` expert groups,
    as in DeepSeek-V3) plus ``n_shared_experts`` always-on experts. ``n_group=4, topk_group=2``
    mirrors V3's "half of the groups" with 8 experts; ``n_group=1, topk_group=1`` is plain top-k.

    ``num_key_value_heads=None`` means one per attention head, as MLA needs (HF's V3 default
    of 128 silently breaks eager attention for a 4-head model: 4 // 128 = 0 kv groups).
    ``attn_implementation="sdpa"`` is HF's plain SDPA (on CPU its math kernel for these sizes); ``"sdpa_pad_v"``
    (``mla_attention.py``, opt-in: docs/gpu.md) pads V to the query/key head size so SDPA's flash kernels take
    MLA's unequal head sizes; ``"eager"`` HF's reference; all three agree to ~1e-6.
    ``use_cache=False`` because this is a training model (no KV cache built per forward).
    Any extra keyword is passed to ``DeepseekV3Config`` (e.g. ``routed_scaling_factor``,
    ``experts_implementation``); unknown keys raise ``ConfigError``.
    """
    kwargs = dict(locals())
    kwargs.update(kwargs.pop("overrides"))
    return _build(DeepseekV3Config, DeepseekV3ForCausalLM, kwargs)


def build_deepseek_v2(
    vocab_size: int = 4096,
    hidden_size: int = 256,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int | None = None,
    intermediate_size: int = 1024,
    moe_intermediate_size: int = 256,
    n_routed_experts: int = 8,
    n_shared_experts: int = 1,
    num_experts_per_tok: int = 2,
    first_k_dense_replace: int = 1,
    kv_lora_rank: int = 64,
    q_lora_rank: int | None = 128,
    qk_rope_head_dim: int = 16,
    qk_nope_head_dim: int = 32,
    v_head_dim: int = 32,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    topk_method: str = "group_limited_greedy",
    n_group: int | None = 4,
    topk_group: int | None = 2,
    attn_implementation: str = "sdpa",
    use_cache: bool = False,
    **overrides: Any,
) -> DeepseekV2ForCausalLM:
    """Build a randomly initialised ``transformers.DeepseekV2ForCausalLM`` (no network access).

    Same shape as :func:`build_deepseek_v3`; the V2 differences are a softmax router, routing
    chosen by ``topk_method`` (``"greedy"`` or ``"group_limited_greedy"``, which uses
    ``n_group``/``topk_group``; HF's V2 default is greedy with both None), no top-k
    renormalisation and ``routed_scaling_factor=1.0`` by default. Extra keywords go to
    ``DeepseekV2Config`` (e.g. ``mlp_bias``, ``head_dim``); unknown keys raise ``ConfigError``.
    """
    kwargs = dict(locals())
    kwargs.update(kwargs.pop("overrides"))
    return _build(DeepseekV2Config, DeepseekV2ForCausalLM, kwargs)


def experts_implementation(net: nn.Module) -> str | None:
    """Return the experts kernel the model's MoE layers dispatch to (e.g. ``"grouped_mm"``)."""
    config = getattr(net, "config", None)
    return None if config is None else config._experts_implementation


def load_pretrained(name_or_path: str, **kwargs: Any) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)`` in train mode, with one-line errors.

    A local path that does not exist, a directory that is not a saved model, or a hub id that
    cannot be fetched (offline / ``HF_HUB_OFFLINE=1`` and not cached) raise ``ConfigError``
    naming ``model.net.name_or_path``.
    """
    path = os.path.expanduser(str(name_or_path))
    # huggingface_hub reads HF_HUB_OFFLINE once at import; honour a later setting too, so an
    # offline run fails at once instead of retrying the network for ~20 s.
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        kwargs.setdefault("local_files_only", True)
    if not os.path.exists(path) and not _looks_like_hub_id(str(name_or_path)):
        raise ConfigError(
            f"model.net.name_or_path: local path '{name_or_path}' does not exist and is not a "
            "Hugging Face hub id ('org/name'); give a save_pretrained directory or a hub id"
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model.net.name_or_path: '{name_or_path}' has no config.json, so it is not a "
            "save_pretrained directory (export one with save_pretrained_dir)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path if os.path.exists(path) else name_or_path, **kwargs)
    except (OSError, ValueError) as err:  # hub errors subclass OSError; bad config.json -> ValueError
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model.net.name_or_path: cannot load '{name_or_path}' ({first_line}); give a "
            "save_pretrained directory, or a hub id that is cached or reachable"
        ) from err
    # from_pretrained returns eval mode and Lightning 2.6 keeps module modes as they are: without
    # this the model would train with dropout and router jitter off
    return model.train()


def save_pretrained_dir(
    net: PreTrainedModel,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write an HF ``save_pretrained`` directory that ``load_pretrained`` reads back exactly.

    ``state_dict`` (optional) replaces the model's own weights, e.g. the consolidated fp32
    dict from DeepSpeed's ``zero_to_fp32`` (then ``net`` only supplies the config, so a
    ZeRO-3-partitioned ``net`` is fine). A Lightning-style ``{"state_dict": ...}`` checkpoint
    and key prefixes such as ``net.`` or ``_forward_module.net.`` are unwrapped. ``tokenizer``
    may be an HF tokenizer (``save_pretrained``) or a ``tokenizers.Tokenizer`` (``save``).
    Returns the directory. Call on rank zero only.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if state_dict is not None:
        state_dict = _match_state_dict(net, state_dict)
    elif any(p.numel() == 0 and hasattr(p, "ds_shape") for p in net.parameters()):
        raise ValueError(
            f"{type(net).__name__} is ZeRO-3 partitioned; pass the consolidated fp32 "
            "state_dict (DeepSpeed zero_to_fp32) to save_pretrained_dir"
        )
    net.save_pretrained(out, state_dict=state_dict)
    if tokenizer is not None:
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(out)
        else:
            tokenizer.save(str(out / "tokenizer.json"))
    return out


# --------------------------------------------------------------------------------------------


def _build(config_cls: type, model_cls: type, kwargs: dict[str, Any]) -> PreTrainedModel:
    """Validate kwargs, build the config and the model; check the experts kernel."""
    _check_known_keys(config_cls, kwargs)
    _check_routing(config_cls, kwargs)
    config = config_cls(**kwargs)
    net = model_cls(config)
    impl = experts_implementation(net)
    requested = kwargs.get("experts_implementation")
    if requested is None and impl != FAST_EXPERTS_IMPLEMENTATION:
        log.warning(
            "%s: experts implementation fell back to %r (expected %r, much faster on CPU); "
            "set model.net.experts_implementation explicitly to silence this",
            model_cls.__name__, impl, FAST_EXPERTS_IMPLEMENTATION,
        )
    return net


def _check_known_keys(config_cls: type, kwargs: Mapping[str, Any]) -> None:
    """Raise ConfigError for keys the HF config would silently store and never use."""
    valid = {f.name for f in dataclasses.fields(config_cls)} | set(config_cls.attribute_map)
    valid |= _EXTRA_CONFIG_KWARGS
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        hints = {k: difflib.get_close_matches(k, valid, n=1) for k in unknown}
        hint = "; ".join(f"{k} -> did you mean {m[0]}?" for k, m in hints.items() if m)
        raise ConfigError(
            f"model.net: unknown {config_cls.__name__} key(s) {unknown}"
            + (f" ({hint})" if hint else "")
            + f"; valid keys: {sorted(valid)}"
        )


def _check_routing(config_cls: type, kw: Mapping[str, Any]) -> None:
    """Group-limited routing must fit the expert count (HF would fail deep inside forward)."""
    experts = kw.get("n_routed_experts", kw.get("num_experts", kw.get("num_local_experts")))
    top_k = kw.get("num_experts_per_tok")
    if experts is None or top_k is None:
        return
    if not 1 <= top_k <= experts:
        raise ConfigError(
            f"model.net.num_experts_per_tok={top_k} must be in 1..n_routed_experts={experts}"
        )
    grouped = config_cls is DeepseekV3Config or kw.get("topk_method") == "group_limited_greedy"
    if not grouped:
        return
    n_group, topk_group = kw.get("n_group"), kw.get("topk_group")
    if not n_group or experts % n_group:
        raise ConfigError(
            f"model.net.n_group={n_group} must divide n_routed_experts={experts}; valid: "
            f"{[d for d in range(1, experts + 1) if experts % d == 0]} (n_group=1 with "
            "topk_group=1 is plain top-k routing)"
        )
    if not topk_group:
        raise ConfigError(f"model.net.topk_group={topk_group} must be set; valid: 1..{n_group}")
    per_group = experts // n_group
    # V3 scores a group by the sum of its best 2 experts, so each group needs >= 2.
    min_per_group = 2 if config_cls is DeepseekV3Config else 1
    if per_group < min_per_group or not 1 <= topk_group <= n_group or topk_group * per_group < top_k:
        raise ConfigError(
            f"model.net: n_group={n_group}, topk_group={topk_group} do not fit "
            f"n_routed_experts={experts}, num_experts_per_tok={top_k}: need experts per group "
            f">= {min_per_group}, 1 <= topk_group <= n_group and topk_group*experts_per_group >= "
            "num_experts_per_tok (e.g. n_group=4, topk_group=2 or n_group=1, topk_group=1)"
        )


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _looks_like_hub_id(name: str) -> bool:
    """'org/name' or 'name'; not './x', '/x', '~/x', 'a/b/c' or anything with '..'."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def _match_state_dict(net: PreTrainedModel, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unwrap a checkpoint dict, strip a common key prefix and check keys against ``net``."""
    if "state_dict" in sd and isinstance(sd["state_dict"], Mapping):
        sd = sd["state_dict"]
    expected = set(net.state_dict().keys())
    prefix = _find_prefix(sd.keys(), expected)
    sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    tied = set(getattr(net, "_tied_weights_keys", None) or {}) if net.config.tie_word_embeddings else set()
    missing = sorted(expected - set(sd) - tied)
    unexpected = sorted(set(sd) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"state_dict does not match {type(net).__name__} (after stripping prefix "
            f"'{prefix}'): missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def _find_prefix(keys: Any, expected: set[str]) -> str:
    """The prefix p such that most keys are p + <an expected key> ('' when they already match)."""
    counts: dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in expected:
                prefix = ".".join(parts[:i]) + ("." if i else "")
                counts[prefix] = counts.get(prefix, 0) + 1
                break
    return max(counts, key=lambda p: (counts[p], -len(p))) if counts else ""
