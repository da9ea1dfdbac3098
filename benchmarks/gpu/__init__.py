"""The GPU check's parts (docs/gpu.md); the command is ``benchmarks/gpu_check.py``.

``install`` (the kit on the GPU machine), ``runs`` (running train.py, reading run dirs), ``raw`` (the
hand-written DeepSpeed loop), ``planted`` (the fp16 overflow), ``report`` (results.md), ``kit`` (``make
gpu-kit``), ``image`` (a command run here with only the GPU image's packages). Imported as ``gpu.<part>`` with
``benchmarks/`` on ``sys.path``.
"""
