# The two commands a new user runs: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The fixture CPU every test's workers describe (tests/fakes/host.py); empty: broadwell_avx2.
TEST_CPU ?= $(ACCELMESH_TEST_CPU)
FIXTURE_CPUS := broadwell_avx2 sapphire_rapids graviton2_arm

# Test processes (pytest-xdist, a test file to a process); 0: one process, no xdist. On two cores
# the suite's meshes already keep both busy: three processes took 17.5 min against 12 serially,
# so the default is 0; raise it on a machine with more cores. Extra pytest arguments: PYTEST_ARGS.
TEST_PROCESSES ?= 0
PYTEST_ARGS ?=

.PHONY: demo test test-fast test-cpus protos lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/accelmesh demo

test: $(STAMP)
	ACCELMESH_TEST_CPU=$(TEST_CPU) $(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile $(PYTEST_ARGS)

# The unit tier: everything but the tests that start meshes and processes (marked slow).
test-fast: $(STAMP)
	ACCELMESH_TEST_CPU=$(TEST_CPU) $(BIN)/python -m pytest -n $(TEST_PROCESSES) -m "not slow" -q $(PYTEST_ARGS)

test-cpus: $(STAMP)
	@for cpu in $(FIXTURE_CPUS); do \
		start=$$(date +%s); \
		ACCELMESH_TEST_CPU=$$cpu $(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile -q > .test-$$cpu.log 2>&1; rc=$$?; \
		echo "$$cpu: $$(tail -n 1 .test-$$cpu.log) (exit $$rc, $$(( $$(date +%s) - start )) s wall; log .test-$$cpu.log)"; \
		[ $$rc -eq 0 ] || failed=1; \
	done; exit $${failed:-0}

protos: $(STAMP)
	$(BIN)/python -m accelmesh.protogen

lint: $(STAMP)
	$(BIN)/buf lint
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench: $(STAMP)
	for b in inventory compile planning placement dispatch faults fuzz ha; do $(BIN)/python bench/$$b.py > bench-$$b.json || exit 1; done

clean:
	rm -rf $(VENV) .accelmesh .pytest_cache .test-*.log
