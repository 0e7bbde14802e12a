# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if absent and installs what it needs, with a pinned, known-good torch.
# Another torch (any pip requirement, 2.9 or newer; in an environment of its own):
#   make test VENV=.venv-2.15 TORCH="torch==2.15.0"
# (where the machine's pip configuration caps torch, PIP_CONSTRAINT=/dev/null lifts the cap).
# Both ends of the supported range: make test-compat (below).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# Where pip finds torch: empty is PyPI (on Linux its CUDA build, several GB); the CPU wheel
# (about 190 MB): make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sailfin-installed
PYTEST_ARGS ?=

.PHONY: demo report test test-slow test-all test-compat test-compat-ci test-compat-min test-compat-new test-gpu gpu-checks bench docs clean

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

# Both ends of the supported range (README, "Supported versions"): .venv-min holds the
# oldest Python with the oldest releases sailfin declares (requirements/compat-min.txt),
# .venv-new the newest Python with every library's newest release
# (requirements/compat-new.txt pins nothing). Each is built once, like .venv; the default
# suite runs on each and one line per environment says what it resolved and how it went.
# COMPAT_ARGS narrows the suite (pytest arguments), e.g. COMPAT_ARGS="tests/backends".
find_python = $(or $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/$(1).*/bin/python))),$(shell command -v python$(1) 2>/dev/null))
PYTHON_MIN ?= $(call find_python,3.10)
PYTHON_NEW ?= $(call find_python,3.13)
COMPAT_ARGS ?=
COMPAT_MARK ?= not slow
COMPAT_PACKAGES := torch numpy transformers tokenizers peft opacus datasets

.venv-min/.sailfin-installed: pyproject.toml requirements/compat-min.txt
	$(call compat_env,.venv-min,$(PYTHON_MIN),requirements/compat-min.txt)

.venv-new/.sailfin-installed: pyproject.toml requirements/compat-new.txt
	$(call compat_env,.venv-new,$(PYTHON_NEW),requirements/compat-new.txt)

# $(1) the environment, $(2) its Python, $(3) its pip constraints (which replace any
# machine-wide ones: the newest end must not be capped).
define compat_env
	@test -n "$(2)" || { echo "make test-compat: no Python for $(1) (set PYTHON_MIN / PYTHON_NEW)"; exit 1; }
	@echo "sailfin: building $(1) with $(2) and $(3) (once)"
	test -x $(1)/bin/python || $(2) -m venv $(1)
	PIP_CONSTRAINT=$(CURDIR)/$(3) $(1)/bin/python -m pip install -q --upgrade pip
	PIP_CONSTRAINT=$(CURDIR)/$(3) $(1)/bin/python -m pip install --progress-bar off -e ".[dev,examples]"
	touch $(1)/.sailfin-installed
endef

# Both ends, one after the other; each end's line again at the close. One end alone:
# make test-compat-min, make test-compat-new.
test-compat:
	@failed=""; \
	$(MAKE) --no-print-directory test-compat-min || failed="$$failed min"; \
	$(MAKE) --no-print-directory test-compat-new || failed="$$failed new"; \
	cat .venv-min/last-summary .venv-new/last-summary 2>/dev/null; \
	if [ -n "$$failed" ]; then echo "make test-compat: failed:$$failed"; exit 1; fi

# CI's share of it (.ci/run): at both ends, the default suites of tests/backends,
# tests/checkpoint and tests/distributed whole, one test of every other file,
# and one each of the slow kill-and-resume, ddp, fsdp, memory-snapshot and dp runs
# (tests/conftest.py, --compat-subset).
test-compat-ci:
	$(MAKE) --no-print-directory test-compat COMPAT_MARK= COMPAT_ARGS=--compat-subset

test-compat-min: .venv-min/.sailfin-installed
	$(call compat_run,.venv-min)

test-compat-new: .venv-new/.sailfin-installed
	$(call compat_run,.venv-new)

# $(1) the environment: the default suite, then one line: the versions, pytest's result.
define compat_run
	@rm -f $(1)/last-summary
	@{ $(1)/bin/python -m pytest -q -m "$(COMPAT_MARK)" -p no:cacheprovider --tb=short $(COMPAT_ARGS); \
	  echo $$? > $(1)/last-test.rc; } 2>&1 | tee $(1)/last-test.log
	@versions=$$($(1)/bin/python -c "import importlib.metadata as m, platform; print('Python', platform.python_version() + ',', ', '.join(n + ' ' + m.version(n) for n in '$(COMPAT_PACKAGES)'.split()))"); \
	result=$$(tail -n 1 $(1)/last-test.log | tr -d '=' | sed 's/^ *//; s/ *$$//'); \
	echo "sailfin test-compat $(patsubst .venv-%,%,$(1)): $$versions: $$result" | tee $(1)/last-summary; \
	exit $$(cat $(1)/last-test.rc)
endef

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
# .venv-min and .venv-new (make test-compat) stay: rm -rf them to rebuild
