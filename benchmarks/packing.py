"""What packing buys: trained (label-counted) tokens per second of the tiny DeepSeek-V3 on short documents,
one process, forward + backward + AdamW step through ``CausalLMModule._losses`` (the training path: the
document mask, restarting positions, the token-mean loss), no Lightning around it.

    python benchmarks/packing.py                       # pydoc paragraphs (~40 tokens each), rows of 128
    python benchmarks/packing.py --steps 20 --corpus kjv

Modes (each: the same model init, its own batches of the same corpus):
- ``blocks``: today's default, fixed 8 x 128 windows of the token stream (documents share windows);
- ``one_per_row``: one document per row padded to 128, 8 rows (what a per-example pipeline does);
- ``one_per_row_budget``: one document per row, token budget 1024 per step, batch cut to its longest row;
- ``packed``: several documents per row, 8 x 128, with the document mask;
- ``packed_budget``: packed rows, token budget 1024.
Per mode: median step seconds (after 3 warm-up steps), trained tokens per step, the untrained share
(padding and each document's first token: labels -100),
trained tokens per second. The host's load average is recorded: the 2-core machine is shared.
Results: logs/bench/packing/results.json and packing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def corpus_tokens(name: str, cache: Path):
    from dsdebug.data.corpus import KJVCorpus, TextFilesCorpus
    from dsdebug.data.tokenizer import ensure_cache
    from tests.helpers.short_documents import write_short_documents

    if name == "kjv":
        source = KJVCorpus()
    else:
        source = TextFilesCorpus(paths=str(write_short_documents(cache / "paragraphs.jsonl")))
    entry = ensure_cache(source, 4096, cache / "data")
    tok = entry.load_tokenizer()
    return entry.load_tokens(), tok.eos_token_id, tok.pad_token_id


def batches(mode: str, tokens, eos: int, pad: int, seq_len: int, batch: int, budget: int, steps: int):
    import torch

    from dsdebug.data.document_rows import DocumentRows, trim_collate
    from dsdebug.data.token_budget import TokenBudgetBatchSampler

    if mode == "blocks":
        n = len(tokens) // seq_len
        ids = torch.as_tensor(tokens[: n * seq_len].astype("int64")).view(n, seq_len)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        return [{"input_ids": ids[order[i * batch:(i + 1) * batch]]} for i in range(steps)]
    rows = DocumentRows(tokens, eos, seq_len, pad, packed=mode.startswith("packed"))
    if mode.endswith("budget"):
        groups = TokenBudgetBatchSampler(rows.lengths, budget, seed=0).all_batches()[:steps]
        return [trim_collate([rows[i] for i in g]) for g in groups]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    return [{k: v[order[s * batch:(s + 1) * batch]] for k, v in rows.rows.items()} for s in range(steps)]


def measure(mode: str, data: list, warmup: int) -> dict:
    import torch

    from dsdebug.models.deepseek import build_deepseek_v3
    from dsdebug.models.lm_module import CausalLMModule

    torch.manual_seed(0)
    net = build_deepseek_v3(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                            max_position_embeddings=128)
    module = CausalLMModule(net=net, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), moe_aux_loss_coef=0)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    times, trained, slots = [], [], []
    for i, batch in enumerate(data):
        start = time.perf_counter()
        loss, _ = module._losses(batch, training=True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            labels = batch.get("labels", batch["input_ids"])
            trained.append(int((labels[:, 1:] != -100).sum()))
            slots.append(batch["input_ids"].numel())
    step = statistics.median(times)
    per_step = statistics.mean(trained)
    return {"mode": mode, "steps": len(times), "step_s": round(step, 4), "trained_tokens_per_step": round(per_step, 1),
            "padding": round(1 - sum(trained) / sum(slots), 4), "trained_tokens_per_s": round(per_step / step, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", choices=("pydoc", "kjv"), default="pydoc")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=REPO / "logs" / "bench" / "packing")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # one core per run, as a CPU rank gets
    args.out.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("DSDEBUG_CACHE_DIR", tempfile.mkdtemp()))
    tokens, eos, pad = corpus_tokens(args.corpus, cache)
    warmup = 3
    results = {"corpus": args.corpus, "load_before": round(os.getloadavg()[0], 2), "modes": []}
    for mode in ("blocks", "one_per_row", "one_per_row_budget", "packed", "packed_budget"):
        data = batches(mode, tokens, eos, pad, 128, 8, 1024, args.steps + warmup)
        results["modes"].append(measure(mode, data, warmup))
        print(json.dumps(results["modes"][-1]), flush=True)
    results["load_after"] = round(os.getloadavg()[0], 2)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = ["| mode | median step s | trained tokens / step | untrained share | trained tokens / s |", "|---|---|---|---|---|"]
    lines += [f"| {m['mode']} | {m['step_s']} | {m['trained_tokens_per_step']} | {m['padding']:.1%} | "
              f"{m['trained_tokens_per_s']} |" for m in results["modes"]]
    (args.out / "packing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"load average {results['load_before']} -> {results['load_after']}")


if __name__ == "__main__":
    main()
