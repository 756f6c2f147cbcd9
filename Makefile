# The two commands of the README: `make demo` (set up, then the main RL run) and `make test`.
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
# A CPU build of torch; every pip call keeps this pin so nothing pulls a multi-GB CUDA build.
TORCH   := torch==2.13.0
export PIP_CACHE_DIR        := $(CURDIR)/.cache/pip
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export HF_HOME              := $(CURDIR)/.cache/huggingface
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.cache/torchinductor
export TRITON_CACHE_DIR     := $(CURDIR)/.cache/triton
export WANDB_DIR            := $(CURDIR)/.cache/wandb
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]' '$(TORCH)'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/rl train configs/demo.yaml

test: setup
	$(VENV)/bin/pytest -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf runs .cache .pytest_cache
