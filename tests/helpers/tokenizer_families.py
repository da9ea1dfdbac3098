"""Tiny pretrained-model directories of three tokenizer families, built offline.

Each family is a tokenizer trained with the `tokenizers` library on a few KB of text, wrapped in
its transformers class, and a randomly initialised HF model of the matching architecture (hidden
32, one layer), saved together with `save_pretrained` as a hub checkpoint would be:

    gpt2   byte-level BPE, `<|endoftext|>` is bos = eos (id 0), no pad     GPT2LMHeadModel
    llama  metaspace BPE with byte fallback, `<unk>` `<s>` `</s>` = 0 1 2,  LlamaForCausalLM
           256 `<0xXX>` byte tokens, BOS added to every text
    qwen2  Qwen2's regex split + byte-level BPE, `<|endoftext|>` (pad),     Qwen2ForCausalLM
           `<|im_start|>`, `<|im_end|>` (eos) added after the vocabulary;
           the model's vocab_size is padded past the tokenizer's, as Qwen's is
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

FAMILIES = ("gpt2", "llama", "qwen2")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(family: str, texts: list[str]):
    """A transformers tokenizer of `family`, trained on `texts`."""
    from transformers import GPT2TokenizerFast, LlamaTokenizerFast, Qwen2TokenizerFast

    if family == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return GPT2TokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                 unk_token="<|endoftext|>")
    if family == "llama":
        return LlamaTokenizerFast(tokenizer_object=_llama_backend(texts), bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    if family == "qwen2":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=450, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        return Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, unk_token=None)
    raise ValueError(family)


def _llama_backend(texts: list[str]) -> Tokenizer:
    """Llama-2's layout: 0 <unk>, 1 <s>, 2 </s>, 3..258 the byte tokens, then the merges."""
    def configure(tok: Tokenizer) -> Tokenizer:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        return tok

    learner = configure(Tokenizer(models.BPE(unk_token="<unk>")))
    learner.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab = {t: i for i, t in enumerate(specials)}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = configure(Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                         fuse_unk=True)))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def build_model(family: str, tokenizer, **overrides):
    """A tiny random-init model of `family` whose config matches `tokenizer` (unless overridden)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = max(tokenizer.get_vocab().values()) + 1
    if family == "qwen2":
        vocab = (vocab + 63) // 64 * 64  # padded, as Qwen's embedding is
    kwargs = {"vocab_size": vocab, **{f"{r}_token_id": getattr(tokenizer, f"{r}_token_id") for r in ("bos", "eos", "pad")}}
    kwargs.update(overrides)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_positions=128, n_embd=32, n_layer=1, n_head=2, **kwargs))
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, **kwargs))
    return Qwen2ForCausalLM(Qwen2Config(**common, **kwargs))


def save_model_dir(family: str, out: Path, texts: list[str], with_tokenizer: bool = True, **overrides) -> Path:
    """`out` as a hub checkpoint: model (config.json + weights) and, optionally, its tokenizer."""
    tokenizer = build_tokenizer(family, texts)
    build_model(family, tokenizer, **overrides).save_pretrained(out)
    if with_tokenizer:
        tokenizer.save_pretrained(out)
    return out
