"""data.token_budget_lr reaches the update: AdamW's first step moves every weight by ~lr (m / sqrt(v) =
sign(g)), so with the schedule and weight decay off the first update's size is proportional to the LR
actually used. Under DeepSpeed ZeRO-2 (1 process), a token-budget step with the linear rule moves the
weights by its lr_scale (tokens / reference) x the update of the same step with the rule ``none``."""

from __future__ import annotations

import json

from tests.helpers.runs import SMALL_DEEPSEEK, SMOKE, train_in_process
from tests.helpers.short_documents import short_documents_data, write_short_documents


def test_the_linear_rule_scales_the_update_by_the_steps_tokens(tmp_path, shared_cache):
    corpus = write_short_documents(tmp_path / "paragraphs.jsonl")
    rows = {}
    # "replayed": the reproducibility check replays step 0's forward before it trains (training_step runs
    # twice): its tokens must count once (they were counted twice: the LR x2 under linear)
    for rule, extra in (("none", []), ("linear", []),
                        ("replayed", ["+callbacks=reproducibility", "callbacks.reproducibility.replay_steps=1"])):
        out = tmp_path / f"{rule}.json"
        train_in_process(SMOKE + SMALL_DEEPSEEK + short_documents_data(corpus) + [
            "data.token_budget=512", f"data.token_budget_lr={'none' if rule == 'none' else 'linear'}",
            "trainer.max_steps=1", "optim.scheduler=null",
            "optim.optimizer.weight_decay=0", "export.fp32=false", "export.hf=false",
            "+callbacks.update_size._target_=tests.helpers.update_size.UpdateSize", f"+callbacks.update_size.out={out}",
            *extra], tmp_path / rule, shared_cache)
        rows[rule] = json.loads(out.read_text())[0]
    scale = rows["linear"]["lr_scale"]
    assert rows["none"]["lr_scale"] is None and 0.5 < scale < 1  # a step short of the 512-token reference
    assert abs(rows["linear"]["update"] / rows["none"]["update"] - scale) < 1e-3 * scale
    assert rows["replayed"]["lr_scale"] == scale, rows
