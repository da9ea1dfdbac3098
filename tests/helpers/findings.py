"""Read what a run's checks and loggers wrote: findings.jsonl, the CSV metrics, an offline W&B file."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def read_findings(run_dir: Path, check: str | None = None) -> list[dict]:
    """Every record of the run's findings.jsonl (all checks, all ranks), or ``check``'s only."""
    path = Path(run_dir) / "findings.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in records if check is None or r["check"] == check]


def of(findings: list[dict], check: str, severities=("warning", "error")) -> list[dict]:
    """``check``'s findings of these severities (default: the ones that say something is wrong)."""
    return [f for f in findings if f["check"] == check and f["severity"] in severities]


def one(records: list[dict], code: str) -> dict:
    """The single record with ``code`` (fails naming what was there otherwise)."""
    hits = [r for r in records if r["code"] == code]
    assert len(hits) == 1, f"expected one {code}, got {hits or [(r['code'], r['step']) for r in records]}"
    return hits[0]


def csv_column(run_dir: Path, key: str) -> dict[int, float]:
    """step -> value of ``key`` in the CSV logger's metrics.csv."""
    with open(Path(run_dir) / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``): a 7-byte header,
    then LevelDB-style log blocks of 32 KiB whose records are (crc32, length, type) + data."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, buf, out, block = Path(path).read_bytes(), 7, b"", [], 32768
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
