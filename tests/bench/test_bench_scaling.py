"""benchmarks/scaling.py: parameter/FLOP accounting for MoE models and the 1-vs-2-rank table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.runs import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import scaling  # noqa: E402

from dsdebug.models.deepseek import build_deepseek_v3  # noqa: E402


def _net(**kw):
    with torch.device("meta"):
        return build_deepseek_v3(vocab_size=512, hidden_size=64, num_hidden_layers=3, **kw)


def test_active_params_count_top_k_of_routed_experts_only():
    net = _net(n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1)
    total, active = scaling.active_params(net)
    emb = net.get_input_embeddings().weight.numel()
    assert total == sum(p.numel() for p in net.parameters()) - emb
    routed = sum(p.numel() for layer in net.model.layers[1:] for p in layer.mlp.experts.parameters())
    assert routed > 0
    assert active == total - int(routed * 6 / 8)
    # all experts active -> active == total; a dense-only model has no experts to discount
    net_all = _net(n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1)
    assert scaling.active_params(net_all)[1] == scaling.active_params(net_all)[0]


def test_flops_per_token_is_6n_plus_attention():
    net = _net()
    cfg = net.config
    _, active = scaling.active_params(net)
    attention = 6 * 128 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 3
    assert scaling.flops_per_token(net, 128) == 6 * active + attention


def test_100m_config_is_about_100m_parameters():
    net, _ = scaling.build_net(["model=deepseek_v3_100m"])
    n = sum(p.numel() for p in net.parameters())
    assert 90e6 < n < 110e6, n


def test_table_from_overhead_results_and_bad_inputs(tmp_path):
    def cell(tps):
        return {"summary": {"none": {"tokens_per_s": tps, "step_ms": 1024 / tps * 1000}}}
    (tmp_path / "o.json").write_text(json.dumps({"cells": {"zero2:1": cell(4000.0), "zero2:2": cell(3000.0)}}))
    run = lambda *a: subprocess.run([sys.executable, str(REPO / "benchmarks" / "scaling.py"), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300, cwd=REPO)
    proc = run("--overhead", str(tmp_path / "o.json"), "--big-steps", "0", "--peak-tflops", "0.1",
               "--out", str(tmp_path / "s"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "s" / "scaling.json").read_text())
    two = next(r for r in res["rows"] if r["ranks"] == 2)
    fpt = res["models"]["deepseek_v3_tiny"]["flops_per_token"]
    assert two["mfu"] == pytest.approx(3000.0 * fpt / 1e11)
    assert "| 0.75x |" in (tmp_path / "s" / "scaling.md").read_text()
    for args, needle in ((["--overhead", str(tmp_path / "nope.json")], "nope.json not found"),
                         (["--overhead", str(tmp_path / "s" / "scaling.md")], "is not overhead.py's")):
        proc = run(*args)
        assert proc.returncode == 2 and proc.stderr.strip().startswith("error:") and needle in proc.stderr, proc.stderr
