"""Host reads per optimizer step: every read of a tensor's value on the host, counted on CPU.

On a GPU each ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()`` or ``.numpy()`` of a
CUDA tensor waits for the device to finish everything queued before it (a sync that stalls the pipeline); on
CPU they are free, so a CPU timing never shows them. Counted here instead: the calls are wrapped for the
run and attributed to the source file that made them (the first frame under ``src/``, else the library's).

Per step, from outside: a long run minus a short run of the same config (so the one-off reads at start
and end cancel), divided by the step difference. ``python benchmarks/host_reads.py`` prints the table of
docs/benchmarks.md (section 11) for ``debug=none`` and ``debug=light``; tests/bench/test_host_reads.py
holds light to at most one read per step over none.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
SRC = str(REPO / "src")


def _owner() -> str:
    """The file that asked for the value: the innermost frame in src/ (ours), else the innermost outside torch."""
    frames = traceback.extract_stack()[:-2]  # without this function and the counting wrapper
    for frame in reversed(frames):
        if frame.filename.startswith(SRC):
            return str(Path(frame.filename).relative_to(REPO))
    for frame in reversed(frames):
        if "/torch/" not in frame.filename:
            name = frame.filename
            return name.split("site-packages/")[-1] if "site-packages/" in name else Path(name).name
    return "?"


@contextlib.contextmanager
def counting() -> Iterator[collections.Counter]:
    """Count host reads of tensor values made inside the block, by the file that made them."""
    import torch

    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}
    inside = [False]

    def wrap(name: str, fn: Any) -> Any:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not inside[0]:
                # .cpu() of a tensor already on the host is no read; on CPU every tensor is, so count it as
                # it would be on a GPU for tensors the run keeps on its device (all of them here)
                inside[0] = True
                try:
                    counts[_owner()] += 1
                finally:
                    inside[0] = False
            return fn(self, *args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def count_run(overrides: list[str], steps: int, cache: Path) -> collections.Counter:
    """Host reads of one in-process run of ``steps`` optimizer steps."""
    from tests.helpers.runs import train_in_process

    with tempfile.TemporaryDirectory() as tmp, counting() as counts:
        train_in_process([*overrides, f"trainer.max_steps={steps}"], Path(tmp) / "run", cache)
    return counts


def per_step(overrides: list[str], short: int, long: int, cache: Path) -> tuple[float, dict[str, float]]:
    """(reads per step, per file) from a long run minus a short one."""
    a, b = count_run(overrides, short, cache), count_run(overrides, long, cache)
    files = {f: (b[f] - a[f]) / (long - short) for f in set(a) | set(b)}
    return sum(files.values()), {f: round(v, 2) for f, v in sorted(files.items(), key=lambda kv: -kv[1]) if v}


# the default config's run (1 process, ZeRO-2, the tiny DeepSeek-V3), smaller, without what only the end costs
BASE = ["experiment=smoke", "model.net.hidden_size=64", "model.net.num_hidden_layers=2", "data.seq_len=64",
        "data.batch_size=4", "trainer.val_check_interval=1000", "trainer.limit_val_batches=1",
        "export.hf=false", "export.fp32=false", "callbacks.model_checkpoint.every_n_train_steps=1000",
        "trainer.log_every_n_steps=10"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="none,light")
    parser.add_argument("--short", type=int, default=20)
    parser.add_argument("--long", type=int, default=60)
    parser.add_argument("--out", default="logs/bench/host_reads.json")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp())
    out = {}
    for preset in args.presets.split(","):
        total, files = per_step([*BASE, f"debug={preset}"], args.short, args.long, cache)
        out[preset] = {"per_step": round(total, 2), "files": files}
        print(f"{preset}: {total:.2f} host reads per step", json.dumps(files, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
