"""policy: the K3/K3.1-style hybrid model, its caches, checkpoints and tokenizer.

    from policy import ModelConfig, build_model, from_pretrained, Tokenizer, ModelCache
"""
from .cache import KDACache, MLACache, ModelCache
from .checkpoint import from_pretrained, save_pretrained
from .config import PRESETS, ConfigError, ModelConfig, get_config
from .model import CausalLMOutput, HybridForCausalLM, build_model
from .params import count_parameters
from .tokenizer import Tokenizer

__all__ = [
    "ModelConfig", "ConfigError", "PRESETS", "get_config", "build_model", "HybridForCausalLM",
    "CausalLMOutput", "ModelCache", "KDACache", "MLACache", "from_pretrained", "save_pretrained",
    "Tokenizer", "count_parameters",
]
