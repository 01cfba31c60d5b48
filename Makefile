# Two commands on a fresh clone: `make test` and `make train`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 2
TRAIN_SCRIPT ?= $(if $(wildcard examples/train_gpt.py),examples/train_gpt.py,examples/mesh_demo.py)

.PHONY: test test-all test-torch gpu-check property train train-2d lint bench soak clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(PY) -m pip install --quiet -c constraints.txt --no-deps torchtitan lightning-fabric  # test-only; why: constraints.txt
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -x -q tests

# Everything, nightly-style (about 15 minutes on 2 cores): the tests make test skips as
# long-running (marked nightly: elastic restarts, the soak sample), the whole fault matrix
# (FAULTS_FULL), the 8-process tests, then the long property profiles (make property).
test-all: $(VENV)/.installed
	TEST_ALL=1 FAULTS_FULL=1 $(PY) -m pytest -x -q tests --world-size-8
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/test_properties_dtensor.py tests/test_properties_fake_pg.py

# The suite on another supported PyTorch (2.11, 2.12 or 2.13): `make test-torch VERSION=2.11`.
# A venv of its own, .venv-torch$(VERSION), with that torch from the package registry (on
# x86_64 that is the CUDA build, several GB; it runs on the CPU) and everything else pinned
# as in constraints.txt. Opt-in: make test runs on the pinned torch only.
TORCH_VENV := .venv-torch$(VERSION)
$(TORCH_VENV)/.installed: pyproject.toml constraints.txt
	@test -n "$(VERSION)" || { echo "usage: make test-torch VERSION=2.11 (or 2.12, 2.13)"; exit 2; }
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	grep -v '^torch==' constraints.txt > $(TORCH_VENV)/constraints.txt
	echo 'torch==$(VERSION).*' >> $(TORCH_VENV)/constraints.txt
	$(TORCH_VENV)/bin/python -m pip install --quiet -c $(TORCH_VENV)/constraints.txt -e ".[dev]"
	$(TORCH_VENV)/bin/python -m pip install --quiet -c $(TORCH_VENV)/constraints.txt --no-deps torchtitan lightning-fabric
	touch $@

test-torch: $(TORCH_VENV)/.installed
	$(TORCH_VENV)/bin/python -c 'import torch; print("torch", torch.__version__)'
	$(TORCH_VENV)/bin/python -m pytest -x -q tests

# The GPU check (benchmarks/gpu_check.py): about 8 minutes on one GPU, with the machine's own
# python3 and PyTorch (no venv, nothing installed; here, where .venv exists, its python); the
# report goes to $(GPU_REPORT). GPU_ARGS="--cpu" runs it end to end on this machine with tiny
# sizes; "--budget 240" halves it.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_REPORT ?= gpu-report
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_REPORT) $(GPU_ARGS)

# The property-based tests with many more random examples (world sizes up to 8); make test
# runs a small derandomized sample of the same properties.
property: $(VENV)/.installed
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/test_properties_dtensor.py tests/test_properties_fake_pg.py

train: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) $(TRAIN_SCRIPT) $(ARGS)

train-2d: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc-per-node=4 examples/train_2d.py $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(VENV)/.installed
	$(PY) benchmarks/run.py
	$(PY) benchmarks/train_bench.py $(BENCH_ARGS)
	$(PY) benchmarks/tp_bench.py
	$(PY) benchmarks/ckpt_bench.py
	$(PY) benchmarks/compile_bench.py
	$(PY) benchmarks/dispatch_bench.py
	$(PY) benchmarks/flight_bench.py
	$(PY) benchmarks/determinism_bench.py

soak: $(VENV)/.installed  # 1,000 steps at FSDP 2 and FSDP x TP 2 x 2: nothing may grow
	$(PY) -m tests.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
