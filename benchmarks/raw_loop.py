"""The hand-written DeepSpeed loop that ``framework_vs_raw.py`` compares train.py with.

Run by torchrun (``framework_vs_raw.py --raw ...`` calls ``raw_main`` on every rank):
``deepspeed.initialize`` and a for-loop (``engine(batch)`` / ``engine.backward`` / ``engine.step``).
The loss is CE on shifted labels + AUX_COEF x the MoE load-balancing loss, computed with the
model-side helpers (``dsdebug.models.moe_aux``), the same formula as ``CausalLMModule._losses``.
It prints the loss every 10 steps, stamps ``time.time()`` after every optimizer step from
``--warmup`` on, and each rank's CPU time (``cpu_clock.stamp``) after steps ``warmup`` and
``total_steps``: the same window and the same clock as ``cpu_clock.CpuClock`` in train.py.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import cpu_clock
import harness

REPO = harness.REPO

# The framework's defaults, written out as a hand-written loop would (tests check they still
# match conf/: data/kjv.yaml, model/deepseek_v3_tiny.yaml, optim/adamw.yaml, train.yaml seed).
SEED = 42
BATCH_SIZE, SEQ_LEN, VOCAB = 8, 128, 4096
LR, BETAS, EPS, WEIGHT_DECAY, FUSED = 3e-3, (0.9, 0.95), 1e-8, 0.1, False  # optim.optimizer.fused
CROSS_ENTROPY = "full"  # model.cross_entropy: the loss through dsdebug.models.lm_loss, as the module's
WARMUP_RATIO, MIN_LR_RATIO, GRAD_CLIP, AUX_COEF = 0.1, 0.1, 1.0, 0.01
MODEL = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
             max_position_embeddings=SEQ_LEN, attn_implementation="sdpa")
# Dumped from a framework run (trainer.strategy.config after setup, strategy=zero2): Lightning's
# DeepSpeedStrategy(stage=2) defaults. Lightning also passes `activation_checkpointing` (all
# false) and `aio` (NVMe offload settings): neither does anything here, so they are left out.
ZERO2 = {
    "stage": 2,
    "contiguous_gradients": True,
    "overlap_comm": True,
    "allgather_partitions": True,
    "reduce_scatter": True,
    "allgather_bucket_size": 200_000_000,
    "reduce_bucket_size": 200_000_000,
    "sub_group_size": 1_000_000_000_000,
}
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH_SIZE,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": GRAD_CLIP,
    "zero_allow_untested_optimizer": True,  # a torch AdamW under ZeRO, as Lightning allows
    "zero_optimization": ZERO2,
}


def raw_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import random

    import deepspeed
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from dsdebug.data.corpus import KJVCorpus
    from dsdebug.data.datamodule import LMDataModule
    from dsdebug.models.deepseek import build_deepseek_v3
    from dsdebug.models.lm_loss import next_token_loss
    from dsdebug.models.moe_aux import RouterCapture
    from dsdebug.models.moe_loss import load_balancing_loss
    from dsdebug.models.optim import param_groups, warmup_cosine

    class LossModel(torch.nn.Module):
        """CE on shifted labels + AUX_COEF x MoE balance loss (the model-side helpers)."""

        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net
            self.capture = RouterCapture(net).attach()

        def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.net(input_ids=batch["input_ids"]).logits
            aux = load_balancing_loss(self.capture.collect(), self.capture.num_experts, self.capture.top_k)
            ce = next_token_loss(logits, batch["labels"], CROSS_ENTROPY)
            return ce + AUX_COEF * aux, ce

    if getattr(args, "raw_malloc", "default") == "tuned":  # train.py's malloc_tuning, for a like-for-like run
        from dsdebug.trainer.allocator import tune_malloc

        tune_malloc(True)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(SEED)  # what L.seed_everything(42) does before train.py builds the net
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    net = build_deepseek_v3(**{**MODEL, "hidden_size": args.hidden_size, "num_hidden_layers": args.layers})
    model = LossModel(net)
    cache = Path(os.environ.get("DSDEBUG_CACHE_DIR", REPO / ".cache")) / "data"
    data = LMDataModule(KJVCorpus(granularity="chapter"), vocab_size=VOCAB, seq_len=SEQ_LEN,
                        batch_size=BATCH_SIZE, seed=SEED, cache_dir=str(cache))
    data.setup("fit")  # only for its tokenized, packed train blocks
    sampler = DistributedSampler(data.train_dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(data.train_dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)
    optimizer = torch.optim.AdamW(param_groups(net.named_parameters()), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY, fused=FUSED)
    scheduler = warmup_cosine(optimizer, total_steps=args.total_steps, warmup_ratio=WARMUP_RATIO,
                              min_lr_ratio=MIN_LR_RATIO)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=DS_CONFIG)
    stamps: dict[int, float] = {}
    cpu_stamps: dict[int, dict] = {}
    profiler = None
    if os.environ.get("BENCH_PROFILE") == "1":
        import cProfile

        profiler = cProfile.Profile()
    losses: dict[int, float] = {}
    step, epoch = 0, 0
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            total, ce = engine(batch)
            engine.backward(total)
            engine.step()  # clip, update, LR schedule
            step += 1
            if step % args.log_every == 0:
                losses[step] = ce.item()
                if rank == 0:
                    print(f"step {step} loss {losses[step]:.4f}", flush=True)
            if step >= args.warmup:
                stamps[step] = time.time()
            if step in (args.warmup, args.total_steps):
                cpu_stamps[step] = cpu_clock.stamp()
                if profiler is not None:  # BENCH_PROFILE=1: cProfile over the window, as CpuClock(profile=true)
                    profiler.enable() if step == args.warmup else profiler.disable()
            if step == args.total_steps:
                break
        epoch += 1
    cpu = (cpu_clock.window(cpu_stamps, args.warmup, args.total_steps, rank, torch.get_num_threads())
           if args.warmup in cpu_stamps and args.total_steps in cpu_stamps and args.warmup < args.total_steps else None)
    if profiler is not None:
        profiler.dump_stats(f"{args.result}.rank{rank}.prof")
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, cpu)  # every rank
    if rank == 0:
        harness.write_json(Path(args.result), {"stamps": stamps, "losses": losses, "world_size": world,
                                               "threads": torch.get_num_threads(), "cpu": every_rank})
    dist.barrier()
    dist.destroy_process_group()
