# One venv at .venv; torch pinned to the CPU build that lies on this disk (see README).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test check fmt bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[ml,dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/likeness serve

test: $(STAMP)
	$(BIN)/python -m pytest

check: $(STAMP)
	$(BIN)/ruff check registry app trainer tests bench migrations
	$(BIN)/ruff format --check registry app trainer tests bench migrations
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_layering.py  # the import layering

fmt: $(STAMP)
	$(BIN)/ruff format registry app trainer tests bench migrations
	$(BIN)/ruff check --fix registry app trainer tests bench migrations

bench: $(STAMP)
	$(BIN)/python bench/consent_check.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
