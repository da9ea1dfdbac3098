"""The first run on a new machine does not wait for DeepSpeed's shared-memory comm op: on CPU the
strategy marks it incompatible before DeepSpeed's process group starts (strategy.py skip_shm_comm_op),
so DeepSpeed neither JIT-builds (~25-55 s on 2 cores, first use) nor loads it. Measured: benchmarks/first_run.py."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.runs import REPO

CODE = """
import os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
import importlib
ds_comm = importlib.import_module("deepspeed.comm.torch")  # (deepspeed.comm.torch as a name is torch itself)
import deepspeed.ops
from dsdebug.trainer.strategy import skip_shm_comm_op
before = deepspeed.ops.__compatible_ops__.get("deepspeed_shm_comm")
skip_shm_comm_op()
op = ds_comm.build_shm_op()  # what DeepSpeed's TorchBackend calls while its process group starts
print(before, op, sorted(os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])))
"""


def test_deepspeed_shm_comm_op_is_neither_built_nor_loaded(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # DeepSpeed would build it here (compatible on Linux); after the skip: no op, nothing built
    assert proc.stdout.split()[-3:] == ["True", "None", "[]"], proc.stdout


def test_the_cpu_strategy_skips_it_before_deepspeed_starts_its_process_group():
    import inspect

    from dsdebug.trainer.strategy import DebugDeepSpeedStrategy

    source = inspect.getsource(DebugDeepSpeedStrategy.setup_distributed)
    assert source.index("skip_shm_comm_op()") < source.index("self._init_deepspeed_distributed()")
