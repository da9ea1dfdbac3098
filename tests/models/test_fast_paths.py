"""The model's fast paths against their reference paths, on CPU (docs/gpu.md "Where the step's time goes").

Each fast path is compared with the path it replaces on the same inputs: outputs and gradients within a
tolerance stated per test (float rounding, not "close enough"), and each comparison is shown to fail on a
planted wrong fast path (``*_catches_*`` tests), so the tolerance is tight enough to see a bug. Speed is not
asserted here (benchmarks/step_profile.py measures it); where a claim is structural (which kernel SDPA runs, no
fp32 tensor of the logits' size, no host read in the MoE dispatch) it is checked as structure.

| fast path | reference | test |
|---|---|---|
| ``attn_implementation=sdpa_pad_v`` (mla_attention.py) | HF ``sdpa`` and ``eager`` | ``test_sdpa_pad_v_*`` |
| HF ``grouped_mm`` experts (sort + one grouped GEMM) | HF's per-expert loop (``eager``) | ``test_grouped_mm_*`` |
| ``model.cross_entropy=chunked`` (lm_loss.py) | ``full`` (``F.cross_entropy`` on an fp32 copy) | ``test_chunked_*`` |
| ``optim.optimizer.fused=auto`` -> torch's fused AdamW | torch's foreach AdamW | ``test_fused_adamw_*`` |
| ``model.compile=true`` (compile_blocks.py) | the eager blocks | ``test_compiled_blocks_*`` |
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dsdebug.errors import ConfigError
from dsdebug.models.compile_blocks import COMPILED_ATTR, compile_blocks, compiled_blocks
from dsdebug.models.deepseek import build_deepseek_v2, build_deepseek_v3
from dsdebug.models.document_mask import document_mask
from dsdebug.models.kernel_options import compile_setting, cross_entropy_mode
from dsdebug.models.lm_loss import ChunkedCrossEntropy, next_token_loss
from dsdebug.models.moe_aux import RouterCapture
from dsdebug.models.optim import param_groups, resolve_fused

BUILDERS = {"v3": build_deepseek_v3, "v2": build_deepseek_v2}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _ids(batch: int = 2, seq: int = 16, vocab: int = 4096) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _run(net: torch.nn.Module, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and every parameter's gradient of a fixed scalar of the logits (not their sum: its gradient
    through softmax-like paths is degenerate)."""
    net.zero_grad(set_to_none=True)
    logits = net(input_ids=ids, **kwargs).logits
    weights = torch.linspace(-1, 1, logits.shape[-1])
    (logits * weights).square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def _assert_same(fast: tuple, ref: tuple, rtol: float, atol: float) -> None:
    """Outputs within rtol/atol; each gradient within rtol/atol of its own largest entry (scale-free)."""
    torch.testing.assert_close(fast[0], ref[0], rtol=rtol, atol=atol)
    assert fast[1].keys() == ref[1].keys()
    for name, g in ref[1].items():
        scale = g.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(fast[1][name] / scale, g / scale, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------ attention

@pytest.mark.parametrize("version", ["v3", "v2"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "document_mask"])
def test_sdpa_pad_v_equals_sdpa_and_eager(version, masked):
    net = BUILDERS[version](attn_implementation="sdpa_pad_v")
    assert net.config._attn_implementation == "sdpa_pad_v"
    attn = net.model.layers[0].self_attn
    assert attn.v_head_dim < attn.qk_head_dim  # MLA: the case the padding is for (32 vs 48)
    ids = _ids()
    kwargs = {}
    if masked:  # packed documents: a 4-D mask, positions restarting per document
        doc_ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 11 + [1] * 5])
        positions = torch.stack([torch.cat([torch.arange(6), torch.arange(10)]),
                                 torch.cat([torch.arange(11), torch.arange(5)])])
        kwargs = {"attention_mask": document_mask(doc_ids), "position_ids": positions}
    fast = _run(net, ids, **kwargs)
    if masked:  # a document attends to itself only: row 1's second document equals it run alone
        with torch.no_grad():
            alone = net(input_ids=ids[1:, 11:]).logits
        torch.testing.assert_close(fast[0][1:, 11:], alone, rtol=1e-5, atol=1e-5)
    # (HF's eager adds a 4-D bool mask as numbers in transformers 5.23, so with one it is no reference)
    for reference in ("sdpa",) if masked else ("sdpa", "eager"):
        net.set_attn_implementation(reference)
        _assert_same(fast, _run(net, ids, **kwargs), rtol=1e-5, atol=1e-5)


def test_sdpa_pad_v_reaches_the_flash_kernel_where_sdpa_falls_back_to_math():
    net = build_deepseek_v3(num_hidden_layers=1, attn_implementation="sdpa_pad_v")
    ids = _ids()

    def kernels() -> set[str]:
        with profile() as prof:
            _run(net, ids)
        return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}

    padded = kernels()
    net.set_attn_implementation("sdpa")
    plain = kernels()
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in padded, padded
    assert "aten::_scaled_dot_product_attention_math" not in padded, padded
    assert "aten::_scaled_dot_product_attention_math" in plain, plain  # unequal head sizes: the unfused kernel


def test_sdpa_pad_v_comparison_catches_a_wrong_padding():
    """Planted: the zeros padded in front of V instead of behind it, so the slice keeps the wrong columns."""

    def wrong(module, query, key, value, attention_mask, **kwargs):
        v = value.shape[-1]
        out, w = sdpa_attention_forward(module, query, key, F.pad(value, [query.shape[-1] - v, 0]), attention_mask,
                                        **kwargs)
        return out[..., :v], w

    AttentionInterface.register("test_wrong_pad", wrong)
    AttentionMaskInterface.register("test_wrong_pad", sdpa_mask)
    net = build_deepseek_v3(num_hidden_layers=2)
    ids = _ids()
    ref = _run(net, ids)
    net.set_attn_implementation("test_wrong_pad")
    with pytest.raises(AssertionError):
        _assert_same(_run(net, ids), ref, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------- experts

def _moe_layer(version: str = "v3"):
    net = BUILDERS[version](num_hidden_layers=2)
    return net, net.model.layers[1].mlp


def _experts_run(moe, hidden: torch.Tensor, impl: str) -> tuple:
    moe.experts.config._experts_implementation = impl
    moe.zero_grad(set_to_none=True)
    x = hidden.clone().requires_grad_()
    out = moe(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    grads["input"] = x.grad
    return out.detach(), grads


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_grouped_mm_experts_equal_the_per_expert_loop(version):
    net, moe = _moe_layer(version)
    assert net.config._experts_implementation == "grouped_mm"  # HF's default, kept by the builders
    hidden = torch.randn(3, 24, net.config.hidden_size)
    fast = _experts_run(moe, hidden, "grouped_mm")
    _assert_same(fast, _experts_run(moe, hidden, "eager"), rtol=1e-5, atol=1e-6)


class _HostReads:
    """Counts reads of tensor values on the host (each one a device sync on a GPU)."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__iter__")

    def __enter__(self):
        self.count, self.saved = 0, {m: getattr(torch.Tensor, m) for m in self.METHODS}
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def counted(t, *args, **kwargs):
            self.count += 1
            return fn(t, *args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)


def test_grouped_mm_dispatch_has_no_host_read_and_no_python_loop_over_experts():
    net, moe = _moe_layer()
    hidden = torch.randn(3, 24, net.config.hidden_size)
    with _HostReads() as fast:
        _experts_run(moe, hidden, "grouped_mm")
    with _HostReads() as loop:
        _experts_run(moe, hidden, "eager")
    assert fast.count == 0
    assert loop.count >= net.config.n_routed_experts  # one read per expert at least: the loop the issue describes


def test_grouped_mm_comparison_catches_a_wrong_permutation(monkeypatch):
    """Planted: the tokens' routing weights taken in the wrong order (what a broken unpermute does)."""
    import transformers.integrations.moe as hf_moe

    real = hf_moe.grouped_mm_experts_forward

    def wrong(self, hidden_states, top_k_index, top_k_weights):
        return real(self, hidden_states, top_k_index, top_k_weights.flip(0))

    monkeypatch.setitem(hf_moe.ALL_EXPERTS_FUNCTIONS._local_mapping, "grouped_mm", wrong)
    net, moe = _moe_layer()
    hidden = torch.randn(3, 24, net.config.hidden_size)
    with pytest.raises(AssertionError):
        _assert_same(_experts_run(moe, hidden, "grouped_mm"), _experts_run(moe, hidden, "eager"), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- the loss

def _loss_case(dtype: torch.dtype, vocab: int = 97):
    logits = (torch.randn(3, 21, vocab) * 3).to(dtype)
    labels = torch.randint(0, vocab, (3, 21))
    labels[0, 4:9] = -100  # ignored positions (padding, a masked prompt)
    labels[2, -1] = -100
    return logits, labels


def _loss_run(logits: torch.Tensor, labels: torch.Tensor, mode: str, reduction: str = "mean", scale: float = 0.37,
              **kwargs) -> tuple:
    x = logits.clone().requires_grad_()
    loss = next_token_loss(x, labels, mode, reduction=reduction, **kwargs)
    (loss * scale).backward()  # a coefficient on the loss (an accumulation divisor, a loss scale) reaches the grads
    return loss.detach(), {"logits": x.grad}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [None, 1, 7], ids=["one_chunk", "row_by_row", "ragged"])
def test_chunked_cross_entropy_equals_the_fp32_copy_path_in_fp32(reduction, chunk_rows):
    logits, labels = _loss_case(torch.float32)
    ref = _loss_run(logits, labels, "full", reduction)
    _assert_same(_loss_run(logits, labels, "chunked", reduction, chunk_rows=chunk_rows), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_cross_entropy_in_low_precision_is_within_one_unit_in_the_last_place(dtype):
    """The gradient is rounded to the logits' dtype before the scale as well as after: one ulp at most."""
    logits, labels = _loss_case(dtype)
    loss_ref, grad_ref = _loss_run(logits, labels, "full")
    loss, grad = _loss_run(logits, labels, "chunked", chunk_rows=7)
    assert grad["logits"].dtype == dtype
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)  # fp32 either way
    ref = grad_ref["logits"].float()
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(torch.finfo(dtype).tiny))))
    assert ((grad["logits"].float() - ref).abs() <= ulp).all()


def test_chunked_cross_entropy_keeps_no_fp32_tensor_of_the_logits_size():
    """The reference makes fp32 tensors of the logits' size (the copy, the log-probs, their gradient); the
    chunked path's largest fp32 tensor is one chunk."""
    logits, labels = _loss_case(torch.bfloat16, vocab=64)
    full_size = logits[:, :-1].numel()

    class LargestFp32(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    LargestFp32.largest = max(LargestFp32.largest, t.numel())
            return out

    sizes = {}
    for mode in ("full", "chunked"):
        LargestFp32.largest = 0
        with LargestFp32():
            _loss_run(logits, labels, mode, chunk_rows=5)
        sizes[mode] = LargestFp32.largest
    assert sizes["full"] >= full_size
    assert sizes["chunked"] <= 5 * 64


def test_chunked_cross_entropy_without_grad_computes_the_loss_only():
    logits, labels = _loss_case(torch.float32)
    with torch.no_grad():
        loss = next_token_loss(logits, labels, "chunked", chunk_rows=4)
    torch.testing.assert_close(loss, next_token_loss(logits, labels, "full"), rtol=1e-6, atol=0)
    assert ChunkedCrossEntropy.apply(logits.reshape(-1, 97), labels.reshape(-1), 8).grad_fn is None


def test_chunked_comparison_catches_a_wrong_shift():
    """Planted: the labels not shifted (position t scored against token t)."""
    logits, labels = _loss_case(torch.float32)
    ref = _loss_run(logits, labels, "full")
    unshifted = torch.cat([labels[:, :1], labels[:, :-1]], dim=1)  # next_token_loss shifts it back by one too few
    with pytest.raises(AssertionError):
        _assert_same(_loss_run(logits, unshifted, "chunked"), ref, rtol=1e-6, atol=1e-7)


def test_module_loss_is_the_same_with_either_cross_entropy():
    """CausalLMModule._losses, mean and document-row (sum) paths: loss and every parameter's gradient."""
    from dsdebug.models.lm_module import CausalLMModule

    net = build_deepseek_v3(num_hidden_layers=2)
    ids = _ids(seq=32)
    batches = {"mean": {"input_ids": ids, "labels": ids},
               "documents": {"input_ids": ids, "labels": ids, "doc_ids": torch.zeros_like(ids),
                             "position_ids": torch.arange(32).expand(2, -1)}}
    results = {}
    for mode in ("full", "chunked"):
        module = CausalLMModule(net, optimizer=lambda p: torch.optim.AdamW(p), moe_aux_loss_coef=0,
                                moe_metrics=False, cross_entropy=mode)
        for kind, batch in batches.items():
            net.zero_grad(set_to_none=True)
            loss, _ = module._losses(batch, training=True)
            loss.backward()
            results[mode, kind] = (loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters()
                                                   if p.grad is not None})
    for kind in batches:
        _assert_same(results["chunked", kind], results["full", kind], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ optimizer

def _train(net: torch.nn.Module, make_opt) -> dict[str, torch.Tensor]:
    """4 updates from the same gradients on both sides (the real gradients of one batch, scaled per step), so
    the comparison sees the update's rounding, not how a different loss later would train."""
    ids = _ids(seq=16)
    next_token_loss(net(input_ids=ids).logits, ids).backward()
    grads = {p: p.grad.clone() for p in net.parameters()}
    opt = make_opt(param_groups(net.named_parameters()))
    for scale in (1.0, 0.5, 2.0, -1.0):
        for p, g in grads.items():
            p.grad = g * scale
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _adamw(**extra):
    return lambda groups: torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **extra)


def test_fused_adamw_trains_what_foreach_adamw_trains():
    """4 updates of the default optimizer config (decay/no-decay groups) on the tiny model: the same weights."""
    net = build_deepseek_v3(num_hidden_layers=2)
    ref = _train(copy.deepcopy(net), _adamw(foreach=True))
    fused = _train(net, _adamw(fused=True))
    moved = max((fused[n] - p).abs().max() for n, p in build_deepseek_v3(num_hidden_layers=2).named_parameters())
    assert moved > 1e-3  # it trained (same seed: the fresh net is the start)
    _assert_same((torch.zeros(()), fused), (torch.zeros(()), ref), rtol=1e-6, atol=1e-6)


def test_fused_adamw_comparison_catches_a_changed_hyperparameter():
    """Planted: weight decay on every group (the no-decay group's norms and embeddings decayed too)."""
    net = build_deepseek_v3(num_hidden_layers=2)
    ref = _train(copy.deepcopy(net), _adamw(foreach=True))

    def decay_all(groups):
        return torch.optim.AdamW([{"params": g["params"]} for g in groups], lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=0.1, fused=True)

    with pytest.raises(AssertionError):
        _assert_same((torch.zeros(()), _train(net, decay_all)), (torch.zeros(()), ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value, precision, strategy, expected", [
    ("auto", "bf16-mixed", "dsdebug.trainer.strategy.DebugDeepSpeedStrategy", True),
    ("auto", "32-true", "dsdebug.trainer.strategy.DebugDDPStrategy", True),
    ("auto", "16-mixed", "dsdebug.trainer.strategy.DebugDeepSpeedStrategy", True),  # DeepSpeed unscales first
    ("auto", "16-mixed", "dsdebug.trainer.strategy.DebugDDPStrategy", False),  # torch AMP: Lightning clips
    (False, "bf16-mixed", "dsdebug.trainer.strategy.DebugDeepSpeedStrategy", False),  # the user's, as given
    (True, "16-mixed", "dsdebug.trainer.strategy.DebugDDPStrategy", True),
    (None, "32-true", None, None),
])
def test_fused_auto_resolves_per_precision_and_keeps_a_given_value(value, precision, strategy, expected):
    assert resolve_fused(value, precision, strategy) is expected


# ------------------------------------------------------------------------------------------- compile

def _tiny_net():
    return build_deepseek_v3(hidden_size=64, num_hidden_layers=2, vocab_size=256, max_position_embeddings=32)


def test_compiled_blocks_equal_eager_blocks():
    """aot_eager: torch.compile's tracing and autograd (dynamo + AOTAutograd) without inductor's code generation,
    seconds on 2 cores; inductor itself: the slow test below. The router capture's hooks inside the blocks
    still record."""
    net = _tiny_net()
    ref = copy.deepcopy(net)
    capture = RouterCapture(net).attach()
    names = compile_blocks(net, True, backend="aot_eager")
    assert names == ["model.layers.0", "model.layers.1"] == compiled_blocks(net)
    assert all(getattr(net.get_submodule(n), COMPILED_ATTR) for n in names)
    ids = _ids(vocab=256)
    for _ in range(2):  # the compiling call and a cached one
        fast = _run(net, ids)
        assert len(capture.collect()) == 1  # one MoE layer's routing
        _assert_same(fast, _run(ref, ids), rtol=1e-5, atol=1e-6)
    clone = pickle.loads(pickle.dumps(net))  # spawned processes get the net: it pickles, and compiles again there
    torch.testing.assert_close(clone(input_ids=ids).logits, fast[0], rtol=1e-5, atol=1e-6)


def test_compile_off_leaves_the_net_untouched():
    net = _tiny_net()
    before = {n: m.forward for n, m in net.named_modules()}
    assert compile_blocks(net, False) == [] and compiled_blocks(net) == []
    assert "forward" not in net.model.layers[0].__dict__ and {n: m.forward for n, m in net.named_modules()} == before


def test_compiled_comparison_catches_a_wrong_block():
    """Planted: the compiled copy's second block sees slightly different weights."""
    net = _tiny_net()
    ref = copy.deepcopy(net)
    compile_blocks(net, True, backend="aot_eager")
    with torch.no_grad():
        net.model.layers[1].post_attention_layernorm.weight.mul_(1.001)
    with pytest.raises(AssertionError):
        _assert_same(_run(net, _ids(vocab=256)), _run(ref, _ids(vocab=256)), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_compiled_blocks_equal_eager_blocks():
    """model.compile=true as a run uses it (inductor): ~1.5 min on 2 cores with a cold inductor cache."""
    net = _tiny_net()
    ref = copy.deepcopy(net)
    compile_blocks(net, True)
    ids = _ids(vocab=256)
    _assert_same(_run(net, ids), _run(ref, ids), rtol=1e-4, atol=1e-5)


def test_kernel_switches_parse_and_refuse_in_one_line():
    assert compile_setting(False) is False and compile_setting("true") is True and compile_setting(None) is False
    assert cross_entropy_mode("FULL") == "full" and cross_entropy_mode(None) == "full"
    for bad, parse, key in (("maybe", compile_setting, "model.compile"), (1, compile_setting, "model.compile"),
                            ("fast", cross_entropy_mode, "model.cross_entropy")):
        with pytest.raises(ConfigError, match=key) as err:
            parse(bad)
        assert "\n" not in str(err.value) and "valid:" in str(err.value)


def test_switching_kernels_is_not_another_model_for_resume():
    """A checkpoint written before these keys existed (or with other values) resumes: they say how the same
    model runs, not which model it is (src/checkpoint/resume.py NOT_COMPARED)."""
    from dsdebug.checkpoint.resume import config_differences

    before = {"model": {"moe_metrics": True, "net": {"hidden_size": 256}}}
    now = {"model": {"moe_metrics": True, "compile": True, "cross_entropy": "chunked",
                     "net": {"hidden_size": 256, "attn_implementation": "sdpa_pad_v"}}}
    assert config_differences(before, now) == {}
    assert list(config_differences(before, {"model": {**now["model"], "net": {"hidden_size": 512}}})) == [
        "model.net.hidden_size"]
