"""One constructor for every kind of policy the learner and the native engine can hold."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn


def build_policy(spec: Mapping[str, Any]) -> nn.Module:
    """`spec` (rl.config's model section as a dict):
      {"hf_path": DIR}                                   any transformers causal LM (HFPolicy, float32)
      {"preset": NAME, "overrides": {...}}               our hybrid model, random init
      {"preset": ..., "overrides": ..., "init_from": D}  the same, weights from a save_pretrained dir
    Every result takes forward(input_ids, routing=None, return_token_logprobs=True, logit_scale=...)
    and after_optimizer_step()."""
    if spec.get("hf_path"):
        if spec.get("init_from"):
            raise ValueError("build_policy: give hf_path or init_from, not both")
        from .hf_policy import HFPolicy

        return HFPolicy.from_pretrained(spec["hf_path"], dtype=spec.get("dtype", torch.float32))
    if not spec.get("preset"):
        raise ValueError("build_policy: the spec names neither a preset nor an hf_path")
    from .checkpoint import from_pretrained
    from .model import build_model

    model = build_model(spec["preset"], **dict(spec.get("overrides") or {}))
    if spec.get("init_from"):
        model.load_state_dict(from_pretrained(spec["init_from"]).state_dict())
    return model


def save_policy(model: nn.Module, path: str, state: dict[str, torch.Tensor] | None = None) -> None:
    """Either kind of policy in the layout its serving engines read: kimi_k3 for our hybrid,
    transformers' own for a transformers model. `state`: the tensors to write instead of the
    model's own (our hybrid's experts gathered from expert-parallel ranks)."""
    from .hf_policy import HFPolicy

    if isinstance(model, HFPolicy):
        model.save_pretrained(path)
    else:
        from .checkpoint import save_pretrained

        save_pretrained(model, path, state=state)


def load_policy(path: str) -> nn.Module:
    """A saved policy of either kind (told apart by its config's model_type)."""
    import json
    from pathlib import Path

    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type", "")
    if model_type in ("kimi_k3", "kimi_linear"):
        from .checkpoint import from_pretrained

        return from_pretrained(path)
    from .hf_policy import HFPolicy

    return HFPolicy.from_pretrained(path).eval()
