# Ferry's everyday commands. Each target sets up what it needs first (scripts/bootstrap.sh,
# which returns in a second or two once everything is installed).

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.ONESHELL:
.DEFAULT_GOAL := help

VENV ?= .venv
export VENV
BIN := $(VENV)/bin
# pytest-xdist workers for the unit and integration tests, and for the end-to-end tests (each of
# those workers brings up its own local stack on free ports and takes whole test files).
TEST_WORKERS ?= auto
E2E_WORKERS ?= 2
# Extra pip-compile options for `make lock`, e.g. LOCK_ARGS=--upgrade or LOCK_ARGS="--upgrade-package boto3".
LOCK_ARGS ?=
LOCK_TOOLS := .ferry/lock-tools
MYPY_PATHS := layers/core/python/ferry $(if $(wildcard hostagent/*.py),hostagent)

.PHONY: help bootstrap demo test bench up lint lock clean distclean

help:
	@echo "make demo       set up, bring up the local stack, run a short scripted demo, shut down"
	@echo "make test       set up and run the whole test suite (unit, integration, end to end)"
	@echo "make bench      run the benchmark suite (minutes; not part of make test; docs/benchmarks.md)"
	@echo "make up         run the local stack in the foreground (Ctrl-C stops it)"
	@echo "make lint       ruff and mypy"
	@echo "make lock       re-resolve requirements.lock from pyproject.toml (LOCK_ARGS=--upgrade to move pins)"
	@echo "make clean      stop the test PostgreSQL server, remove its data, local state (.ferry) and tool caches"
	@echo "make distclean  clean, and remove the virtualenv too"

bootstrap:
	scripts/bootstrap.sh

demo: bootstrap
	$(BIN)/python scripts/demo.py

up: bootstrap
	exec $(BIN)/ferry-local

# Starts the test PostgreSQL server unless it already runs (and then leaves it running), runs the
# unit and integration tests in parallel, then the end-to-end tests, E2E_WORKERS local stacks side
# by side (whole files per worker: a module's fixtures set up its stack once; the files start in
# the order tests/e2e/conftest.py sets, the longest first, which xdist would otherwise re-sort). The first failing
# exit status wins; a pytest run that collects no test exits 5, which fails the target too.
test: bootstrap
	@if scripts/test-postgres.sh status; then started_pg=; else started_pg=1; fi
	FERRY_TEST_PG_URL=$$(scripts/test-postgres.sh start)
	export FERRY_TEST_PG_URL
	if [ -n "$$started_pg" ]; then trap 'scripts/test-postgres.sh stop' EXIT; fi
	rc=0
	$(BIN)/pytest -n $(TEST_WORKERS) --maxprocesses=8 --ignore=tests/e2e tests || rc=$$?
	if [ -n "$$(find tests/e2e -name 'test_*.py' -print -quit 2>/dev/null)" ]; then
	  $(BIN)/pytest -n $(E2E_WORKERS) --dist loadfile --no-loadscope-reorder tests/e2e || { e2e_rc=$$?; [ "$$rc" -ne 0 ] || rc=$$e2e_rc; }
	fi
	exit "$$rc"

# The benchmarks, one after the other; figures and how to read them: docs/benchmarks.md.
bench: bootstrap
	scripts/bench/run_all.sh

lint: bootstrap
	$(BIN)/ruff check .
	$(BIN)/mypy $(MYPY_PATHS)

lock:
	[ -x $(LOCK_TOOLS)/bin/pip-compile ] || { python3 -m venv $(LOCK_TOOLS) && $(LOCK_TOOLS)/bin/pip install -q pip-tools; }
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_TOOLS)/bin/pip-compile --quiet --allow-unsafe --all-extras \
	  --strip-extras --no-emit-index-url --no-emit-find-links $(LOCK_ARGS) --output-file requirements.lock pyproject.toml

# Also where PostgreSQL is not installed. The test server's data goes too, wherever it is
# (.ferry/test-postgres, /tmp/ferry-test-postgres-<hash> or $FERRY_PG_DIR). Keeps the virtualenv.
clean:
	scripts/test-postgres.sh remove
	rm -rf .ferry .pytest_cache .mypy_cache .ruff_cache

distclean: clean
	rm -rf $(VENV)
