"""`ModelGraph`: a view of the model as trained -- module tree, parameter counts, trainable/frozen, ZeRO-3.

The config example and the table of files and findings: the class docstring (`ModelGraph`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

from dsdebug.callbacks.base import DebugCallback
from dsdebug.config.args import Rule, boolean, integer
from dsdebug.models.graph_view import human, module_rows, render_markdown, render_svg

__all__ = ["ModelGraph"]


class ModelGraph(DebugCallback):
    """`ModelGraph`: a view of the model as trained -- module tree, parameter counts, trainable/frozen, ZeRO-3.

    At the start of training (after the strategy built the model: freezing, adapters and ZeRO-3
    partitioning are in place), rank 0 writes ``model_graph/model_graph.svg`` and ``model_graph.md`` in
    the run dir: one box per module down to ``max_depth`` (names, types, parameters under it, trainable /
    frozen, its own parameters' shapes; identical repeated siblings such as decoder layers folded into one
    row ``x N``), green = trainable, grey = frozen, amber = mixed, dashed = ZeRO-3 partitioned (with the
    share rank 0 holds). No forward runs (src/models/graph_view.py: a 7B DeepSeek config on the meta device
    renders in well under a second); the report embeds the SVG. Rank 0 only, no collective.

    Example::

        python train.py +callbacks=model_graph strategy=zero3 trainer=ddp_sim

    It logs no metrics.

    | finding code | severity | meaning |
    |---|---|---|
    | ``model_graph`` | info | parameters, trainable, frozen (and ZeRO-3 partitioned) totals; where the files are |
    """
    name = "model_graph"
    policies = ("warn",)
    policy_note = "it reports information only"

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "max_depth": integer(0),
        "fold_repeats": boolean(),
    }

    def __init__(self, max_depth: int = 5, fold_repeats: bool = True, on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(max_depth=max_depth, fold_repeats=fold_repeats)
        self.max_depth, self.fold_repeats = max_depth, fold_repeats

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != 0:
            return
        net = getattr(pl_module, "net", pl_module)
        start = time.perf_counter()
        rows = module_rows(net, self.max_depth, self.fold_repeats)
        out = Path(trainer.default_root_dir) / "model_graph"
        out.mkdir(parents=True, exist_ok=True)
        (out / "model_graph.svg").write_text(render_svg(rows, type(net).__name__))
        (out / "model_graph.md").write_text(render_markdown(rows))
        root = rows[0]
        zero = f", ZeRO-3 partitioned: rank 0 holds {human(root.local)}" if root.partitioned else ""
        self.report(trainer, "info", "model_graph",
                    f"{type(net).__name__}: {human(root.params)} parameters, {human(root.trainable)} trainable, "
                    f"{human(root.frozen)} frozen{zero}; module tree in {out.name}/model_graph.svg and .md",
                    details={"params": root.params, "trainable": root.trainable, "frozen": root.frozen,
                             "partitioned": root.partitioned, "rank0_holds": root.local, "rows": len(rows),
                             "seconds": round(time.perf_counter() - start, 3)}, rank=None)
