"""`Reproducibility`: fix every source of randomness, record it, and prove the step replays.

The config example and the table of metrics and findings: the class docstring (`Reproducibility`).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch

from dsdebug.distributed import collectives
from dsdebug.config.args import Rule, boolean, integer, one_of, optional
from dsdebug.callbacks.base import DebugCallback
from dsdebug.errors import ConfigError
from dsdebug.callbacks.reproducibility.replay import (
    _only, _tensors, first_difference, ranks_differing, rng_state, seed_record, set_rng_state)

__all__ = ["Reproducibility"]

log = logging.getLogger(__name__)
CUBLAS_CONFIGS = (":4096:8", ":16:8")
_NONDET_MARK = "does not have a deterministic implementation"
_ADVICE = ("look in that module's forward for randomness outside torch's global RNG (a fresh torch.Generator or "
           "numpy/random seeded from time/os.urandom), CUDA atomics (index_add_/scatter_add_), or torch.empty read "
           "before being written; warn_only=false makes PyTorch raise at ops without a deterministic kernel")


class Reproducibility(DebugCallback):
    """`Reproducibility`: fix every source of randomness, record it, and prove the step replays.

    Catches: runs that cannot be reproduced although "the seed is set" -- an op or module that is
    nondeterministic in a way seeding cannot fix (noise from a fresh ``torch.Generator`` seeded
    from the clock, atomics in CUDA kernels, uninitialised memory), PyTorch ops without a
    deterministic implementation, and a Python hash seed that was fixed too late to matter.

    What it does (every rank builds this callback: child ranks re-run ``train.py``):

    - ``__init__`` (before the Trainer and before child ranks start, so children inherit it):
      sets ``PYTHONHASHSEED`` and ``CUBLAS_WORKSPACE_CONFIG`` (before the first cuBLAS call),
      seeds python/numpy/torch with ``seed_everything(seed, workers=True)`` only if the entry
      point has not (it normally has, with ``cfg.seed``: that is recorded, not redone).
      ``PYTHONHASHSEED`` only affects interpreters started after it is set: the child ranks and
      spawned workers get it; the training command sets it for rank 0 too, before Python starts
      (``distributed/hash_seed.py``). A process that started with another value (a plain Lightning
      project, or an exported one) is reported as ``hash_seed_late`` where that can change a result:
      several ranks, or data-loader workers started by spawn/forkserver.
    - ``setup`` (every rank), with ``deterministic: true`` (the default; ``debug=repro`` and
      ``debug=full``): ``cudnn.deterministic=True``, ``cudnn.benchmark=False``,
      ``torch.use_deterministic_algorithms(True, warn_only=...)`` -- again here, because building the
      Trainer may reset them. When ``Trainer(deterministic=False)`` (``trainer.deterministic=false``)
      turned them off, that is the user's setting: kept, with a ``deterministic_off`` warning naming
      the key; ``force_deterministic: true`` turns them back on (warning ``deterministic_forced``).
      With ``deterministic: false`` (``debug=light``, the always-on preset) no torch or cuDNN flag is
      touched: seeds and env vars only. Deterministic kernels cost step time (docs/debugging.md
      "Reproducibility notes"; on an H100 light/none was 1.305 while light still had them on, 2026-11-28).
    - ``fill_uninitialized_memory`` (PyTorch fills every new ``torch.empty`` buffer with NaN in
      deterministic mode): ``null`` (auto) fills only in strict mode -- ``warn_only: false``, or a strict
      mode already on (``trainer.deterministic=true``) -- where the user asked for bitwise replay; with
      ``warn_only: true`` the run is not bitwise deterministic anyway (an op without a deterministic kernel
      only warns), so paying for the fill (a sizeable share of a step on GPU and CPU: docs/benchmarks.md,
      "Costs the code refers to") buys nothing. ``true``/``false`` are applied as given; ``true`` with ``deterministic:
      false`` is refused (it would do nothing).
    - ``on_train_start`` (every rank): writes ``repro/rank<r>.json`` (seeds, env, flags, versions,
      a digest of each RNG state) and ``repro/rng_state_rank<r>.pt`` (python, numpy, torch CPU
      and CUDA RNG states, loadable with ``torch.load(..., weights_only=False)``).
    - Replay self-check, the first ``replay_steps`` training batches, EVERY rank (a ZeRO-3 or DDP
      forward is collective, so every rank replays the same batches): snapshot the RNG states
      and module buffers, run the training step's forward once more through the strategy (same
      precision context, same wrapper) with forward hooks fingerprinting every module output,
      restore RNG and buffers, then let the real forward run under the same hooks. The first
      module (in completion order, so the innermost culprit) whose output differs is reported.
      The extra forward builds no optimizer state and runs no backward; the real step sees the
      same RNG state, weights and buffers as without the callback (a test compares loss curves).
    - PyTorch's own "does not have a deterministic implementation" warnings (``warn_only=true``)
      become findings naming the op and the code line that called it.

    Example::

        python train.py +callbacks=reproducibility callbacks.reproducibility.replay_steps=3 \\
            callbacks.reproducibility.warn_only=false

    | finding code | severity | meaning |
    |---|---|---|
    | ``seeded`` | info | what was seeded and set (seed, env vars, flags), on all ranks |
    | ``hash_seed_late`` | info | this process started with another hash seed than its ranks/spawned workers got |
    | ``deterministic_off`` | warning | ``trainer.deterministic=false`` kept: no bitwise replay between runs |
    | ``deterministic_forced`` | warning | ``force_deterministic: true`` overrode ``trainer.deterministic=false`` |
    | ``seed_mismatch`` | warning | the run was seeded with another seed than ``callbacks.reproducibility.seed`` |
    | ``nondeterministic_op`` | warning | replay diverged at a module, or PyTorch flagged an op |
    | ``replay_ok`` | info | the replayed steps matched bit for bit (number of module outputs compared) |

    Metrics: none. Resume: nothing is carried over (``state_attrs`` is empty): a resumed process sets
    its flags and replays its own first ``replay_steps`` steps.
    """
    name = "reproducibility"
    state_attrs = ()  # flags, records and the replay check belong to this process
    runtime_attrs = ("_trainer", "_orig_showwarning")  # set again in setup

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "seed": optional(integer(0, 2 ** 32 - 1), "the run's seed"),
        "hash_seed": integer(0, 2 ** 32 - 1),
        "replay_steps": integer(0, 2 ** 32 - 1),
        "sample_size": integer(1, 2 ** 32 - 1),
        "deterministic": boolean(),
        "force_deterministic": boolean(),
        "warn_only": boolean(),
        "fill_uninitialized_memory": optional(boolean(), "auto"),
        "cublas_workspace_config": one_of(*CUBLAS_CONFIGS),
    }

    def __init__(self, seed: int | None = None, hash_seed: int = 0, deterministic: bool = True, warn_only: bool = True,
                 cublas_workspace_config: str = ":4096:8", fill_uninitialized_memory: bool | None = None,
                 replay_steps: int = 2, sample_size: int = 4096, force_deterministic: bool = False,
                 on_error: str = "warn") -> None:
        super().__init__(on_error)
        self.check_declared(seed=seed, hash_seed=hash_seed, replay_steps=replay_steps, sample_size=sample_size,
                            deterministic=deterministic, force_deterministic=force_deterministic, warn_only=warn_only,
                            fill_uninitialized_memory=fill_uninitialized_memory,
                            cublas_workspace_config=cublas_workspace_config)
        if fill_uninitialized_memory and not deterministic:
            raise ConfigError("callbacks.reproducibility.fill_uninitialized_memory=true does nothing with "
                              "callbacks.reproducibility.deterministic=false (PyTorch fills only in deterministic "
                              "mode; debug=light leaves it off); valid: fill_uninitialized_memory=null or false, or "
                              "deterministic=true (debug=repro or debug=full)")
        self.seed, self.hash_seed, self.deterministic, self.warn_only = seed, hash_seed, deterministic, warn_only
        self.force_deterministic = force_deterministic
        self._user_turned_off = False  # Trainer(deterministic=False) after __init__: the user's setting, kept
        self.replay_steps, self.sample_size = replay_steps, sample_size
        # None = auto (_apply_flags): fill only in strict mode. Filling costs on every device (CPU: DeepSpeed's
        # torch.empty reduce buckets every step, aten::fill_ 40% of profiled CPU time under ZeRO-2; CUDA: ~15%
        # per Megatron) and makes only a strict run more reproducible; reads of uninitialised memory still show
        # up in the replay check.
        self.fill_setting = fill_uninitialized_memory
        self.fill: bool | None = None  # what _apply_flags set last
        self._flags_set = False  # teardown puts back only what this check changed
        # Runs in every process that builds the callback (each rank), before the Trainer.
        # What was there before is put back at teardown (in-process fits, notebooks, tests).
        self._saved_env = {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")}
        self._saved_flags = (torch.are_deterministic_algorithms_enabled(),
                             torch.is_deterministic_algorithms_warn_only_enabled(),
                             torch.utils.deterministic.fill_uninitialized_memory,
                             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
        self._hash_seed_at_start = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = str(hash_seed)  # for processes started from here on
        self._cuda_was_initialised = torch.cuda.is_available() and torch.cuda.is_initialized()
        # Set also with deterministic=false (debug=light): it must be in the environment before the first cuBLAS
        # handle exists (so trainer.deterministic=true still works in a light run: strict mode refuses cuBLAS
        # without it), child ranks inherit it, and ':4096:8' (32 MiB) is PyTorch's own default workspace on
        # sm90 (H100/H200) -- more than its ~8 MiB default on older GPUs, never less: no step-time cost.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas_workspace_config
        self._seeded_here = "PL_GLOBAL_SEED" not in os.environ
        if self._seeded_here:  # entry.py normally did this already: don't reseed (would fight it)
            import lightning as L

            L.seed_everything(seed, workers=True, verbose=False)
        self._apply_flags()
        self._set_up = False
        self._replayed = 0
        self._pending: tuple | None = None
        self._record: list[tuple[str, Any]] | None = None
        self._names: dict[int, str] = {}
        self._compared = 0
        self._diverged = self._some_rank_diverged = False
        self._seen_ops: set[str] = set()
        self._trainer = None
        self._orig_showwarning = None

    def _apply_flags(self) -> bool:
        was_on = torch.are_deterministic_algorithms_enabled()
        if not self.deterministic:  # debug=light: seeds and env vars only, torch's flags stay as they are
            return was_on
        self._flags_set = True
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # a strict mode already on (trainer.deterministic=true: raise on a nondeterministic op) stays strict
        strict = was_on and not torch.is_deterministic_algorithms_warn_only_enabled()
        warn_only = self.warn_only and not strict
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        self.fill = (not warn_only) if self.fill_setting is None else self.fill_setting
        torch.utils.deterministic.fill_uninitialized_memory = self.fill
        return was_on

    # ---- setup: every rank, no collectives ------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # __init__ turned deterministic algorithms on; off now means the Trainer was built with
        # deterministic=False (trainer.deterministic=false): the user's setting, kept unless they opt in
        turned_off = self.deterministic and not self._set_up and not torch.are_deterministic_algorithms_enabled()
        self._user_turned_off = self._user_turned_off or (turned_off and not self.force_deterministic)
        if not self._user_turned_off:
            self._apply_flags()
        if self._set_up:
            return
        self._set_up = True
        if turned_off and getattr(trainer, "is_global_zero", True):  # once, not per rank
            self._report_turned_off(trainer)
        # seed=None (a plain Lightning project): the seed the run was seeded with, nothing to compare
        run_seed = int(os.environ.get("PL_GLOBAL_SEED", -1 if self.seed is None else self.seed))
        if self.seed is None:
            self.seed = None if run_seed < 0 else run_seed
        elif run_seed != self.seed:
            self.report(trainer, "warning", "seed_mismatch",
                        f"the run was seeded with {run_seed} but callbacks.reproducibility.seed={self.seed}",
                        advice="leave callbacks.reproducibility.seed at ${seed} (the default)",
                        details={"run_seed": run_seed, "callback_seed": self.seed})
        if self._cuda_was_initialised:
            log.warning("reproducibility: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set; cuBLAS may "
                        "ignore it (set it in the environment)")

    def _report_turned_off(self, trainer: Any) -> None:
        key = "trainer.deterministic=false (Trainer(deterministic=False))"
        if self.force_deterministic:
            self.report(trainer, "warning", "deterministic_forced",
                        f"{key} turned torch.use_deterministic_algorithms off; callbacks.reproducibility."
                        "force_deterministic=true turned it back on for this run",
                        advice="keep one of the two: set trainer.deterministic=true (or leave it unset), or drop "
                               "force_deterministic",
                        details={"trainer_deterministic": False, "force_deterministic": True}, rank=None, step=None)
            return
        self.report(trainer, "warning", "deterministic_off",
                    f"{key}: deterministic algorithms stay off as set, so two runs of this config may differ in the "
                    "last bits (and a nondeterministic kernel is not flagged); seeds and the replay check still run",
                    advice="for bitwise replay set trainer.deterministic=true or leave it unset (this check then turns "
                           "them on), or callbacks.reproducibility.force_deterministic=true to let the check override "
                           "it; callbacks.reproducibility.deterministic=false says you want them off",
                    details={"trainer_deterministic": False, "force_deterministic": False}, rank=None, step=None)

    def _report_hash_seed(self, trainer: Any) -> None:
        """PYTHONHASHSEED reached the processes started after __init__ (child ranks, spawned workers) but
        not this one: said only where the two can meet (several ranks, or workers started by spawn or
        forkserver: forked workers share this process's seed) -- str-keyed set/dict iteration order
        then differs between processes of one run."""
        if self._hash_seed_at_start == str(self.hash_seed):
            return
        meets = [f"{trainer.world_size} ranks"] if getattr(trainer, "world_size", 1) > 1 else []
        meets += [f"{n} data-loader worker(s) started by {how}" for n, how in _spawned_workers(trainer)]
        if not meets:
            return
        self.report(trainer, "info", "hash_seed_late",
                    f"rank {trainer.global_rank} started with PYTHONHASHSEED={self._hash_seed_at_start!r}, while its "
                    f"{' and '.join(meets)} got PYTHONHASHSEED={self.hash_seed}: str hashes (the iteration order of "
                    "str-keyed sets and dicts) differ between them",
                    advice=f"start the command with PYTHONHASHSEED={self.hash_seed} in its environment "
                           f"(`PYTHONHASHSEED={self.hash_seed} python train.py ...`); dsdebug-train and the project's "
                           "train.py set it themselves when it is unset",
                    details={"at_start": self._hash_seed_at_start, "set": str(self.hash_seed), "meets": meets},
                    step=None)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """After fit, every rank: put the process-wide flags and env vars back (child ranks
        and workers were started long ago with ours)."""
        self.release(trainer)

    def release(self, trainer: Any) -> None:
        """torch's flags, the warning hook and the environment variables as they were before the check
        (base.py); the replay's pending records dropped."""
        self._restore_warnings()
        self._drop_pending()
        if self._flags_set:  # deterministic=false never touched them: what the Trainer or the user set stays
            det, warn_only, fill, cudnn_det, bench = self._saved_flags
            torch.use_deterministic_algorithms(det, warn_only=warn_only)
            torch.utils.deterministic.fill_uninitialized_memory = fill
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, bench
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    # ---- on_train_start: every rank writes its own record ---------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        rank = trainer.global_rank
        self._report_hash_seed(trainer)  # here: the train data loaders exist
        out = Path(trainer.default_root_dir) / "repro"
        out.mkdir(parents=True, exist_ok=True)
        state = rng_state()
        torch.save(state, out / f"rng_state_rank{rank}.pt")
        record = seed_record(trainer, self.seed, self._seeded_here, self._hash_seed_at_start, state)
        (out / f"rank{rank}.json").write_text(json.dumps(record, indent=2, default=str))
        if rank == 0:
            self.report(trainer, "info", "seeded",
                        f"seed {record['PL_GLOBAL_SEED']} (workers seeded: {record['PL_SEED_WORKERS'] == '1'}), "
                        f"PYTHONHASHSEED={self.hash_seed}, "
                        f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}, {_flags_line(self)}; "
                        f"replaying {self.replay_steps} step(s); states in {out}",
                        details=record, rank=None)
        self._trainer = trainer
        if self.deterministic and self.warn_only:
            self._orig_showwarning = warnings.showwarning
            warnings.showwarning = self._showwarning
        if self.replay_steps:
            self._names = {id(m): name or "<root>" for name, m in pl_module.named_modules()}

    def _showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if _NONDET_MARK in text and self._trainer is not None:
            op = text.split(_NONDET_MARK)[0].strip()
            if op not in self._seen_ops:
                self._seen_ops.add(op)
                self.report(self._trainer, "warning", "nondeterministic_op",
                            f"op `{op}` has no deterministic implementation (called from {filename}:{lineno}); "
                            "results can differ between identical runs",
                            advice="replace the op (e.g. a deterministic gather/sum instead of "
                                   "index_add_/scatter_add_), or accept it; warn_only=false raises with the full stack",
                            details={"op": op, "file": filename, "line": lineno})
            return
        self._orig_showwarning(message, category, filename, lineno, file, line)

    def _restore_warnings(self) -> None:
        if self._orig_showwarning is not None:
            warnings.showwarning, self._orig_showwarning = self._orig_showwarning, None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._restore_warnings()
        self._drop_pending()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._restore_warnings()
        self._drop_pending()

    # ---- replay: the first replay_steps batches, EVERY rank -------------------------
    def _hook(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self._record is None:
            return
        prints = []
        for t in _tensors(out):
            flat = t.detach().reshape(-1)
            if flat.is_complex():
                flat = torch.view_as_real(flat).reshape(-1)
            stride = max(1, flat.numel() // self.sample_size)
            prints.append((tuple(t.shape), flat.sum(dtype=torch.float64),
                           flat[::stride][: self.sample_size].to(torch.float64, copy=True)))
        self._record.append((self._names.get(id(module), type(module).__name__), prints, type(module).__name__))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._replayed >= self.replay_steps:
            return
        if not pl_module.automatic_optimization:  # training_step would step the optimizer itself
            self._replayed = self.replay_steps
            log.info("reproducibility: replay skipped (manual optimization)")
            return
        self._replayed += 1
        handles = [m.register_forward_hook(self._hook) for m in pl_module.modules()]
        self._pending = ([], handles, trainer.global_step)
        saved_rng = rng_state()
        buffers = [b.detach().clone() for b in pl_module.buffers()]
        self._record = self._pending[0]
        for k in ("log", "log_dict"):  # the replayed training_step must not log
            setattr(pl_module, k, lambda *a, **kw: None)
        try:
            # same precision context and wrapper (DDP / DeepSpeed engine) as the real step; under
            # DDP in no_sync, so this forward does not arm the reducer for the real backward
            model = trainer.strategy.model
            with collectives.collective_region(), \
                    model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) else nullcontext():
                trainer.strategy.training_step(batch, batch_idx)
        except BaseException:
            self._drop_pending()
            raise
        finally:
            for k in ("log", "log_dict"):
                delattr(pl_module, k)
            set_rng_state(saved_rng)
            with torch.no_grad():
                for b, saved in zip(pl_module.buffers(), buffers):
                    b.copy_(saved)
        self._record = []  # the real forward records into this one

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._pending is None:
            return
        replay, _, step = self._pending
        real = self._record
        self._drop_pending()
        self._compare(trainer, replay, real, step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._drop_pending()  # a step without backward (training_step returned None): nothing compared

    def _drop_pending(self) -> None:
        if self._pending is not None:
            for h in self._pending[1]:
                h.remove()
        self._pending, self._record = None, None

    def _compare(self, trainer: Any, replay: list, real: list, step: int) -> None:
        self._compared += 1
        found = first_difference(replay, real)
        ranks = ranks_differing(trainer, found is not None)  # COLLECTIVE: every rank replays the same steps
        self._some_rank_diverged = self._some_rank_diverged or bool(ranks)
        if found is not None and not self._diverged:  # the first divergence names the culprit; once per rank
            self._diverged = True
            self._diverge(trainer, step, *found, total=len(real), ranks=ranks)
        elif self._compared == self.replay_steps and not self._some_rank_diverged and trainer.global_rank == 0:
            self.report(trainer, "info", "replay_ok",
                        f"replayed the first {self.replay_steps} step(s) on every rank; on rank 0 all {len(real)} "
                        "module outputs per step matched bit for bit (a rank that diverged reports it)", rank=None)

    def _diverge(self, trainer: Any, step: int, rec: tuple, index: int, diff: float | None, how: str,
                 total: int, ranks: list[int] | None = None) -> None:
        path, cls = rec[0], rec[2]
        diff_text = f"max abs diff {diff:.3g} over <= {self.sample_size} sampled elements, " if diff is not None else ""
        self.report(trainer, "warning", "nondeterministic_op",
                    f"module `{path}` ({cls}) gives a different output when step {step} is replayed with the same "
                    f"RNG state, weights and batch ({diff_text}{how}); it is module call {index + 1} of {total}, "
                    "the first to differ: seeding cannot make this run reproducible" + _only(trainer, ranks),
                    advice=_ADVICE, step=step,
                    details={"module": path, "class": cls, "call_index": index, "calls": total,
                             "max_abs_diff_sampled": diff, "how": how, "ranks_differing": ranks})


def _flags_line(check: Reproducibility) -> str:
    """The deterministic flags as they are now (after setup), for the ``seeded`` finding."""
    on = torch.are_deterministic_algorithms_enabled()
    mode = ("off" if not on else "on, warn only" if torch.is_deterministic_algorithms_warn_only_enabled()
            else "on, strict")
    fill = "fills new memory with NaN" if torch.utils.deterministic.fill_uninitialized_memory else "no memory fill"
    cudnn = (f"cudnn deterministic {'on' if torch.backends.cudnn.deterministic else 'off'}, "
             f"benchmark {'on' if torch.backends.cudnn.benchmark else 'off'}")
    if not check.deterministic:
        return (f"deterministic algorithms {mode} ({cudnn}): callbacks.reproducibility.deterministic=false "
                "(debug=light) leaves torch's flags as they are; debug=repro or debug=full turns them on")
    return f"deterministic algorithms {mode}" + (f" ({fill})" if on else "") + f", {cudnn}"


def _spawned_workers(trainer: Any) -> list[tuple[int, str]]:
    """(num_workers, start method) of the train data loaders whose workers are new interpreters."""
    import multiprocessing

    from torch.utils.data import DataLoader

    def loaders(obj: Any) -> list[DataLoader]:
        if isinstance(obj, DataLoader):
            return [obj]
        if isinstance(obj, dict):
            obj = list(obj.values())
        if isinstance(obj, (list, tuple)):
            return [loader for o in obj for loader in loaders(o)]
        inner = getattr(obj, "iterables", None)
        return loaders(inner) if inner is not None else []

    out = []
    for loader in loaders(getattr(trainer, "train_dataloader", None)):
        ctx = loader.multiprocessing_context
        method = (ctx if isinstance(ctx, str) else ctx.get_start_method() if ctx is not None
                  else multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_context().get_start_method())
        if loader.num_workers > 0 and method != "fork":
            out.append((loader.num_workers, method))
    return out
