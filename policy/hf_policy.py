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
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kimi_kernels.logprobs import linear_token_logprobs

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

    def forward(self, input_ids: torch.Tensor, routing: torch.Tensor | None = None,
                return_token_logprobs: bool = True, logit_scale: float = 1.0,
                token_mask: torch.Tensor | None = None, **unused: Any) -> CausalLMOutput:
        """token_logprobs[b, t] = log p(input_ids[b, t] | < t) of softmax(logit_scale * logits), 0 at
        t = 0 (and where token_mask [B, T] is False: only those rows run through the head)."""
        if routing is not None:
            raise ValueError("HFPolicy: routing replay is not supported for transformers models "
                             "(set rollout.record_routing=false)")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"HFPolicy.forward: input_ids must be [B, T>=1], got {tuple(input_ids.shape)}")
        h = self.hf.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
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
