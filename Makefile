# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if absent and installs what it needs.
# A GPU user keeps a CUDA build with e.g. `make demo TORCH="torch==2.5.1"`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sailfin-installed
PYTEST_ARGS ?=

.PHONY: demo report test test-slow test-all test-gpu bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,examples]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m sailfin train examples/digits/config.yaml

# Charts of the demo run (after `make demo`): outputs/digits/report/
report: $(STAMP)
	$(PY) -m sailfin report outputs/digits

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# pytest exits 5 when no test carries the mark; that is not a failure.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-all: test test-slow

# On a machine with a CUDA device (and a CUDA build of torch, e.g. TORCH="torch==2.13.0"
# from the CUDA index): the cuda-marked tests, then the benchmarks on the GPU.
test-gpu: $(STAMP)
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: no CUDA device here')"
	$(PY) -m pytest -q -m cuda $(PYTEST_ARGS)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/backends.py

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/writers.py
	$(PY) benchmarks/preprocess.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
