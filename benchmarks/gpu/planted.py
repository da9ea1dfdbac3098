"""A planted fp16 overflow for a run that is already fp16 (gpu_check.py's fp16 step, DeepSpeed's loss scaler).

``tests.planted.precision.RealFp16OnCpu`` plants the overflow (from ``overflow_step`` on, for
``overflow_steps`` steps, the gradient out of ``module`` is multiplied by ``factor``: beyond fp16's range
at any scale) and also swaps in Lightning's CPU fp16 plugin; on a GPU with ``trainer.precision=16-mixed``
the run is real fp16 already, so only the overflow is kept:
``+callbacks.planted._target_=gpu.planted.Fp16Overflow +callbacks.planted.module=model.layers.1.mlp``
(``benchmarks/`` on PYTHONPATH, as gpu_check.py sets it).
"""

from __future__ import annotations

from typing import Any

from tests.planted.precision import RealFp16OnCpu


class Fp16Overflow(RealFp16OnCpu):
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        pass  # the run's own fp16 (DeepSpeed's dynamic loss scaler) stays
