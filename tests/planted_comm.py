"""Planted bugs for comm_debug and log_sync (planted callbacks: ``+callbacks.plant._target_=tests.planted_comm.X``)."""

from __future__ import annotations

import time

from lightning.pytorch import Callback


class SleepOnRank(Callback):
    """Rank ``rank`` sleeps ``seconds`` at the start of step ``step`` (or of every step):
    a stuck rank (hang) or a slow one (straggler)."""

    def __init__(self, rank: int = 1, step: int = 2, seconds: float = 600.0, every_step: bool = False) -> None:
        self.rank, self.step, self.seconds, self.every_step = rank, step, seconds, every_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and (self.every_step or trainer.global_step == self.step):
            time.sleep(self.seconds)


class RaiseAtStep(Callback):
    """A job that crashes at step ``step``."""

    def __init__(self, step: int = 2) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"planted crash at step {self.step}")


# ---- the hang test's 2-process base (tests/callbacks/test_cb_comm_debug.py); the healthy and the
# straggler runs are the shared ones in tests/shared_runs.py ------------------------------

TWO_PROC = [
    "trainer=ddp_sim", "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "~callbacks.rich_progress_bar",
    "data.max_tokens=60000", "logger=csv", "export.hf=false", "export.fp32=false",
]


def read_findings(run_dir) -> list[dict]:
    import json

    path = run_dir / "findings.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def csv_column(run_dir, key: str) -> dict[int, float]:
    import csv

    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


def wandb_records(path) -> list:
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``): a 7-byte header,
    then LevelDB-style log blocks of 32 KiB whose records are (crc32, length, type) + data."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, buf, out, block = path.read_bytes(), 7, b"", [], 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        buf, pos = buf + data[pos:pos + length], pos + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


class SigkillAtStep(Callback):
    """Rank ``rank`` SIGKILLs itself at the start of step ``step`` (the OOM killer, a lost node).
    Writes the time of the kill to ``stamp`` first, so a test can measure how long the rest
    of the job takes to end."""

    def __init__(self, rank: int = 1, step: int = 2, stamp: str | None = None) -> None:
        self.rank, self.step, self.stamp = rank, step, stamp

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import os
            import signal

            if self.stamp:
                with open(self.stamp, "w") as f:
                    f.write(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
