# Two commands on a fresh clone: `make test` and `make train`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 2
TRAIN_SCRIPT ?= $(if $(wildcard examples/train_gpt.py),examples/train_gpt.py,examples/mesh_demo.py)

.PHONY: test property train train-2d lint bench soak clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(PY) -m pip install --quiet -c constraints.txt --no-deps torchtitan  # test-only; why: constraints.txt
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -x -q tests

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
