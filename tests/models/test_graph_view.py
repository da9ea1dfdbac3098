"""The model view (src/models/graph_view.py, callback model_graph): a 7B DeepSeek config on the meta device
renders with no weight allocated; counts, trainable/frozen and ZeRO-3 partitioning are right; the run dir
and the report hold the SVG."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET

import torch
from torch import nn

from dsdebug.models.deepseek import build_deepseek_v3
from dsdebug.models.graph_view import module_rows, render_markdown, render_svg
from tests.helpers.findings import one, read_findings
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, train_in_process
from tests.planted.ckpt import BlockLM

# DeepSeek-V3 architecture at ~6.3B parameters (MLA as in V2-Lite, 8 routed + 1 shared experts, vocab 102400)
SEVEN_B = dict(vocab_size=102400, hidden_size=4096, num_hidden_layers=28, num_attention_heads=32,
               intermediate_size=11008, moe_intermediate_size=1408, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
               v_head_dim=128, max_position_embeddings=4096)


def test_a_7b_deepseek_config_on_the_meta_device_renders_without_allocating(capsys):
    start = time.perf_counter()
    with torch.device("meta"):
        net = build_deepseek_v3(**SEVEN_B)
    built = time.perf_counter()
    net.model.embed_tokens.weight.requires_grad_(False)
    rows = module_rows(net)
    svg = render_svg(rows, "deepseek_v3 7B")
    with capsys.disabled():  # timings are reported, not asserted (docs/toolbox.md)
        print(f"\n7B meta: build {built - start:.2f} s, view {time.perf_counter() - built:.3f} s, {len(rows)} rows")
    assert all(p.is_meta for p in net.parameters())  # nothing allocated
    root = rows[0]
    assert root.params == sum(p.numel() for p in net.parameters()) and 6e9 < root.params < 7e9
    assert root.frozen == 102400 * 4096 == root.params - root.trainable
    layers = [r for r in rows if r.repeat > 1 and r.type == "DeepseekV3DecoderLayer"]
    assert len(layers) == 1 and layers[0].repeat == 27 and layers[0].repeat_names == "model.layers.1 .. model.layers.27"
    assert layers[0].params == sum(p.numel() for i in range(1, 28) for p in net.model.layers[i].parameters())
    ET.fromstring(svg)  # well-formed
    assert "model.embed_tokens: Embedding" in svg and "weight [102400, 4096] frozen" in svg and "x 27" in svg


def test_zero3_partitioning_is_marked_with_the_share_this_rank_holds():
    net = BlockLM(vocab_size=64, hidden=8, num_layers=2)
    for p in net.layers.parameters():  # what DeepSpeed ZeRO-3 leaves on a parameter at 2 ranks
        full = p.numel()
        p.ds_numel, p.ds_shape, p.ds_tensor = full, p.shape, torch.empty((full + 1) // 2)
        p.data = torch.empty(0)
    rows = {r.name: r for r in module_rows(net, fold_repeats=False)}
    assert rows["layers.0"].partitioned == rows["layers.0"].params == sum(p.ds_numel for p in net.layers[0].parameters())
    assert 0 < rows["layers.0"].local < rows["layers.0"].params and rows["embed"].partitioned == 0
    svg = render_svg(list(rows.values()))
    assert svg.count('stroke-dasharray') == sum(1 for r in rows.values() if r.partitioned)
    assert "ZeRO-3: this rank holds" in svg and "ZeRO-3" in render_markdown(list(rows.values()))


def test_trainable_frozen_and_mixed_are_coloured():
    net = BlockLM(vocab_size=64, hidden=8, num_layers=2, freeze_embedding=True)
    rows = module_rows(net)
    svg = render_svg(rows)
    assert "#e6e6e6" in svg and "#fde9c4" in svg and "#d9f2d9" in svg  # embed frozen, root mixed, blocks trainable
    assert isinstance(net, nn.Module) and rows[0].frozen == 64 * 8


def test_the_run_dir_and_the_report_hold_the_svg_under_zero3(tmp_path, shared_cache):
    run = tmp_path / "run"
    train_in_process(SMOKE + [*SMALL_DEEPSEEK, "strategy=zero3", "trainer.max_steps=1", "trainer.limit_val_batches=0",
                              "export.hf=false", "+callbacks=model_graph"], run, shared_cache)
    finding = one(read_findings(run, "model_graph"), "model_graph")
    assert finding["details"]["partitioned"] == finding["details"]["params"] > 0  # 1 rank holds it all
    svg = (run / "model_graph" / "model_graph.svg").read_text()
    assert "stroke-dasharray" in svg and "DeepseekV3DecoderLayer" in svg
    assert svg.strip() in (run / "report.html").read_text()
    assert "report_files/model_graph.svg" in (run / "report.md").read_text()
