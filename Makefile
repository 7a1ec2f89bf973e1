# swarm-mesh: `make up` trains a local swarm end to end, `make test` runs the tests.
# Both create .venv and install what they need (torch's CPU build on a CPU machine).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Wheels on disk (this kind of machine keeps the CPU torch wheel in /opt/wheels).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: up test lint format setup clean compose

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(BIN)/pip install --quiet --disable-pip-version-check $(FIND_LINKS) "torch==$(TORCH_VERSION)"
	$(BIN)/pip install --quiet --disable-pip-version-check $(FIND_LINKS) -e ".[dev,eval]"
	touch $(STAMP)

setup: $(STAMP)

up: $(STAMP)
	$(BIN)/swarm up --stages 4 --steps 200 --generate "ROMEO:"

# `make test` runs pytest twice (the groups are in tests/conftest.py):
#  1. every test not marked `alone`, on TEST_WORKERS pytest workers (pytest-xdist, `--dist loadgroup`):
#     the tests that train in real processes one at a time on one worker, the in-process tests and
#     the chaos kill test (it mostly waits) on the other; TEST_WORKERS=0 runs them in this process;
#  2. the tests marked `alone` (their checks assume idle cores), one at a time with nothing beside them.
# A phase that collects nothing (status 5, e.g. PYTEST_ARGS=tests/unit) passes if the other ran tests.
test: $(STAMP)
	@$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not alone" $(PYTEST_ARGS); first=$$?; \
	$(BIN)/python -m pytest -m alone $(PYTEST_ARGS); second=$$?; \
	echo "make test: status $$first with $(TEST_WORKERS) workers, $$second alone"; \
	if [ $$first = 5 ] && [ $$second = 5 ]; then exit 5; fi; \
	for status in $$first $$second; do [ $$status = 0 ] || [ $$status = 5 ] || exit $$status; done

# One format and a small rule set (pyproject.toml [tool.ruff]); CI runs lint before the tests.
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# One layer of the suite at a time: pure logic (seconds), in-process services (a minute),
# real processes on loopback, the chaos suite, and the benches' smoke runs and arena.
.PHONY: test-unit test-service test-e2e test-chaos test-bench
test-unit test-service test-e2e test-chaos test-bench: test-%: $(STAMP)
	$(BIN)/python -m pytest tests/$* $(PYTEST_ARGS)

# Every bench side by side with its alternative, tables on stdout, JSON in bench/results/
# (10-15 minutes on a 2-core machine; see docs/benchmarks.md).
.PHONY: bench bench-deps
bench: $(STAMP)
	$(BIN)/swarm bench all --out bench/results --markdown bench/results/tables.md

# hivemind, which the codec and hop benches then measure too (optional; torch stays as installed)
bench-deps: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check $(FIND_LINKS) -e ".[bench]" "torch==$(TORCH_VERSION)"

# docker-compose.yml's swarm in real containers on this machine (needs root and Docker, or apt to
# install it): engine, base image (from Debian's packages when no registry answers), image,
# training with a stage server killed and back, teardown; see .ci/compose.py. No venv needed.
compose:
	$(PYTHON) .ci/compose.py

clean:
	rm -rf $(VENV) runs .pytest_cache
