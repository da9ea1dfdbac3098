"""`PackingCheck`: packed documents must stay apart -- positions restart, no attention and no labels
across a document boundary -- and the tokens per step must be what the LR assumes.

The config example and the table of metrics and findings: the class docstring (`PackingCheck`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dsdebug.callbacks.base import DebugCallback
from dsdebug.config.args import Rule, integer, number
from dsdebug.data.packing import cross_document_change, padding_fraction, positions_not_reset
from dsdebug.probes.on_the_run import untouched
from dsdebug.probes.train_eval import dropout_off
from dsdebug.distributed import collectives

__all__ = ["PackingCheck"]

# one row per rank, gathered at a probe step (floats; -1 = none)
_FIELDS = ("pos_bad", "pos_row", "pos_doc", "lab_bad", "lab_row", "lab_prev", "lab_doc",
           "leak", "leak_row", "leak_a", "leak_b", "padding", "multi")


def _label_crossings(labels: torch.Tensor, doc_ids: torch.Tensor, shifted: bool) -> list[tuple[int, int, int]]:
    """(row, previous document, document) where a document's last token is trained to predict the next
    document's first token, or a padding position carries a label ((row, -1, -1))."""
    bad = []
    # the label that makes position t-1 predict token t: labels[t] when the module shifts, else labels[t-1]
    starts = (doc_ids[:, 1:] != doc_ids[:, :-1]) & (doc_ids[:, 1:] >= 0) & (doc_ids[:, :-1] >= 0)
    at = labels[:, 1:] if shifted else labels[:, :-1]
    for row, t in (starts & (at != -100)).nonzero().tolist():
        bad.append((row, int(doc_ids[row, t]), int(doc_ids[row, t + 1])))
    for row in ((doc_ids < 0) & (labels != -100)).any(dim=1).nonzero().flatten().tolist():
        bad.append((row, -1, -1))
    return bad


class PackingCheck(DebugCallback):
    """`PackingCheck`: packed documents stay apart, and the tokens per step are what the LR assumes.

    Packing several documents per row (``data.packing=true``) is only right when each document is
    computed as if it were alone: positions restart at 0, no token attends across the boundary, and the
    last token of one document is not trained to predict the first of the next. A net that ignores the
    4-D mask, a collate that drops ``position_ids`` or labels left on the boundary train silently.

    How: on the first step and every ``every_n_steps`` (``on_train_batch_start``, the real batch, before
    the update), EVERY rank
    - reads ``position_ids`` / ``doc_ids`` / ``labels`` of its batch (positions not reset; labels on a
      boundary or on padding; the padding fraction);
    - runs the probe (``cross_document_change``): the first document of a row with several documents
      gets random tokens, two forwards without grad through the module's own ``net_inputs`` (the path
      training uses, so a module that drops the mask is caught), and the other documents' logits must
      not move (> ``leak_atol``). Every rank runs exactly two forwards (under ZeRO-3 a forward gathers
      parameters, a collective), on row 0 when no row holds two documents;
    - then ONE all-gather of a dozen numbers per rank; rank 0 writes the findings, naming rank, row and
      document(s); every rank applies ``on_error``.
    Every step (no collective): ``packing/tokens_per_step`` from the module's count (non-padding tokens
    of the optimizer step, all ranks: ``CausalLMModule`` all-reduces it for the loss anyway).
    Batches without ``doc_ids`` (fixed blocks): one info ``not_packed`` and nothing else.

    Example::

        python train.py data.packing=true data.token_budget=2048 data.token_budget_lr=sqrt +callbacks=packing

    | key / finding code | severity | when |
    |---|---|---|
    | ``packing/tokens_per_step`` | metric | non-padding tokens of the optimizer step, all ranks |
    | ``packing/padding_fraction`` | metric | share of padding in the batches at a probe step (max over ranks) |
    | ``positions_not_reset`` | error | a document whose first position is not 0 (rank, row, document) |
    | ``cross_document_attention`` | error | changing document A moved document B's logits (rank, row, A, B, size) |
    | ``labels_cross_documents`` | error | a document's last token trained to predict the next one's first, or labels on padding (rank, row, documents) |
    | ``padding_high`` | warning | padding fraction above ``max_padding`` |
    | ``tokens_vary`` | warning | ``token_budget_lr=none``: a step's tokens off the reference by more than ``tokens_tolerance``; ``linear``/``sqrt``: a step below ``tokens_tolerance`` x the reference (its LR is scaled that far down) |
    | ``not_packed`` | info | the batches carry no ``doc_ids``: nothing to check |
    | ``packing_summary`` | info | at the end: probes run, tokens per step min/max, padding, largest leak |

    The reference tokens per step: ``token_budget`` x world size x accumulation, else the first step's.
    """
    name = "packing"

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(0, note="0 = the first step only"),
        "leak_atol": number(0, open_low=True),
        "max_padding": number(0, 1),
        "tokens_tolerance": number(0, 1, open_low=True),
        "max_findings": integer(1),
    }

    def __init__(self, every_n_steps: int = 100, leak_atol: float = 1e-3, max_padding: float = 0.25,
                 tokens_tolerance: float = 0.25, max_findings: int = 5, on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(every_n_steps=every_n_steps, leak_atol=leak_atol, max_padding=max_padding,
                            tokens_tolerance=tokens_tolerance, max_findings=max_findings)
        self.every_n_steps, self.leak_atol, self.max_padding = every_n_steps, leak_atol, max_padding
        self.tokens_tolerance, self.max_findings = tokens_tolerance, max_findings
        self._probed: set[int] = set()
        self._packed: bool | None = None
        self._tokens: list[int] = []
        self._reference: int | None = None
        self._worst = {"leak": 0.0, "padding": 0.0}
        self._leak_probes = 0  # probes that found a row with several documents (on some rank)

    # ---- the probe: EVERY rank, same branches --------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step in self._probed or not (step == 0 or not self._probed or self.due(step)):
            return
        self._probed.add(step)
        packed = isinstance(batch, dict) and "doc_ids" in batch  # the same on every rank (one data config)
        if self._packed is None and not packed and trainer.global_rank == 0:
            self.report(trainer, "info", "not_packed",
                        "the batches carry no doc_ids (fixed blocks: data.packing=false, no data.token_budget): "
                        "nothing to check", rank=None)
        self._packed = packed
        if packed:
            self._probe(trainer, pl_module, batch)

    def _probe(self, trainer: Any, pl_module: Any, batch: dict[str, torch.Tensor]) -> None:
        doc_ids, labels = batch["doc_ids"], batch.get("labels", batch["input_ids"])
        pos = positions_not_reset(batch["position_ids"], doc_ids)
        lab = _label_crossings(labels, doc_ids, getattr(pl_module, "shifts_labels", True))
        multi = (doc_ids.amax(dim=1) >= 1).nonzero().flatten().tolist()
        row = multi[0] if multi else 0
        first = int(doc_ids[row, 0])
        changes = self._leak(pl_module, batch, row, first)  # two forwards, on every rank
        worst_b, leak = max(changes.items(), key=lambda kv: kv[1], default=(-1, 0.0)) if multi else (-1, 0.0)
        mine = [len(pos), *(pos[0] if pos else (-1, -1)), len(lab), *(lab[0] if lab else (-1, -1, -1)),
                leak, row if multi else -1, first if multi else -1, worst_b, padding_fraction(doc_ids), float(bool(multi))]
        table = self._gather(trainer, torch.tensor(mine, dtype=torch.float64))
        self._judge(trainer, [dict(zip(_FIELDS, r)) for r in table.tolist()])

    def _leak(self, pl_module: Any, batch: dict[str, torch.Tensor], row: int, doc: int) -> dict[int, float]:
        net = getattr(pl_module, "net", pl_module)
        inputs = getattr(pl_module, "net_inputs", lambda b: {"input_ids": b["input_ids"]})
        vocab = getattr(getattr(net, "config", None), "vocab_size", None)
        try:
            # without gradients, dropout off, and the run's RNG, buffers and modes put back: two forwards that
            # differ only in document `doc`, and nothing the run trains changes
            with untouched(net), dropout_off(net):
                return cross_document_change(net, batch, row, doc, forward=lambda one: net(**inputs(one)),
                                             vocab_size=vocab, per_document=True)
        finally:
            moe = getattr(pl_module, "moe", None)  # the probe's router records must not count in the next step
            if getattr(moe, "capture", None) is not None:
                moe.capture.collect()

    @staticmethod
    def _gather(trainer: Any, mine: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE (world > 1): every rank's row."""
        if trainer.world_size <= 1:
            return mine[None]
        out = collectives.all_gather(trainer, mine.to(trainer.strategy.root_device))
        return out.reshape(trainer.world_size, -1).cpu()

    def _judge(self, trainer: Any, ranks: list[dict[str, float]]) -> None:
        """Every rank, from the gathered table (alike everywhere): rank 0 writes, all apply the policy."""
        def cap(severity: str, code: str, message: str, advice: str, rank: int | None, details: dict) -> None:
            self.report_capped(trainer, severity, code, message, advice, details, rank=rank, limit=self.max_findings)

        for rank, r in enumerate(ranks):
            if r["pos_bad"] > 0:
                row, doc = int(r["pos_row"]), int(r["pos_doc"])
                cap("error", "positions_not_reset",
                    f"rank {rank}: batch row {row}, document {doc} starts at a position other than 0 "
                    f"({int(r['pos_bad'])} document(s) in this batch): positions run on across packed documents",
                    "give each document position_ids from 0 (dsdebug.data.packing.pack_documents does); a custom "
                    "dataset/collate must keep them", rank, {"row": row, "document": doc, "count": int(r["pos_bad"])})
            if r["lab_bad"] > 0:
                row, prev, doc = int(r["lab_row"]), int(r["lab_prev"]), int(r["lab_doc"])
                where = (f"document {prev}'s last token is trained to predict document {doc}'s first token"
                         if prev >= 0 else "padding positions carry labels")
                cap("error", "labels_cross_documents",
                    f"rank {rank}: batch row {row}: {where} ({int(r['lab_bad'])} place(s) in this batch)",
                    "set labels to -100 on each document's first token and on padding", rank,
                    {"row": row, "previous_document": prev, "document": doc, "count": int(r["lab_bad"])})
            if not r["leak"] <= self.leak_atol:  # NaN logits count as a change
                row, a, b = int(r["leak_row"]), int(r["leak_a"]), int(r["leak_b"])
                cap("error", "cross_document_attention",
                    f"rank {rank}: batch row {row}: changing document {a} moved document {b}'s logits by "
                    f"{r['leak']:.3g} (> {self.leak_atol:g}): documents attend to each other",
                    "pass the document mask and per-document position_ids to the net (CausalLMModule.net_inputs), "
                    "and use a net whose forward honours attention_mask", rank,
                    {"row": row, "document_a": a, "document_b": b, "change": r["leak"]})
            if r["padding"] > self.max_padding:
                cap("warning", "padding_high",
                    f"rank {rank}: {r['padding']:.1%} of the batch is padding (> {self.max_padding:.0%})",
                    "pack documents (data.packing=true), or use data.token_budget so short rows batch together",
                    rank, {"padding_fraction": r["padding"]})
        self._worst["leak"] = max(self._worst["leak"], max(r["leak"] for r in ranks))
        self._leak_probes += any(r["multi"] > 0 for r in ranks)
        padding = max(r["padding"] for r in ranks)
        self._worst["padding"] = max(self._worst["padding"], padding)
        if trainer.global_rank == 0:
            for lg in trainer.loggers:
                lg.log_metrics({"packing/padding_fraction": padding}, step=trainer.global_step)

    # ---- tokens per step: every rank, no collective (the module's count is global) --------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        tokens = getattr(pl_module, "last_step_tokens", None)
        if not self._packed or tokens is None:
            return
        pl_module.last_step_tokens = None  # read once per optimizer step
        self._tokens.append(tokens)
        dm = getattr(trainer, "datamodule", None)
        rule = getattr(dm, "token_budget_lr", "none")
        if self._reference is None:
            self._reference = getattr(dm, "reference_tokens_per_step", None) or tokens
        ratio = tokens / self._reference
        step = trainer.global_step - 1  # the step just taken (the counter has moved on), as train/loss
        if trainer.global_rank == 0:
            for lg in trainer.loggers:
                lg.log_metrics({"packing/tokens_per_step": float(tokens)}, step=step)
        if rule == "none" and abs(ratio - 1) > self.tokens_tolerance:
            self.report_capped(
                trainer, "warning", "tokens_vary",
                f"this step carried {tokens} tokens, {ratio:.2f}x the reference {self._reference}; the LR is not "
                "scaled (data.token_budget_lr=none), so this step's update weighs as much as a full one",
                "set data.token_budget_lr=linear or sqrt, or pack documents (data.packing=true)",
                {"tokens": tokens, "reference": self._reference, "ratio": ratio}, step=step, limit=self.max_findings)
        elif rule != "none" and ratio < self.tokens_tolerance:
            self.report_capped(
                trainer, "warning", "tokens_vary",
                f"this step carried {tokens} tokens, {ratio:.2f}x the reference {self._reference}: "
                f"data.token_budget_lr={rule} scales its LR down to {getattr(pl_module, 'last_lr_scale', None)}x, "
                "far from the batch the LR was tuned at",
                "pack documents (data.packing=true) so rows fill up, or lower data.token_budget",
                {"tokens": tokens, "reference": self._reference, "ratio": ratio}, step=step, limit=self.max_findings)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != 0 or not self._packed:
            return
        tokens = self._tokens or [0]
        self.report(trainer, "info", "packing_summary",
                    f"{len(self._probed)} probe step(s), {self._leak_probes} with a row of several documents "
                    f"(largest cross-document change {self._worst['leak']:.3g}); tokens per step "
                    f"{min(tokens)}..{max(tokens)} (reference {self._reference}); padding up to "
                    f"{self._worst['padding']:.1%}",
                    details={"probes": len(self._probed), "leak_probes": self._leak_probes,
                             "tokens_min": min(tokens), "tokens_max": max(tokens),
                             "padding_max": self._worst["padding"], "leak_max": self._worst["leak"]},
                    rank=None)
