"""`LoraAdapter`: LoRA / QLoRA on any net the module trains, through peft (``+model/adapter=lora``).

``CausalLMModule(adapter=...)`` calls :meth:`LoraAdapter.apply` on its net at build time (every
rank, before the strategy exists): the targeted modules get peft LoRA layers, every other
parameter is frozen (peft's own ``get_peft_model``). What is checked here, before training:

| finding / error | severity | meaning |
|---|---|---|
| ``ConfigError`` (build) | exit 2 | ``target_modules`` match nothing, only embeddings/the output head, or a module type LoRA has no layer for: the message names the patterns and the Linear modules that exist |
| ``ConfigError`` (build) | exit 2 | ``kind=qlora`` without a CUDA GPU or without bitsandbytes |
| ``adapter/adapter_applied`` | info | the rank, alpha, the matched modules and the trainable-parameter count and share |

After fit, ``dsdebug.checkpoint.checkpoints.export_final`` calls :func:`export_adapter`: the
adapter alone (``export/adapter/``: ``PeftModel.from_pretrained`` loads it onto the base) and
the merged net (``export/hf/``), with the saved adapter verified non-empty and reloading to the
same logits (``adapter/adapter_empty``, ``adapter/adapter_reload_mismatch``: errors). The frozen
base is verified not to move by ``callbacks.freeze_verify`` (it reads :attr:`intended_frozen`).

Runs on every rank; nothing here calls a collective (export: rank 0 only).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dsdebug.errors import ConfigError, is_rank_zero
from dsdebug.findings import Finding, get_channel

__all__ = ["LoraAdapter", "export_adapter", "adapter_state", "is_adapter_param", "gathered"]

log = logging.getLogger(__name__)

KINDS = ("lora", "qlora")
# peft's LoRA parameter names hold one of these (lora_A/lora_B/lora_embedding_A/B/lora_magnitude_vector)
_ADAPTER_MARK = ".lora_"
_SUPPORTED = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)


def is_adapter_param(name: str) -> bool:
    """A LoRA parameter (trains); every other parameter of an adapted net is its frozen base."""
    return _ADAPTER_MARK in name


class LoraAdapter:
    """LoRA (``kind=lora``) or QLoRA (``kind=qlora``: the base's Linear layers in bitsandbytes 4-bit).

    Example::

        python train.py +model/adapter=lora model.adapter.r=16 'model.adapter.target_modules=[q_b_proj,o_proj]'
        python train.py model=hf_pretrained model.net.name_or_path=/models/llama +model/adapter=qlora trainer=gpu
    """

    def __init__(self, kind: str = "lora", r: int = 8, alpha: float = 16, dropout: float = 0.05,
                 target_modules: Any = "all-linear", bias: str = "none", quant_type: str = "nf4",
                 compute_dtype: str = "bfloat16") -> None:
        def bad(key: str, value: Any, valid: str) -> ConfigError:
            return ConfigError(f"model.adapter.{key}={value!r} is not valid; valid: {valid}")

        if kind not in KINDS:
            raise bad("kind", kind, " | ".join(KINDS))
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise bad("r", r, "an integer >= 1 (the LoRA rank)")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
            raise bad("alpha", alpha, "a number > 0 (LoRA scales its update by alpha / r)")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
            raise bad("dropout", dropout, "a number in [0, 1)")
        if bias not in ("none", "all", "lora_only"):
            raise bad("bias", bias, "none | all | lora_only")
        if quant_type not in ("nf4", "fp4"):
            raise bad("quant_type", quant_type, "nf4 | fp4")
        if compute_dtype not in ("bfloat16", "float16", "float32"):
            raise bad("compute_dtype", compute_dtype, "bfloat16 | float16 | float32")
        targets = [target_modules] if isinstance(target_modules, str) else list(target_modules or ())
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise bad("target_modules", target_modules, "all-linear, a list of module names (a name matches "
                      "itself and every module whose dotted path ends with it) or one regex string")
        self.kind, self.r, self.alpha, self.dropout, self.bias = kind, r, alpha, float(dropout), bias
        # one string: peft's "all-linear" or a regex (full match); a list: names matched on the path's end
        self.target_modules: str | list[str] = targets[0] if isinstance(target_modules, str) else targets
        self.quant_type, self.compute_dtype = quant_type, compute_dtype
        if kind == "qlora":
            _check_qlora_possible()
        self.intended_frozen: frozenset[str] = frozenset()

    # ---- build: every rank ------------------------------------------------------------
    def peft_config(self, matched: list[str]) -> Any:
        """peft's config with the matched module names spelled out: peft's own ``all-linear`` also
        adapts some models' fused expert tensors (``target_parameters``), which refuses dropout."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, bias=self.bias,
                          target_modules=sorted(matched), task_type="CAUSAL_LM")

    def apply(self, net: nn.Module, report: bool = True, quantize: bool = True) -> nn.Module:
        """``net`` with LoRA layers on the targeted modules and its base frozen (a peft model).
        ``intended_frozen`` then holds the frozen base's parameter names (``net.``-relative)."""
        matched = self.matched_modules(net)
        if self.kind == "qlora" and quantize:  # export merges onto the full-precision base: quantize=False
            net = _quantize_base(net, self)
        from peft import get_peft_model

        adapted = get_peft_model(net, self.peft_config(matched))
        self.intended_frozen = frozenset(n for n, _ in adapted.named_parameters() if not is_adapter_param(n)
                                         and not (self.bias != "none" and n.endswith(".bias")))
        if report and is_rank_zero():
            self._report_applied(adapted, matched)
        return adapted

    def matched_modules(self, net: nn.Module) -> list[str]:
        """The module names the patterns select; a one-line ConfigError when they select nothing
        LoRA can train (no module, only embeddings / the output head, an unsupported type)."""
        from peft import LoraConfig
        from peft.tuners.tuners_utils import check_target_module_exists

        modules = dict(net.named_modules())
        linear = [n for n, m in modules.items() if _is_linear(m)]
        head = _output_head_names(net)
        if self.target_modules == "all-linear":
            matched = [n for n in linear if n not in head]
        else:
            probe = LoraConfig(target_modules=self.target_modules)
            matched = [n for n in modules if n and check_target_module_exists(probe, n)]
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
        shown = f"{self.target_modules!r}" if isinstance(self.target_modules, str) else str(self.target_modules)
        exist = f"the Linear modules of {type(net).__name__} are named {', '.join(leaves)}"
        if not matched:
            raise ConfigError(f"model.adapter.target_modules={shown} matches no module; {exist} "
                              "(valid: all-linear, some of those names, or one regex)")
        unsupported = sorted({f"{n} ({type(modules[n]).__name__})" for n in matched
                              if not isinstance(modules[n], _SUPPORTED) and not _is_linear(modules[n])})
        if unsupported:
            raise ConfigError(f"model.adapter.target_modules={shown} selects modules LoRA has no layer for: "
                              f"{', '.join(unsupported[:5])}; {exist}")
        embeddings = {n for n in matched if isinstance(modules[n], nn.Embedding)} | (set(matched) & head)
        if set(matched) <= embeddings:
            raise ConfigError(f"model.adapter.target_modules={shown} selects only the embeddings/output head "
                              f"({', '.join(sorted(matched))}): no transformer layer would adapt; {exist}")
        # peft re-targets some names of transformers-v5 MoE models (DeepSeek, Mixtral...) to their fused
        # expert tensors (v4 adapter compatibility), and its expert LoRA takes no dropout
        moved = _peft_retargets(net, matched)
        self.left_out: list[str] = []
        if moved and self.target_modules == "all-linear":
            self.left_out, matched = moved, [n for n in matched if n not in moved]
        elif moved and self.dropout > 0:
            raise ConfigError(f"model.adapter.target_modules={shown} selects {', '.join(sorted(moved)[:4])}, which peft maps to "
                              f"the fused expert tensors of this MoE model, where LoRA takes no dropout: set "
                              "model.adapter.dropout=0, or leave those names out")
        return matched

    def _report_applied(self, adapted: nn.Module, matched: list[str]) -> None:
        trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
        total = sum(p.numel() for p in adapted.parameters())
        leaves = sorted({n.rsplit(".", 1)[-1] for n in matched})
        get_channel().report(Finding(
            "adapter", "info", "adapter_applied",
            f"{self.kind} r={self.r} alpha={self.alpha:g} dropout={self.dropout:g} on {len(matched)} modules "
            f"({', '.join(leaves)}): {trainable:,} of {total:,} parameters trainable "
            f"({100 * trainable / max(total, 1):.3g}%), the base frozen"
            + (f"; all-linear leaves out {len(self.left_out)} MLP projections of this MoE model "
               f"({', '.join(sorted({n.rsplit('.', 1)[-1] for n in self.left_out}))}: peft maps those names to the "
               "fused experts; name them with dropout=0 to adapt the experts)" if self.left_out else ""),
            details={"trainable": trainable, "total": total, "share": trainable / max(total, 1),
                     "modules": matched, "left_out": self.left_out, "r": self.r, "alpha": self.alpha,
                     "kind": self.kind}))


def _peft_retargets(net: nn.Module, matched: list[str]) -> list[str]:
    """The matched module names peft itself would move to fused expert tensors (its transformers-v5
    conversion of MoE targets), found by running that conversion on a throwaway config."""
    from peft import LoraConfig

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft without the conversion adapts what it is given
        return []
    probe = LoraConfig(target_modules=sorted(matched))
    try:
        convert_peft_config_for_transformers(probe, model=net, conversions=None)
    except ValueError:  # a fused pair half-targeted: peft's own error follows in get_peft_model
        return []
    kept = set(probe.target_modules or ())
    return [n for n in matched if n not in kept]


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    name = type(module).__name__
    return name in ("Conv1D", "Linear4bit", "Linear8bitLt")  # GPT-2's transposed Linear, bitsandbytes layers


def _output_head_names(net: nn.Module) -> set[str]:
    get = getattr(net, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {n for n, m in net.named_modules() if head is not None and m is head}


# ---- QLoRA: the base's Linear layers in 4-bit ---------------------------------------------
def _check_qlora_possible() -> None:
    if not torch.cuda.is_available():
        raise ConfigError("model.adapter=qlora needs a CUDA GPU and bitsandbytes: this machine has no CUDA GPU "
                          "(use +model/adapter=lora on CPU, or trainer=gpu on a GPU machine)")
    try:
        import bitsandbytes  # noqa: F401
    except ModuleNotFoundError:
        raise ConfigError("model.adapter=qlora needs a CUDA GPU and bitsandbytes, which is not installed: "
                          "pip install 'dsdebug[qlora]'") from None


def _quantize_base(net: nn.Module, adapter: LoraAdapter) -> nn.Module:
    """Every Linear but the output head becomes a bitsandbytes ``Linear4bit`` holding the same
    weights; bitsandbytes quantizes them when the strategy moves the net to the GPU."""
    import bitsandbytes as bnb

    head = _output_head_names(net)
    dtype = getattr(torch, adapter.compute_dtype)
    for name, module in list(net.named_modules()):
        if not isinstance(module, nn.Linear) or name in head:
            continue
        q = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                              compute_dtype=dtype, quant_type=adapter.quant_type)
        q.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, quant_type=adapter.quant_type)
        if module.bias is not None:
            q.bias = nn.Parameter(module.bias.data, requires_grad=False)
        parent, _, leaf = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, leaf, q)
    return net


# ---- save / verify / merge: rank 0 --------------------------------------------------------
def gathered(params: list[nn.Parameter]) -> Any:
    """A context in which ZeRO-3-partitioned ``params`` hold their full data (a no-op otherwise).
    Saving an adapter from a live ZeRO-3 model without it writes size-0 tensors (peft #2500).
    Under ZeRO-3 it is a collective: every rank must enter it."""
    import contextlib

    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def adapter_state(adapted: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors as peft saves them (full tensors also under ZeRO-3: gathered first)."""
    from peft import get_peft_model_state_dict

    params = [p for n, p in adapted.named_parameters() if is_adapter_param(n)]
    with gathered(params):
        return {k: v.detach().clone().cpu() for k, v in get_peft_model_state_dict(adapted).items()}


def load_adapted(adapter: LoraAdapter, base: nn.Module, net_state: dict[str, torch.Tensor]) -> nn.Module:
    """A fresh base from the model config, the LoRA layers applied (never quantized), and the trained
    weights of ``net_state`` (a consolidated checkpoint, ``net.``-relative names). QLoRA's 4-bit base
    tensors do not fit the full-precision layers and are left out: the adapter merges onto the base
    as the config builds it (its pretrained weights)."""
    adapted = adapter.apply(base, report=False, quantize=False)
    own = adapted.state_dict()
    fits = {k: v for k, v in net_state.items() if k in own and own[k].shape == v.shape}
    missing = [k for k in own if k not in fits and is_adapter_param(k)]
    if missing:
        raise RuntimeError(f"the checkpoint lacks the adapter tensors {missing[:3]}: it was not written by this "
                           "model.adapter config")
    # a LoRA base must come from the checkpoint (a random-init net's base exists nowhere else); only
    # QLoRA's 4-bit base tensors are expected not to fit the full-precision layers
    absent = [k for k in own if k not in fits and (k not in net_state or adapter.kind == "lora")]
    if absent:
        raise RuntimeError(f"the consolidated checkpoint lacks {len(absent)} base tensors of the adapted net "
                           f"({', '.join(absent[:3])}...): the export would hold a base that was never trained on")
    adapted.load_state_dict(fits, strict=False)
    if len(fits) < len(own):
        log.info("export: %d of %d base tensors kept from the model config (not in the checkpoint at full "
                 "precision)", len(own) - len(fits), len(own))
    return adapted


def export_adapter(adapted: nn.Module, out_dir: Path, probe_vocab: int | None = None) -> tuple[nn.Module, dict]:
    """Write ``out_dir`` (adapter_config.json + adapter_model.safetensors), verify it, and return the
    merged base net (LoRA folded into its weights) and facts for metrics.json. Verification: every
    saved tensor non-empty; the saved adapter loaded onto a copy of the base gives the same logits
    as ``adapted`` on a fixed probe batch. Each failure is an error finding naming the tensor."""
    import copy

    from peft import PeftModel
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    adapted.eval()
    state = adapter_state(adapted)
    adapted.peft_config["default"].save_pretrained(str(out_dir))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "adapter_model.safetensors"))
    facts = {"tensors": len(state), "elements": int(sum(v.numel() for v in state.values()))}
    empty = verify_adapter_dir(out_dir)
    if empty:
        return adapted.merge_and_unload(), facts
    vocab = probe_vocab or getattr(getattr(adapted, "config", None), "vocab_size", None) or 2
    probe = torch.randint(0, int(vocab), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _logits(adapted(input_ids=probe))
        fresh = copy.deepcopy(adapted).unload()  # the base alone: LoRA layers removed, nothing merged
        reloaded = PeftModel.from_pretrained(fresh, str(out_dir)).eval()
        got = _logits(reloaded(input_ids=probe))
    diff = float((want - got).abs().max())
    facts["reload_max_abs_diff"] = diff
    if not diff <= 1e-5 * max(1.0, float(want.abs().max())):
        get_channel().report(Finding(
            "adapter", "error", "adapter_reload_mismatch",
            f"the adapter saved to {out_dir} reloads onto the base with logits up to {diff:.3g} away from the "
            "trained model's", advice="the saved tensors are not the trained ones (a partitioned or stale copy?): "
            "compare adapter_model.safetensors with the checkpoint", details=facts))
    return adapted.merge_and_unload(), facts


def verify_adapter_dir(out_dir: Path) -> list[str]:
    """Names of empty (size-0) tensors in a saved adapter, each reported as an error finding."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(out_dir) / "adapter_model.safetensors"))
    empty = sorted(k for k, v in tensors.items() if v.numel() == 0)
    if not tensors or empty:
        names = ", ".join(empty[:5]) + (f" (+{len(empty) - 5} more)" if len(empty) > 5 else "")
        get_channel().report(Finding(
            "adapter", "error", "adapter_empty",
            f"the adapter saved to {out_dir} has {len(empty)} of {len(tensors)} tensors empty: {names or 'no tensor'}",
            advice="under ZeRO-3 gather the adapter (deepspeed.zero.GatheredParameters) before saving; "
                   "export from the consolidated checkpoint (export/model_fp32.pt)",
            details={"empty": empty, "tensors": len(tensors)}))
        return empty or ["<none>"]
    return []


def _logits(out: Any) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out).float()
