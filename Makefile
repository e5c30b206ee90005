# The two commands a new user runs: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test protos lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/accelmesh demo

test: $(STAMP)
	$(BIN)/python -m pytest

protos: $(STAMP)
	$(BIN)/python -m accelmesh.protogen

lint: $(STAMP)
	$(BIN)/buf lint

bench: $(STAMP)
	for b in inventory compile planning placement dispatch faults; do $(BIN)/python bench/$$b.py > bench-$$b.json || exit 1; done

clean:
	rm -rf $(VENV) .accelmesh .pytest_cache
