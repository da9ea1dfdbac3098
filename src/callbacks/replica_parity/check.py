"""`ReplicaParity`: data-parallel replicas still hold the same weights, optimizer scalars and config.

The config example and the table of metrics and findings: the class docstring (`ReplicaParity`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, ClassVar

import torch

from dsdebug.config.args import Rule, boolean, integer
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import _at_accumulation_boundary, display_name
from dsdebug.callbacks.replica_parity.checksums import _fp64, _scalar, checksums, divergent
from dsdebug.distributed import collectives

__all__ = ["ReplicaParity", "checksums", "divergent"]

log = logging.getLogger(__name__)

# kind -> (finding code, severity, advice)
_KINDS = {
    "param": ("replica_divergence", "error",
              "replicas train different models from here on: find what wrote the weights on that rank only (a "
              "rank-conditional in-place op, a forward that edits its weights, a checkpoint loaded on some ranks, "
              "memory errors: check the GPU's ECC/Xid log); restart from the last checkpoint before that step"),
    "optimizer": ("optimizer_state_divergence", "error",
                  "ranks step differently: a scheduler or optimizer stepped on some ranks only, or a resume restored "
                  "another state on some ranks; restart from a checkpoint every rank loaded"),
    "buffer": ("buffer_divergence", "warning",
               "buffers are not averaged: use SyncBatchNorm or broadcast the buffer if every rank must agree; a "
               "buffer that should be constant was written on some ranks only"),
    "config": ("config_hash_mismatch", "warning",
               "every rank must run the same config and seed: same overrides on every node when resuming"),
}


class ReplicaParity(DebugCallback):
    """`ReplicaParity`: data-parallel replicas still hold the same weights, optimizer scalars and config.

    Catches replicas that drifted apart silently (NeMo's ``DdpParityChecker`` hashes the
    parameters of every data-parallel replica the same way): a bit flip in one rank's memory, a
    rank-local in-place write (``if rank == 1: w.add_(...)``, a forward that edits its weights, a
    checkpoint loaded on some ranks only), a frozen parameter or buffer that was never broadcast.
    DDP does not re-sync weights after wrapping, so such a difference stays and every rank trains
    another model while the loss still looks fine. A replay mismatch on one rank only
    (``reproducibility``) points here.

    How (every rank, at the same point: ``on_before_optimizer_step`` at the accumulation boundary of
    every ``every_n_steps``-th step, the first step of every fit (so also right after a resume), and
    at ``on_train_end``): each rank computes three numbers per tensor: the wrapping int32 sum of its raw bits,
    a position-weighted sum of its bits (both exact and order-independent: they detect any single
    bit flip and swapped elements, with no tolerance and no false alarm from summation order) and
    the sum of its values (only for the message), computed on the tensor's own device (no value read on
    the host per tensor; the table is one tensor on the collective's device). ONE ``all_gather`` of
    ``[n_entries x 3]`` int64 follows, read on the host once; every rank compares the same table, so every rank reaches the same verdict (a
    ``stop`` policy acts on all); rank 0 writes the finding. The reference is the largest group of
    equal ranks (rank 0's on a tie: with 2 ranks there is no majority, rank 0 is the reference).
    One process: nothing to compare, the hooks return at once.

    What is compared, per strategy:

    - DDP (and ZeRO-0): every parameter and buffer (``p.data``: full on every rank).
    - ZeRO-1/2: the same. The working (fp32/bf16) parameters are full on every rank after each
      step's all-gather from the partitioned master weights (verified: equal bit for bit in a
      healthy 2-process run). That all-gather also overwrites a corrupted copy, so a divergence
      lasts one step: the finding says which step was computed with other weights, and
      ``replicas_equal_again`` follows. Master weights and Adam moments are partitioned: one owner,
      no replica, nothing to compare.
    - ZeRO-3: parameters are partitioned (``p.ds_tensor`` is this rank's slice: different by
      design, no replica inside one data-parallel group unless hpZ/MiCS, which this check does not
      cover). Compared: the persistent parameters (numel <= ``stage3_param_persistence_threshold``,
      kept whole on every rank), buffers, and the scalars below. A corrupted partition is NOT
      detectable here (it is the only copy).
    - Always: learning rate per param group, optimizer step count (DeepSpeed: the engine's
      ``global_steps`` and ``skipped_steps``; torch: the first state's ``step``), loss scale, the
      last global grad norm (DeepSpeed), and the hashes of the seed and the resolved config (the
      ``config/fingerprint.py``'s ``config_hash``, as the ``consistency`` check, re-checked at every check, so after a resume too).

    Example::

        python train.py +callbacks=replica_parity trainer=ddp_sim strategy=ddp \\
            callbacks.replica_parity.every_n_steps=10 callbacks.replica_parity.on_error=stop

    | metric key (at each check) | meaning |
    |---|---|
    | ``parity/check_ms`` | wall time of the check on rank 0 (checksums + the all_gather) |

    | finding code | severity | when |
    |---|---|---|
    | ``replica_divergence`` | error | a parameter differs across ranks: names the first rank that differs, the first parameter (module order), the step last equal |
    | ``optimizer_state_divergence`` | error | LR, optimizer step count, loss scale or last grad norm differs |
    | ``buffer_divergence`` | warning | a buffer differs (BatchNorm running stats differ per rank by design without SyncBatchNorm); not compared under DDP with ``broadcast_buffers=True``, which copies rank 0's at every forward |
    | ``config_hash_mismatch`` | warning | the resolved config or the seed differs (e.g. a resume with other overrides on some ranks) |
    | ``replicas_equal_again`` | info | a divergence is gone (ZeRO-1/2 re-gathers the weights every step) |
    | ``parity_summary`` | info | at the end: checks, what was compared, time per check, divergences |

    Resume (``state_attrs``, from the gathered checksums, alike on every rank): per kind whether it is
    divergent, since when and the step last equal; the finding counts and the checks done.
    """
    name = "replica_parity"
    policies = ("warn", "stop")
    policy_note = "skip: skipping one update does not bring replicas back together"
    state_attrs = ("_state", "_counts", "_checks")

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(0, note="0 = only the first step and the end"),
        "buffers": boolean(),
        "max_findings_per_code": integer(1),
    }

    def __init__(self, every_n_steps: int = 50, buffers: bool = True, max_findings_per_code: int = 5,
                 on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(every_n_steps=every_n_steps, buffers=buffers, max_findings_per_code=max_findings_per_code)
        self.every_n_steps, self.buffers, self.max_findings = every_n_steps, buffers, max_findings_per_code
        self.run_config: Any = None
        self._entries: list[tuple[str, str, Callable[[], torch.Tensor]]] = []
        self._state: dict[str, dict[str, Any]] = {k: {"diverged": False, "last_equal": None, "since": None}
                                                  for k in _KINDS}
        self._counts: dict[str, int] = {}
        self._checks, self._ms, self._fit_step = 0, [], None
        self._weights: dict[torch.device, torch.Tensor] = {}  # position weights per device (checksums)

    def bind_config(self, cfg: Any) -> None:
        """The run's config (trainer/entry.py bind_config calls this, last before fit), hashed as consistency does."""
        self.run_config = cfg

    # ---- setup: every rank, local ------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._entries, self._fit_step = [], None
        if trainer.world_size <= 1:
            log.info("replica_parity: 1 process, no replicas to compare (off)")
            return
        zero3 = bool(getattr(trainer.strategy, "zero_stage_3", False))
        partitioned = 0
        for n, p in pl_module.named_parameters():
            if zero3 and hasattr(p, "ds_tensor") and not getattr(p, "ds_persist", False):
                partitioned += 1  # one owner per slice: no replica to compare
                continue
            self._entries.append(("param", display_name(n), (lambda p=p: p.data)))
        model = getattr(trainer.strategy, "model", None)
        broadcast = isinstance(model, torch.nn.parallel.DistributedDataParallel) and bool(model.broadcast_buffers)
        if self.buffers and broadcast:
            # DDP copies rank 0's buffers to every rank at each training forward: BatchNorm statistics that
            # differ after a step are overwritten before the next one (and rank 0's are saved) -- not a drift
            log.info("replica_parity: buffers not compared (DDP broadcast_buffers=True copies rank 0's at every "
                     "forward)")
        elif self.buffers:
            self._entries += [("buffer", display_name(n), (lambda b=b: b)) for n, b in pl_module.named_buffers()]
        self._entries += self._scalar_entries(trainer)
        self._partitioned = partitioned
        log.info("replica_parity: comparing %d parameters, %d buffers and %d scalars across %d ranks every %s "
                 "step(s)%s", *(sum(k == kind for k, _, _ in self._entries) for kind in ("param", "buffer")),
                 sum(k in ("optimizer", "config") for k, _, _ in self._entries), trainer.world_size,
                 self.every_n_steps or "first/last",
                 f"; {partitioned} ZeRO-3 partitioned parameters cannot be compared" if partitioned else "")

    def _scalar_entries(self, trainer: Any) -> list[tuple[str, str, Callable[[], torch.Tensor]]]:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        from dsdebug.config.fingerprint import config_facts, config_hash

        entries: list[tuple[str, str, Callable[[], torch.Tensor]]] = []
        opt = trainer.optimizers[0] if trainer.optimizers else None
        for i in range(len(opt.param_groups) if opt is not None else 0):
            entries.append(("optimizer", f"lr[group {i}]", lambda i=i: _scalar(opt.param_groups[i].get("lr"))))
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            engine = trainer.strategy.deepspeed_engine
            entries += [
                ("optimizer", "optimizer steps", lambda: _scalar(engine.global_steps)),
                ("optimizer", "skipped steps", lambda: _scalar(engine.skipped_steps)),
                ("optimizer", "loss scale", lambda: _scalar(getattr(engine.optimizer, "cur_scale", 1.0))),
                ("optimizer", "last global grad norm", lambda: _scalar(engine.get_global_grad_norm())),
            ]
        elif opt is not None:
            entries.append(("optimizer", "optimizer steps", lambda: _scalar(_torch_steps(opt))))
        if self.run_config is not None:
            digest = config_hash(config_facts(self.run_config))
            seed = hashlib.sha256(str(self.run_config.get("seed")).encode()).hexdigest()[:16]
            for name, h in (("config hash", digest), ("seed", seed)):
                packed = torch.tensor([int(h[:15], 16)], dtype=torch.int64)
                entries.append(("config", f"{name} {h}", lambda t=packed: t))
        return entries

    # ---- the check: EVERY rank, same steps, same decision --------------------------------
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._entries or not _at_accumulation_boundary(trainer):
            return
        step = trainer.global_step
        first = self._fit_step is None
        if first or (self.due(step) and step != self._fit_step):
            self._fit_step = step
            self._check(trainer, pl_module, step, f"before the update of step {step}")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._entries:
            return
        self._check(trainer, pl_module, trainer.global_step, f"at the end (after {trainer.global_step} steps)")
        if trainer.global_rank == 0:
            ms = sum(self._ms) / max(1, len(self._ms))
            bad = {k: s["since"] for k, s in self._state.items() if s["diverged"]}
            self.report(trainer, "info", "parity_summary",
                        f"{self._checks} checks over {trainer.world_size} ranks ({len(self._entries)} entries, "
                        f"{ms:.1f} ms per check); divergent at the end: {bad or 'none'}; findings: "
                        f"{self._counts or 'none'}",
                        details={"checks": self._checks, "ms_per_check": ms, "entries": len(self._entries),
                                 "zero3_partitioned_not_compared": self._partitioned, "counts": dict(self._counts),
                                 "divergent_at_end": bad}, rank=None)

    def _check(self, trainer: Any, pl_module: Any, step: int, when: str) -> None:
        started = time.perf_counter()
        tensors = [get() for _, _, get in self._entries]
        # computed on each tensor's device (position weights cached per device), the table on the
        # collective's device, read on the host once: after the gather
        device = trainer.strategy.root_device
        mine = checksums(tensors, self._weights, device=device)
        # COLLECTIVE, every rank: one all_gather of [n x 3] int64
        gathered = collectives.all_gather(trainer, mine).cpu().reshape(trainer.world_size, *mine.shape)
        self._checks += 1
        self._ms.append((time.perf_counter() - started) * 1e3)
        found: dict[str, list] = {k: [] for k in _KINDS}
        for i, ref, outliers in divergent(gathered):
            found[self._entries[i][0]].append((i, ref, outliers))
        for kind, hits in found.items():
            state = self._state[kind]
            if hits and not state["diverged"]:
                state["diverged"], state["since"] = True, step
                self._divergence(trainer, pl_module, kind, hits, gathered, step, when, state["last_equal"])
            elif not hits:
                if state["diverged"]:
                    self._emit(trainer, pl_module, "info", "replicas_equal_again",
                               f"{kind}s equal again on every rank at the check {when} (divergent since the "
                               f"check at step {state['since']})", "", {"kind": kind, "since": state["since"]}, None)
                state["diverged"], state["last_equal"] = False, step
        if trainer.global_rank == 0:
            for lg in trainer.loggers:
                lg.log_metrics({"parity/check_ms": self._ms[-1]}, step=step)

    def _divergence(self, trainer: Any, pl_module: Any, kind: str, hits: list, gathered: torch.Tensor,
                    step: int, when: str, last_equal: int | None) -> None:
        code, severity, advice = _KINDS[kind]
        i, ref, outliers = hits[0]
        ranks = sorted({r for _, _, out in hits for r in out})
        name = self._entries[i][1]
        val_bad, val_ref = _fp64(int(gathered[outliers[0], i, 2])), _fp64(int(gathered[ref[0], i, 2]))
        total = sum(k == kind for k, _, _ in self._entries)
        last = f"last equal at step {last_equal}" if last_equal is not None else "no earlier check was equal"
        zero12 = kind == "param" and _zero12(trainer)
        message = (f"rank {outliers[0]} differs from rank(s) {ref} in {name} (first of {len(hits)}/{total} differing "
                   f"{kind}s in module order; ranks that differ: {ranks}) at the check {when}; {last}; value "
                   f"sum {val_bad:.10g} on rank {outliers[0]} vs {val_ref:.10g} on rank {ref[0]} "
                   f"(diff {val_bad - val_ref:.3g})"
                   + ("; ZeRO-1/2 re-gathers the weights at every step, so this rank computed step "
                      f"{step}'s gradients with other weights" if zero12 else ""))
        details = {"kind": kind, "first": name, "first_rank": outliers[0], "ranks": ranks, "reference_ranks": ref,
                   "last_equal_step": last_equal, "names": [self._entries[j][1] for j, _, _ in hits[:50]],
                   "count": len(hits), "value_sum": {"culprit": val_bad, "reference": val_ref}}
        if zero12:
            advice = "the next step's all-gather restores the copy, but this step's gradients came from other " \
                     "weights; " + advice.split(": ", 1)[1]
        self._emit(trainer, pl_module, severity, code, message, advice, details,
                   ranks[0] if len(ranks) == 1 else None)

    def _emit(self, trainer: Any, pl_module: Any, severity: str, code: str, message: str, advice: str,
              details: dict, rank: int | None) -> None:
        """Called on EVERY rank with the same decision: rank 0 writes, every rank applies the policy."""
        self.report_capped(trainer, severity, code, message, advice, details, rank=rank, limit=self.max_findings)


def _torch_steps(opt: Any) -> float | None:
    for state in getattr(opt, "state", {}).values():
        if "step" in state:
            return float(state["step"])
    return None


def _zero12(trainer: Any) -> bool:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    stage = ((getattr(trainer.strategy, "config", None) or {}).get("zero_optimization") or {}).get("stage", 0)
    return isinstance(trainer.strategy, DeepSpeedStrategy) and stage in (1, 2)
