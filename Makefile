# The two commands a new user runs: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The fixture CPU every test's workers describe (tests/fakes/host.py); empty: broadwell_avx2.
TEST_CPU ?= $(ACCELMESH_TEST_CPU)
FIXTURE_CPUS := broadwell_avx2 sapphire_rapids graviton2_arm

.PHONY: demo test test-cpus protos lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/accelmesh demo

test: $(STAMP)
	ACCELMESH_TEST_CPU=$(TEST_CPU) $(BIN)/python -m pytest

test-cpus: $(STAMP)
	@for cpu in $(FIXTURE_CPUS); do \
		start=$$(date +%s); \
		ACCELMESH_TEST_CPU=$$cpu $(BIN)/python -m pytest -q > .test-$$cpu.log 2>&1; rc=$$?; \
		echo "$$cpu: $$(tail -n 1 .test-$$cpu.log) (exit $$rc, $$(( $$(date +%s) - start )) s wall; log .test-$$cpu.log)"; \
		[ $$rc -eq 0 ] || failed=1; \
	done; exit $${failed:-0}

protos: $(STAMP)
	$(BIN)/python -m accelmesh.protogen

lint: $(STAMP)
	$(BIN)/buf lint

bench: $(STAMP)
	for b in inventory compile planning placement dispatch faults fuzz ha; do $(BIN)/python bench/$$b.py > bench-$$b.json || exit 1; done

clean:
	rm -rf $(VENV) .accelmesh .pytest_cache .test-*.log
