"""export.int8=true (src/models/int8_export.py): the export's Linear layers in int8 (torch.ao dynamic
quantization); the size shrinks and the validation-perplexity change against fp32 is measured and
reported (export/int8.json, finding export/int8_quantized); a net that int8 hurts (planted: outlier
weights that make the per-tensor scale coarse) is a warning. One 1-process fit (fast)."""

from __future__ import annotations

import json

import torch
from torch import nn

from dsdebug.findings import configure_channel
from dsdebug.models.int8_export import MAX_PPL_CHANGE, export_int8, quantize_int8, state_bytes
from tests.helpers.findings import one, read_findings
from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, train_in_process


class _MLPLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.up, self.down, self.head = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden), nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.head(h + self.down(torch.relu(self.up(h))))


def _batches(vocab: int = 64):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (4, 32), generator=g)} for _ in range(2)]


def test_int8_shrinks_the_linear_layers_and_keeps_the_outputs_close(tmp_path):
    channel = configure_channel(None)
    torch.manual_seed(0)
    net = _MLPLM()
    facts = export_int8(net, tmp_path / "model_int8.pt", _batches())
    # Linear weights are ~97% of this net: int8 is about a quarter of fp32
    assert facts["int8_bytes"] < 0.35 * facts["fp32_bytes"] and facts["quantized_linear"] == 3
    assert abs(facts["val_ppl_change"]) < MAX_PPL_CHANGE
    assert [f.code for f in channel.local] == ["int8_quantized"]
    assert "validation perplexity" in channel.local[0].message
    quantized = quantize_int8(_MLPLM())  # the file loads into a quantized net of the same shape
    quantized.load_state_dict(torch.load(tmp_path / "model_int8.pt", weights_only=False))
    ids = _batches()[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(quantized(ids), quantize_int8(net)(ids))
    assert state_bytes(net) == facts["fp32_bytes"]


def test_outlier_weights_that_int8_cannot_hold_are_a_warning(tmp_path):
    channel = configure_channel(None)
    torch.manual_seed(0)
    net = _MLPLM()
    with torch.no_grad():  # planted: huge weights on a feature that is never active: fp32 does not
        net.embed.weight[:, 0] = 0  # see them, but int8's per-tensor scale rounds every other weight to 0
        net.down.weight[0], net.down.bias[0] = 0, 0
        for layer in (net.up, net.head):
            layer.weight[:, 0] = 1e3 * layer.weight.abs().max()
    facts = export_int8(net, tmp_path / "model_int8.pt", _batches())
    assert abs(facts["val_ppl_change"]) > MAX_PPL_CHANGE
    warning = one([{"code": f.code, **f.details} for f in channel.local], "int8_ppl_change")
    assert warning["val_ppl_change"] == facts["val_ppl_change"]


def test_int8_export_of_a_fit_reports_size_and_perplexity(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = train_in_process(SMOKE + ["export.int8=true", "strategy=ddp", *SMALL_DEEPSEEK], run_dir, shared_cache)
    assert metrics["exports"]["int8"].endswith("model_int8.pt")
    facts = json.loads((run_dir / "export" / "int8.json").read_text())
    assert facts["int8_bytes"] < facts["fp32_bytes"] and facts["val_batches"] == 2  # smoke: limit_val_batches=2
    assert facts["val_ppl_fp32"] > 1 and facts["val_ppl_int8"] > 1
    found = one(read_findings(run_dir, "export"), "int8_quantized")
    assert found["details"]["val_ppl_change"] == facts["val_ppl_change"]
    # the fp32 side is the exported weights: its perplexity is the run's last val/ppl on the same batches
    assert abs(facts["val_ppl_fp32"] - metrics["val/ppl"]) < 1e-3 * metrics["val/ppl"], (facts, metrics.get("val/ppl"))
