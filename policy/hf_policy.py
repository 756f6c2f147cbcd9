"""Any transformers causal LM (Llama, Qwen3-MoE, Qwen3-Next, Kimi Linear, ...) as a policy the learner
trains exactly like HybridForCausalLM: the same forward signature, token logprobs computed blockwise
from the last hidden states (kimi_kernels/logprobs.py: the [B, T, vocab] logits never exist), the same
post-step hook, and a state_dict with transformers' own (runtime) parameter names.

    policy = HFPolicy.from_pretrained("path/to/hf_dir")
    out = policy(ids, return_token_logprobs=True, logit_scale=1 / T)   # out.token_logprobs [B, T]
    checkpoint_state_dict(policy.state_dict(), policy.hf.config)         # names a HF/vLLM loader reads

A packed row (the learner's micro-batch) whose neighbouring sequences begin alike, as a GRPO group's
samples begin with their prompt, runs that prefix once (`PrefixTree`): every token keeps its position
and sees what it saw in its own sequence, so logprobs and gradients are the unshared row's, for
fewer tokens through the model (on configs/vllm_cpu.yaml's batches: 35-token prompts shared by 8).

Transformers 5 fuses some tensors at load time (MoE experts into one [E, ...] tensor):
`checkpoint_state_dict` reverts that, giving the names on disk, which vLLM's loaders read."""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kimi_kernels.logprobs import linear_token_logprobs
from kimi_kernels.varlen import (RepadBucket, check_cu_seqlens, host_boundaries, positions_in_segment, repad_buckets,
                                 repad_index, segment_starts, to_packed)

from .model import CausalLMOutput


class HFPolicy(nn.Module):
    """Registers the transformers model's own children (`model`, `lm_head`, ...) so that
    state_dict() names are exactly the transformers model's."""

    def __init__(self, hf_model: nn.Module, share_prefixes: bool = True) -> None:
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
        # a packed row's sequences that begin alike (a GRPO group's prompt) run their common prefix once
        self.share_prefixes = share_prefixes
        self.forwarded_tokens = 0  # tokens the model ran since construction (shared prefixes once)
        self.body_dtype: torch.dtype | None = None  # set_body_dtype

    def set_body_dtype(self, dtype: torch.dtype | None) -> None:
        """Run the decoder's matrix products in `dtype` (autocast) on a CPU; None: in the weights' dtype.
        The head stays out of it: its log-probabilities are computed from float32 hidden states and
        weights, where bf16 logits would be off by up to ~0.1 nats."""
        self.body_dtype = dtype

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
                target_mask: torch.Tensor | None = None, **unused: Any) -> CausalLMOutput:
        """token_logprobs[b, t] = log p(input_ids[b, t] | < t) of softmax(logit_scale * logits), 0 at
        t = 0 and where token_mask or target_mask [B, T] (the tokens a learner trains on) is False: only
        the other rows run through the head (a GRPO row's prompt needs none).
        cu_seqlens: input_ids [1, T] packs several sequences (kimi_kernels/varlen.py); positions
        restart at each, attention stays within each, each first token's logprob is 0."""
        if routing is not None:
            raise ValueError("HFPolicy: routing replay is not supported for transformers models "
                             "(set rollout.record_routing=false)")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"HFPolicy.forward: input_ids must be [B, T>=1], got {tuple(input_ids.shape)}")
        with self._body_autocast(input_ids.device):
            h, tree = self._body(input_ids, cu_seqlens)
        head = self.hf.get_output_embeddings()
        if h.dtype != head.weight.dtype:  # hidden states of an autocast body, back to the head's dtype
            h = h.to(head.weight.dtype)
        if not return_token_logprobs:
            logits = head(h if tree is None else h[:, tree.to_tree]).float()
            return CausalLMOutput(logits if logit_scale == 1.0 else logits * logit_scale)
        if head.bias is not None:
            raise ValueError("HFPolicy: an output projection with a bias is not supported")
        B, T = input_ids.shape
        rows = torch.ones(B, T - 1, dtype=torch.bool, device=input_ids.device)
        for mask in (token_mask, target_mask):
            if mask is not None:
                rows = rows & mask[:, 1:].to(torch.bool)
        if cu_seqlens is not None:  # a sequence's first token is no prediction of the one before it
            rows = rows & ~segment_starts(cu_seqlens, T)[None, 1:]
        if tree is not None:
            return tree.token_logprobs(h[0], head.weight, rows[0], logit_scale, self._cpu_body_dtype(h.device))
        logp, ent = linear_token_logprobs(h[:, :-1][rows], head.weight, input_ids[:, 1:][rows], logit_scale,
                                          grad_dtype=self._cpu_body_dtype(h.device))
        full_logp = torch.zeros(B, T - 1, dtype=logp.dtype, device=h.device).masked_scatter(rows, logp)
        full_ent = torch.zeros(B, T - 1, dtype=ent.dtype, device=h.device).masked_scatter(rows, ent)
        return CausalLMOutput(None, token_logprobs=F.pad(full_logp, (1, 0)), token_entropy=F.pad(full_ent, (1, 0)))

    def _cpu_body_dtype(self, device: torch.device) -> torch.dtype | None:
        """The body's autocast dtype, and the head's gradient GEMMs' (its forward keeps h's): on a CPU only."""
        return self.body_dtype if device.type == "cpu" else None

    def _body_autocast(self, device: torch.device):
        dtype = self._cpu_body_dtype(device)
        return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)

    def _body(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """The decoder's last hidden states, and the shared-prefix tree they are laid out by (None: by input_ids)."""
        tree = None
        if cu_seqlens is None:
            h = self.hf.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
            self.forwarded_tokens += input_ids.numel()
        else:
            if not self.packs_rows:
                raise ValueError(f"HFPolicy: {self.config.model_type} has layers a packed row would leak "
                                 f"state through; train it on padded rows (train.packing=false)")
            check_cu_seqlens(cu_seqlens, input_ids.shape[0], input_ids.shape[1], "HFPolicy.forward")
            tree = shared_prefix_tree(input_ids[0], cu_seqlens) if self.share_prefixes else None
            if tree is None:
                ids, positions = input_ids, positions_in_segment(cu_seqlens, input_ids.shape[1])[None]
                index, owned = repad_index(cu_seqlens)
            else:
                ids, positions, index, owned = tree.ids[None], tree.positions[None], tree.index, tree.owned
            repad = repad_buckets(index, owned, cu_seqlens)
            with _attention_implementation(self.hf.config, PACKED_ATTENTION):
                h = self.hf.base_model(input_ids=ids, position_ids=positions, use_cache=False,
                                       kimi_repad=repad).last_hidden_state
            self.forwarded_tokens += ids.numel()
        return h, tree

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
                      kimi_repad: list[RepadBucket] | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention call on a packed row: query [1, H, T, D], key/value [1, Hkv, T, D]
    re-padded into one row per sequence and attended causally (padding comes after each row's
    tokens, so no query sees it), then packed again: [1, T, H, D] as transformers expects.
    kimi_repad: buckets of rows of like lengths (kimi_kernels/varlen.py's repad_buckets), each with
    index [N_b, L_b] and real [N_b, L_b]: a row's token i is packed position index[n, i]; each
    packed position's output is taken from the one row that owns it (a shared prefix appears in
    every row of its group, owned by the first). Registered under PACKED_ATTENTION, a name with no
    mask function: transformers builds no mask."""
    if kimi_repad is None:
        raise ValueError("packed attention needs kimi_repad (HFPolicy.forward passes it)")
    groups = query.shape[1] // key.shape[1]
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # a CPU's bf16 flash-attention backward runs ~3x slower than its float32 one (a GRPO row's
        # short sequences: 65 vs 23 ms a call): attention in float32, the projections around it in bf16
        with torch.autocast("cpu", enabled=False):
            return _packed_attention(module, query.float(), key.float(), value.float(), attention_mask, scaling,
                                     dropout, kimi_repad, **kwargs)
    packed = query.new_zeros(query.shape[2], query.shape[1], value.shape[3])  # [T, H, Dv]
    for bucket in kimi_repad:
        n, length = bucket.index.shape
        # [1, H, T, D] -> [N, H, L, D] by whole tokens (index_select: its backward is an index_add over
        # rows of H * D values, where advanced indexing's accumulating index_put ran 3x slower on a CPU)
        pad = lambda t: t[0].transpose(0, 1).index_select(0, bucket.index.reshape(-1)).view(  # noqa: E731
            n, length, t.shape[1], t.shape[3]).transpose(1, 2)
        out = F.scaled_dot_product_attention(pad(query), pad(key), pad(value), is_causal=True, scale=scaling,
                                             enable_gqa=groups > 1)  # [N, H, L, D]
        packed = to_packed(out.transpose(1, 2), bucket, packed)
    return packed.unsqueeze(0), None


# a common prefix shorter than this runs once per sequence: too little to save for the bookkeeping
MIN_SHARED_PREFIX = 8


@dataclass
class PrefixTree:
    """A packed row [T] whose runs of neighbouring sequences with a common prefix (a GRPO group's
    prompt) hold it once: [prefix, rest of sequence 1, rest of sequence 2, ...], Tc <= T tokens.
    Every token keeps its own position and sees exactly what it saw in its sequence (the prefix,
    then its own tokens), so hidden states and logprobs are the unshared row's; the prefix's
    gradient is the sum of its sequences'."""

    ids: torch.Tensor  # [Tc] the tree's tokens
    positions: torch.Tensor  # [Tc] each token's position in its sequence
    to_tree: torch.Tensor  # [T] where each token of the packed row sits in the tree
    # on the host (repad_buckets takes them there and moves its buckets to the device)
    index: torch.Tensor  # [N, L] attention rows: sequence n's token i is tree token index[n, i]
    owned: torch.Tensor  # [N, L] bool: the row whose output a tree token takes (a prefix's: its run's first)

    def token_logprobs(self, h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                       logit_scale: float, grad_dtype: torch.dtype | None = None) -> CausalLMOutput:
        """HFPolicy.forward's token logprobs [1, T] from the tree's hidden states h [Tc, d]: each tree
        token's logprob once (given its parent: the token before it in its sequence), copied to every
        position of the packed row it stands for. rows [T-1]: the positions 1.. that need one;
        grad_dtype: linear_token_logprobs'."""
        child = self.to_tree[1:][rows]
        parent = self.to_tree[:-1][rows]
        unique, first = _first_occurrences(child)
        logp, ent = linear_token_logprobs(h[parent[first]], weight, self.ids[unique], logit_scale,
                                          grad_dtype=grad_dtype)
        slot = torch.full((self.ids.shape[0],), -1, dtype=torch.long, device=h.device)
        slot[unique] = torch.arange(unique.numel(), device=h.device)
        at = slot[child]  # which computed logprob each needed position takes
        T = self.to_tree.shape[0]
        full_logp = torch.zeros(T - 1, dtype=logp.dtype, device=h.device).masked_scatter(rows, logp[at])
        full_ent = torch.zeros(T - 1, dtype=ent.dtype, device=h.device).masked_scatter(rows, ent[at])
        return CausalLMOutput(None, token_logprobs=F.pad(full_logp, (1, 0))[None],
                              token_entropy=F.pad(full_ent, (1, 0))[None])


def _first_occurrences(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct values of x, sorted; the index in x of each one's first occurrence)."""
    unique, inverse = torch.unique(x, sorted=True, return_inverse=True)
    first = torch.full((unique.numel(),), x.numel(), dtype=torch.long, device=x.device)
    first = first.scatter_reduce(0, inverse, torch.arange(x.numel(), device=x.device), reduce="amin")
    return unique, first


def shared_prefix_tree(ids: torch.Tensor, cu_seqlens: torch.Tensor,
                       min_shared: int = MIN_SHARED_PREFIX) -> PrefixTree | None:
    """The tree of a packed row ids [T] (boundaries cu_seqlens) whose neighbouring sequences share
    at least `min_shared` leading tokens; None where none do. A run's shared prefix is what all its
    sequences begin with, short of each one's last token (every sequence keeps a token of its own).
    Read on the host: the learner builds its rows there."""
    tokens = ids.detach().cpu().numpy()
    cu = np.asarray(host_boundaries(cu_seqlens), dtype=np.int64)  # the values the check read
    seqs = [tokens[a:b] for a, b in zip(cu[:-1], cu[1:])]
    runs = _best_runs(seqs, min_shared)
    if all(p == 0 for _, _, p in runs):
        return None
    tree_ids, positions = [], []
    to_tree = np.empty(len(tokens), dtype=np.int64)
    longest = max(len(s) for s in seqs)
    index = np.zeros((len(seqs), longest), dtype=np.int64)
    owned = np.zeros((len(seqs), longest), dtype=bool)
    size = 0
    for first, end, shared in runs:
        prefix = np.arange(size, size + shared)
        tree_ids.append(seqs[first][:shared])
        positions.append(np.arange(shared))
        size += shared
        for n in range(first, end):
            rest = len(seqs[n]) - shared
            own = np.arange(size, size + rest)
            tree_ids.append(seqs[n][shared:])
            positions.append(np.arange(shared, len(seqs[n])))
            size += rest
            where = np.concatenate([prefix, own])
            to_tree[cu[n]:cu[n + 1]] = where
            index[n, :len(where)] = where
            owned[n, :len(where)] = True
            if n != first:
                owned[n, :shared] = False  # the run's first sequence gives the prefix its output
    as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(ids.device)  # noqa: E731
    return PrefixTree(as_long(np.concatenate(tree_ids)).long(), as_long(np.concatenate(positions)),
                      as_long(to_tree), torch.from_numpy(index), torch.from_numpy(owned))


def _best_runs(seqs: list[np.ndarray], min_shared: int) -> list[tuple[int, int, int]]:
    """The runs of neighbouring sequences (first, end, shared length) that save the most tokens, each
    run's sequences held after one copy of their common prefix: (end - first - 1) * shared saved. Runs
    are chosen together (dynamic programming over where they end): GRPO groups behind one system
    prompt must each keep their whole prompt, not share only the system prompt as one long run."""
    n = len(seqs)
    neighbours = [_common_prefix(seqs[k], seqs[k + 1]) for k in range(n - 1)]
    saved = [0] * (n + 1)  # saved[j]: the most the first j sequences can save
    last: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # last[j]: (start, shared length) of that choice's last run
    for j in range(1, n + 1):
        saved[j], last[j] = saved[j - 1], (j - 1, 0)
        shared = len(seqs[j - 1]) - 1  # every sequence keeps a token of its own
        for i in range(j - 2, -1, -1):
            shared = min(shared, neighbours[i], len(seqs[i]) - 1)
            if shared < min_shared:
                break
            if saved[i] + (j - 1 - i) * shared > saved[j]:
                saved[j], last[j] = saved[i] + (j - 1 - i) * shared, (i, shared)
    runs, j = [], n
    while j > 0:
        i, shared = last[j]
        runs.append((i, j, shared))
        j = i
    return runs[::-1]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


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
