# The README's two commands: `make demo` and `make test`. Each sets itself up from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: demo test check lint typecheck bench clean engines engine-fixtures

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

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

lint: $(STAMP)
	$(VENV)/bin/ruff check gputrace tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck test

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache  # .venv-engines stays: rm -rf it by hand
