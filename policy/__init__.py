"""policy: the K3/K3.1-style hybrid model, its caches, checkpoints and tokenizer.

    from policy import ModelConfig, build_model, from_pretrained, Tokenizer, ModelCache
    model = build_model("toy", vocab_size=tok.vocab_size)      # presets: see policy.config.PRESETS
    out = model(ids, cache=None, use_cache=False, routing=None, return_routing=False)
    model.after_optimizer_step()                                # MoE bias balancing + QK-Clip
    save_pretrained(model, dir, tokenizer=tok); from_pretrained(dir)   # HF kimi_k3 layout
    build_policy({"preset": "toy", ...} | {"hf_path": dir})      # either kind; HFPolicy wraps transformers

Beyond docs/architecture.md: forward(..., logits_to_keep=n, return_indexer_loss=True) and
model.set_dsa_stage("warmup" | "sparse") for DSA indexer training; save_pretrained(...,
mxfp4_experts=True, dtype=torch.bfloat16); ModelCache.compact(); `rl model info` (policy.cli).
"""
from .build import build_policy, load_policy, save_policy
from .cache import KDACache, MLACache, ModelCache
from .checkpoint import from_pretrained, save_pretrained
from .config import PRESETS, ConfigError, ModelConfig, get_config
from .hf_policy import HFPolicy, checkpoint_state_dict
from .hf_tokenizer import HFChatTokenizer, load_tokenizer
from .model import CausalLMOutput, HybridForCausalLM, build_model
from .params import count_parameters
from .tokenizer import Tokenizer

__all__ = [
    "ModelConfig", "ConfigError", "PRESETS", "get_config", "build_model", "HybridForCausalLM",
    "CausalLMOutput", "ModelCache", "KDACache", "MLACache", "from_pretrained", "save_pretrained",
    "Tokenizer", "count_parameters", "build_policy", "save_policy", "load_policy", "HFPolicy", "checkpoint_state_dict",
    "HFChatTokenizer", "load_tokenizer",
]
