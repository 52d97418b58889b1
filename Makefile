# The README's two commands: `make demo` and `make test`. Each sets itself up from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
# Every install (demo, test, CI) takes its versions from the lock, so an upstream release cannot
# break the README's commands; `make lock` refreshes it on purpose, `make test-latest` tries the
# newest versions pyproject.toml's ranges allow without touching it.
LOCK := requirements-dev.lock
UV_VERSION := 0.13.9
LATEST_VENV := .venv-latest

.PHONY: demo test test-latest lock check lint typecheck bench clean engines engine-fixtures docs-knobs

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --require-hashes -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# Re-resolve the lock from pyproject.toml's ranges (newest versions, every platform, hashed).
lock:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'uv==$(UV_VERSION)'
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --universal --python-version 3.11 \
	  --generate-hashes --upgrade --quiet -o $(LOCK)

# The suite on the newest versions the ranges allow (its own venv, the lock untouched): drift found
# on purpose. A failure here is a release to look at before `make lock`, not a broken main.
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade -e '.[dev]'
	PY=$(LATEST_VENV)/bin/python TEST_WORKERS=$(TEST_WORKERS) tests/suite.sh $(PYTEST_ARGS)

# Each demo replaces the previous one's output.
demo: $(STAMP)
	rm -rf demo-out
	$(VENV)/bin/gputrace demo --out demo-out

# The suite in three passes (tests/suite.sh): most of it on TEST_WORKERS pytest-xdist workers, then
# the real-time chains and the engine tier one at a time; each pass's wall time is printed.
TEST_WORKERS ?= 3
test: $(STAMP)
	PY=$(PY) TEST_WORKERS=$(TEST_WORKERS) tests/suite.sh $(PYTEST_ARGS)

# Real SGLang and vLLM on the CPU (PP=2, dummy weights, a tiny local model) for the engine tier:
# their own environment, apart from .venv (they pin their own torch and transformers). Idempotent.
engines:
	$(PYTHON) tests/engines/setup_env.py --venv .venv-engines

# Re-record tests/data/engines/ from real runs of both engines at both settings (about 10 min).
engine-fixtures: $(STAMP) engines
	$(PY) tests/engines/record_fixtures.py

# The knob reference (docs/knobs-<engine>.md) from the engines' knob registry.
docs-knobs: $(STAMP)
	$(VENV)/bin/gputrace knobs --out docs

lint: $(STAMP)
	$(VENV)/bin/ruff check gputrace tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck test

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(LATEST_VENV) demo-out .pytest_cache .mypy_cache .ruff_cache  # .venv-engines stays: rm -rf it by hand
