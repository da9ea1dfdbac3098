# make train: set up .venv and train the default model (tiny DeepSeek-V3, KJV text, CPU) with debug=light.
# make test:  set up .venv and run the fast tier (pytest -m "not slow"; <= 15 min on 2 cores).
# make test-all: what CI runs (.ci/run): the fast tier + the slow tests of tests/tiers.py. Tiers: docs/testing.md.
# On a CPU-only machine constraints.txt's torch==2.13.0 is the CPU build (from the local wheel cache or
# TORCH_INDEX, e.g. https://download.pytorch.org/whl/cpu). GPU users: see README.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_INDEX ?=
STAMP := $(VENV)/.installed
# every extra (pyproject.toml): the training stack, its loggers/sweepers/launchers, the tests
EXTRAS ?= train,wandb,sweep,slurm,hf,lora,test
# the CPU wheel when no torch is installed yet; a torch already there (a CUDA build) is kept
TORCH_PIN := $(shell grep '^torch==' constraints.txt)

.PHONY: setup train test test-all test-extended test-fast bench bench-full bench-comm gpu-kit clean-logs

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	grep -v '^torch==' constraints.txt > $(VENV)/constraints-but-torch.txt
	$(PY) -m pip install -q -c $(VENV)/constraints-but-torch.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

# debug=light is the config's default (cheap always-on checks, <= 2% of a run): the first report has
# gradient norms, rank stats and findings; ARGS come after and win (make train ARGS="debug=none" for a bare run).
train: setup
	$(PY) train.py $(ARGS)

# The tiers (docs/testing.md): `slow` marks what only test-all runs (pyproject.toml [tool.pytest] markers).
# PYTEST_ARGS picks tests: make test PYTEST_ARGS="tests/config -k bad_input"
test: setup
	$(PY) -m pytest -q -m "not slow" --durations=25 $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -q -m "not extended" --durations=25 $(PYTEST_ARGS)

# every slow test CI does not run (tests/tiers.py; docs/testing.md): before a release
test-extended: setup
	$(PY) -m pytest -q -m extended --durations=25 $(PYTEST_ARGS)

test-fast: test  # the old name of `make test`

# make bench: the CPU benchmark set (docs/benchmarks.md), < 15 min on 2 cores; not part of make test.
# Results and plots under logs/bench/. make bench-full adds every debug callback alone.
# bench-full: all four cells (zero2/zero3 x 1/2 ranks) x every variant (~25 min).
# zero_memory at 2 ranks only (1 rank: every stage holds all 16 bytes/param; the full table:
# python benchmarks/zero_memory.py); framework_vs_raw at 2 ranks, the raw loop with train.py's
# malloc_tuning (like for like; docs/benchmarks.md 2b), 2 interleaved rounds.
BENCH_ZERO ?= --ranks 2
BENCH_FVR ?= --ranks 2 --rounds 2 --steps 30 --raw-malloc tuned
BENCH_OVERHEAD ?= --cells zero2:1,zero3:2 --variants none,light,full --rounds 2
bench: setup
	$(PY) benchmarks/zero_memory.py $(BENCH_ZERO)
	$(PY) benchmarks/framework_vs_raw.py $(BENCH_FVR)
	$(PY) benchmarks/overhead.py $(BENCH_OVERHEAD)
	$(PY) benchmarks/scaling.py

bench-full: setup
	$(PY) benchmarks/overhead.py --rounds 2 --out logs/bench/overhead_full

# bench-comm: every communication option on 2 CPU ranks (bytes and time per step in collectives,
# step time) + 300 steps of ddp vs ddp_powersgd (final loss within 5 %); too long for make bench.
bench-comm: setup
	$(PY) benchmarks/comm.py --loss-check

# make gpu-kit: the wheels the lent GPU machine's image lacks (deepspeed, hydra-core, ...) into .gpu_kit/
# (git-ignored), checked with the working tree under 60 MiB; then benchmarks/gpu_check.py there (docs/gpu.md).
gpu-kit: setup
	$(PY) benchmarks/gpu/kit.py --out .gpu_kit

clean-logs:
	rm -rf logs multirun outputs
