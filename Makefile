# The two commands a new user runs: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The fixture CPU every test's workers describe (tests/fakes/host.py); empty: broadwell_avx2.
TEST_CPU ?= $(ACCELMESH_TEST_CPU)
FIXTURE_CPUS := broadwell_avx2 sapphire_rapids graviton2_arm

# `make test` runs the suite in two tiers, each with its own number of pytest-xdist processes:
# the unit tier (not marked slow) spread over every core (auto), then the tests that start meshes
# and processes (slow), a whole file to each of two processes: their meshes wait on sockets and
# on each other as much as they compute, so two overlap well on two cores (291 s against 358 s
# serially on a quiet machine, 325 s with `stress-ng --cpu 2` beside them) where three did not
# (17.5 min against 12 serially on a loaded one). Raise it on a bigger machine.
# TEST_MARK narrows both tiers by a marker expression (CI: fixture_cpu); PYTEST_ARGS adds arguments.
UNIT_PROCESSES ?= auto
TEST_PROCESSES ?= 2
TEST_MARK ?=
PYTEST_ARGS ?=
PYTEST = ACCELMESH_TEST_CPU=$(TEST_CPU) $(BIN)/python -m pytest
and_mark = $(if $(TEST_MARK), and ($(TEST_MARK)))
# pytest's exit status 5 is "no test selected": a tier the mark leaves empty is not a failure.
tier_ok = rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

.PHONY: demo test test-fast test-cpus protos lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/accelmesh demo

test: $(STAMP)
	@$(PYTEST) -n $(UNIT_PROCESSES) -m "not slow$(and_mark)" $(PYTEST_ARGS); $(tier_ok) || unit_failed=1; \
	$(PYTEST) -n $(TEST_PROCESSES) --dist loadfile -m "slow$(and_mark)" $(PYTEST_ARGS); $(tier_ok) || exit 1; \
	[ -z "$$unit_failed" ] || { echo "the unit tier failed (above)"; exit 1; }

# The unit tier alone: everything but the tests that start meshes and processes (marked slow).
test-fast: $(STAMP)
	$(PYTEST) -n $(UNIT_PROCESSES) -m "not slow$(and_mark)" -q $(PYTEST_ARGS)

test-cpus: $(STAMP)
	@for cpu in $(FIXTURE_CPUS); do \
		start=$$(date +%s); \
		$(MAKE) --no-print-directory test TEST_CPU=$$cpu PYTEST_ARGS=-q > .test-$$cpu.log 2>&1; rc=$$?; \
		echo "$$cpu: $$(grep -E '(passed|failed|error).* in [0-9.]+s' .test-$$cpu.log | tr '\n' ' ')(exit $$rc, $$(( $$(date +%s) - start )) s wall; log .test-$$cpu.log)"; \
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
