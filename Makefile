# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if absent and installs what it needs.
# A GPU user keeps a CUDA build with e.g. `make demo TORCH="torch==2.5.1"`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# Where pip finds torch: empty is PyPI (on Linux its CUDA build, several GB); the CPU wheel
# (about 190 MB): make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sailfin-installed
PYTEST_ARGS ?=

.PHONY: demo report test test-slow test-all test-gpu gpu-checks bench docs clean

# The first run installs torch and the extras (pip shows each download and step);
# later runs find the stamp and start at once.
$(STAMP): pyproject.toml Makefile
	@echo "sailfin: [1/3] creating the virtual environment $(VENV) (once)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "sailfin: [2/3] installing $(TORCH) into $(VENV) (the long part of a first run)"
	$(PY) -m pip install --progress-bar on "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "sailfin: [3/3] installing sailfin (editable) with the dev and examples extras"
	$(PY) -m pip install --progress-bar on -e ".[dev,examples]"
	touch $(STAMP)
	@echo "sailfin: installed; later runs skip these steps"

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

# On a machine with a CUDA device: the cuda-marked tests, then the GPU benchmarks. Where
# $(PYTHON) already has a CUDA build of torch (a GPU image, perhaps with no package index),
# it runs them as it is and nothing is installed; else .venv is made as for `make test`
# (give it a CUDA build, e.g. TORCH="torch==2.13.0" from PyPI).
test-gpu:
	@if $(PYTHON) -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		echo "sailfin: $(PYTHON) has torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') with CUDA: using it, installing nothing"; \
		$(MAKE) --no-print-directory gpu-checks GPU_PY=$(PYTHON); \
	else \
		$(MAKE) --no-print-directory $(STAMP) && $(MAKE) --no-print-directory gpu-checks GPU_PY=$(PY); \
	fi

GPU_PY ?= $(PY)
gpu-checks:  # every check runs (GPU time is scarce); the target fails if any failed
	$(GPU_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch sees no CUDA device here')"
	@$(GPU_PY) -c "import importlib.util as u; m = [n for n in ('isal',) if not u.find_spec(n)]; m and print('make test-gpu: not installed here:', *m, '(sailfin checksums with zlib instead: slower saves and snapshots than a pip install gives)')"
	failed=""; \
	$(GPU_PY) -m pytest -q -m cuda $(PYTEST_ARGS) || failed="$$failed tests"; \
	$(GPU_PY) benchmarks/gpt.py --rounds 2 --steps 8 || failed="$$failed gpt.py"; \
	$(GPU_PY) benchmarks/gpt.py --only-saves --snapshots --async-save --rounds 2 \
		|| failed="$$failed gpt.py-saves"; \
	$(GPU_PY) benchmarks/hf.py --device cuda --model bert-base --amp --rounds 1 \
		|| failed="$$failed hf.py"; \
	if [ -n "$$failed" ]; then echo "make test-gpu: failed:$$failed"; exit 1; fi

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/writers.py
	$(PY) benchmarks/preprocess.py

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on any broken
# link or API reference. Installs the docs extra (MkDocs Material, mkdocstrings) once.
DOCS_STAMP := $(VENV)/.sailfin-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) outputs site .pytest_cache
