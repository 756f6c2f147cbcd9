"""Any transformers causal LM (Llama, Qwen3-MoE, Qwen3-Next, Kimi Linear, ...) as a policy the learner
trains exactly like HybridForCausalLM: the same forward signature, token logprobs computed blockwise
from the last hidden states (kimi_kernels/logprobs.py: the [B, T, vocab] logits never exist), the same
post-step hook, and a state_dict with transformers' own (runtime) parameter names.

    policy = HFPolicy.from_pretrained("path/to/hf_dir")
    out = policy(ids, return_token_logprobs=True, logit_scale=1 / T)   # out.token_logprobs [B, T]
    checkpoint_state_dict(policy.state_dict(), policy.hf.config)         # names a HF/vLLM loader reads

Transformers 5 fuses some tensors at load time (MoE experts into one [E, ...] tensor):
`checkpoint_state_dict` reverts that, giving the names on disk, which vLLM's loaders read."""
from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kimi_kernels.logprobs import linear_token_logprobs
from kimi_kernels.varlen import check_cu_seqlens, positions_in_segment, repad_index, segment_starts

from .model import CausalLMOutput


class HFPolicy(nn.Module):
    """Registers the transformers model's own children (`model`, `lm_head`, ...) so that
    state_dict() names are exactly the transformers model's."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        cfg = hf_model.config
        for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if getattr(cfg, attr, None) not in (None, 1.0):
                raise ValueError(f"HFPolicy: {type(hf_model).__name__} post-processes its logits ({attr}="
                                 f"{getattr(cfg, attr)}), which the blockwise token logprobs do not apply")
        self.__dict__["hf"] = hf_model  # not a submodule: its children are registered below
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self.config = cfg

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "HFPolicy":
        from transformers import AutoModelForCausalLM

        if not (Path(path) / "config.json").exists():
            raise FileNotFoundError(f"HFPolicy: no config.json in {path}")
        return cls(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype))

    @property
    def packs_rows(self) -> bool:
        """Whether a packed row (forward's cu_seqlens) is exact for this model: every layer is softmax
        attention, which _packed_attention keeps within each sequence. Recurrent layers (Qwen3-Next's
        gated delta nets) would carry state across sequences: such models train on padded rows."""
        return self.config.model_type in PACKABLE_MODEL_TYPES

    def forward(self, input_ids: torch.Tensor, routing: torch.Tensor | None = None,
                return_token_logprobs: bool = True, logit_scale: float = 1.0,
                token_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                **unused: Any) -> CausalLMOutput:
        """token_logprobs[b, t] = log p(input_ids[b, t] | < t) of softmax(logit_scale * logits), 0 at
        t = 0 (and where token_mask [B, T] is False: only those rows run through the head).
        cu_seqlens: input_ids [1, T] packs several sequences (kimi_kernels/varlen.py); positions
        restart at each, attention stays within each, each first token's logprob is 0."""
        if routing is not None:
            raise ValueError("HFPolicy: routing replay is not supported for transformers models "
                             "(set rollout.record_routing=false)")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"HFPolicy.forward: input_ids must be [B, T>=1], got {tuple(input_ids.shape)}")
        if cu_seqlens is None:
            h = self.hf.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        else:
            if not self.packs_rows:
                raise ValueError(f"HFPolicy: {self.config.model_type} has layers a packed row would leak "
                                 f"state through; train it on padded rows (train.packing=false)")
            check_cu_seqlens(cu_seqlens, input_ids.shape[0], input_ids.shape[1], "HFPolicy.forward")
            positions = positions_in_segment(cu_seqlens, input_ids.shape[1])[None]
            with _attention_implementation(self.hf.config, PACKED_ATTENTION):
                h = self.hf.base_model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                       kimi_cu_seqlens=cu_seqlens).last_hidden_state
        head = self.hf.get_output_embeddings()
        if not return_token_logprobs:
            logits = head(h).float()
            return CausalLMOutput(logits if logit_scale == 1.0 else logits * logit_scale)
        if head.bias is not None:
            raise ValueError("HFPolicy: an output projection with a bias is not supported")
        B, T = input_ids.shape
        rows = torch.ones(B, T - 1, dtype=torch.bool, device=input_ids.device)
        if token_mask is not None:
            rows = token_mask[:, 1:].to(torch.bool)
        if cu_seqlens is not None:  # a sequence's first token is no prediction of the one before it
            rows = rows & ~segment_starts(cu_seqlens, T)[None, 1:]
        logp, ent = linear_token_logprobs(h[:, :-1][rows], head.weight, input_ids[:, 1:][rows], logit_scale)
        full_logp = torch.zeros(B, T - 1, dtype=logp.dtype, device=h.device).masked_scatter(rows, logp)
        full_ent = torch.zeros(B, T - 1, dtype=ent.dtype, device=h.device).masked_scatter(rows, ent)
        return CausalLMOutput(None, token_logprobs=F.pad(full_logp, (1, 0)), token_entropy=F.pad(full_ent, (1, 0)))

    def set_activation_checkpointing(self, on: bool) -> None:
        """transformers' own per-layer recomputation in backward (non-reentrant)."""
        if on:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf.gradient_checkpointing_disable()

    def after_optimizer_step(self) -> dict[str, float]:
        """Nothing to do after a step for these models (no bias balancing, no QK-Clip)."""
        return {}

    def save_pretrained(self, path: str | Path, tokenizer: Any = None) -> None:
        """transformers' own format (checkpoint names, which vLLM reads); `tokenizer`: a
        transformers tokenizer saved beside it."""
        self.hf.save_pretrained(str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))


# transformers model types whose every layer is softmax attention through the attention interface,
# checked packed == padded by tests/policy/test_hf_policy.py
PACKABLE_MODEL_TYPES = frozenset({"llama", "qwen3", "qwen3_moe"})
PACKED_ATTENTION = "kimi_packed"


def _packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      kimi_cu_seqlens: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention call on a packed row: query [1, H, T, D], key/value [1, Hkv, T, D]
    re-padded into one row per sequence and attended causally (padding comes after each row's
    tokens, so no query sees it), then packed again: [1, T, H, D] as transformers expects.
    Registered under PACKED_ATTENTION, a name with no mask function: transformers builds no mask."""
    if kimi_cu_seqlens is None:
        raise ValueError("packed attention needs kimi_cu_seqlens (HFPolicy.forward passes it)")
    index, real = repad_index(kimi_cu_seqlens)
    pad = lambda t: t[0][:, index].transpose(0, 1)  # noqa: E731 [H, T, D] -> [N, H, L, D]
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(pad(query), pad(key), pad(value), is_causal=True, scale=scaling,
                                         enable_gqa=groups > 1)  # [N, H, L, D]
    T = query.shape[2]
    packed = out.new_zeros(T, out.shape[1], out.shape[3]).index_copy(0, index[real], out.transpose(1, 2)[real])
    return packed.unsqueeze(0), None


@contextmanager
def _attention_implementation(config: Any, name: str) -> Iterator[None]:
    from transformers import AttentionInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _packed_attention)
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


@functools.lru_cache(maxsize=8)
def _meta_model(config_json: str) -> nn.Module:
    """A transformers model on the meta device: only its weight-conversion mapping is used."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import json

    raw = json.loads(config_json)
    cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def checkpoint_state_dict(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A transformers model's runtime state_dict -> the tensor names (and shapes) of its saved
    checkpoint, e.g. fused MoE experts back to experts.N.{gate,up,down}_proj.weight."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(_meta_model(config.to_json_string(use_diff=False)), dict(state))
