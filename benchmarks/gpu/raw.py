"""The hand-written ``deepspeed.initialize`` loop that gpu_check.py's throughput step times train.py against.

Run by torchrun (one process per GPU; gpu_check.py starts one): the same model (``build_deepseek_v3`` with
the kwargs given), the same data (``SyntheticCorpus`` through ``LMDataModule``, the framework's data=synthetic),
the same loss (CE + AUX_COEF x MoE balance loss, the model-side helpers: ``lm_loss.next_token_loss`` as
``model.cross_entropy`` runs it), the same optimizer and schedule (``raw_loop``'s constants: the framework's
defaults, torch's fused AdamW among them), ``--compile`` as ``model.compile=true`` (``compile_blocks``: the
same model code) and Lightning's ZeRO-2 dict, in bf16 (or fp32), on
CUDA with NCCL (or on CPU with gloo for ``gpu_check.py --dry-run``). Like train.py it reads the loss every
``--log-every`` steps (one sync) and stamps ``time.time()`` right after that read: the same points
``framework_vs_raw_report.parse_history`` reads from train.py's history.jsonl.

Writes ``--result`` (JSON): stamps, losses, CUDA peak bytes, parameter count.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import harness  # noqa: E402  (puts the repo on sys.path)
from raw_loop import (AUX_COEF, BETAS, CROSS_ENTROPY, EPS, FUSED, GRAD_CLIP, LR, MIN_LR_RATIO, SEED,  # noqa: E402
                      WARMUP_RATIO, WEIGHT_DECAY, ZERO2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="gpu/raw.py")
    p.add_argument("--model", required=True, help="build_deepseek_v3 kwargs (JSON)")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--num-tokens", type=int, required=True)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--total-steps", type=int, required=True)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="every fast path of the model (docs/gpu.md): torch.compile "
                   "each decoder block, sdpa_pad_v attention, the chunked loss, torch's fused AdamW")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)

    import deepspeed
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from dsdebug.data.corpus import SyntheticCorpus
    from dsdebug.data.datamodule import LMDataModule
    from dsdebug.models.compile_blocks import compile_blocks
    from dsdebug.models.deepseek import build_deepseek_v3
    from dsdebug.models.lm_loss import next_token_loss
    from dsdebug.models.moe_aux import RouterCapture
    from dsdebug.models.moe_loss import load_balancing_loss
    from dsdebug.models.optim import param_groups, warmup_cosine

    class LossModel(torch.nn.Module):
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net
            self.capture = RouterCapture(net).attach()

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.net(input_ids=input_ids).logits
            aux = load_balancing_loss(self.capture.collect(), self.capture.num_experts, self.capture.top_k)
            ce = next_token_loss(logits, labels, "chunked" if args.compile else CROSS_ENTROPY)
            return ce + AUX_COEF * aux, ce

    cuda = torch.cuda.is_available()
    if not cuda:  # as train.py on CPU: no JIT build of the shm comm op (inference only) before training
        from dsdebug.trainer.strategy import skip_shm_comm_op

        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    net = build_deepseek_v3(**{**json.loads(args.model),  # --compile: every fast path, as gpu_check's FAST run
                               **({"attn_implementation": "sdpa_pad_v"} if args.compile else {})})
    params = sum(p.numel() for p in net.parameters())
    model = LossModel(net)
    compile_blocks(net, args.compile)
    data = LMDataModule(SyntheticCorpus(num_tokens=args.num_tokens, seed=SEED), vocab_size=args.vocab_size,
                        seq_len=args.seq_len, batch_size=args.batch_size, seed=SEED, cache_dir=args.cache_dir)
    data.setup("fit")
    sampler = DistributedSampler(data.train_dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(data.train_dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.AdamW(param_groups(net.named_parameters()), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY, fused=True if args.compile else FUSED)
    scheduler = warmup_cosine(optimizer, total_steps=args.total_steps, warmup_ratio=WARMUP_RATIO,
                              min_lr_ratio=MIN_LR_RATIO)
    config = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": GRAD_CLIP, "zero_allow_untested_optimizer": True, "zero_optimization": ZERO2,
              "bf16": {"enabled": args.precision == "bf16"}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    stamps: dict[int, float] = {}
    losses: dict[int, float] = {}
    step, epoch = 0, 0
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            total, ce = engine(input_ids, labels)
            engine.backward(total)
            engine.step()
            step += 1
            if step % args.log_every == 0:
                losses[step] = ce.item()  # the sync train.py's logging does too
                stamps[step] = time.time()
            if step == args.total_steps:
                break
        epoch += 1
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    if rank == 0:
        harness.write_json(Path(args.result), {"stamps": stamps, "losses": losses, "world_size": world,
                                               "params": params, "cuda_peak_bytes": peak,
                                               "precision": args.precision, "compile": args.compile})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
