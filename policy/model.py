"""HybridForCausalLM: KDA + gated MLA/DSA decoder with Block AttnRes and (Latent)MoE, NoPE.

State-dict names match the HF `kimi_linear` text model (model.embed_tokens, model.layers.N.*,
model.norm, lm_head); the K3 additions are layers.N.{self_attention,mlp}_res_{norm,proj} and
model.output_attn_res_{norm,proj}. checkpoint.py adds the `language_model.` prefix of kimi_k3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kimi_kernels.logprobs import linear_token_logprobs
from kimi_kernels.varlen import check_cu_seqlens, segment_starts

from .cache import ModelCache
from .config import ModelConfig, get_config
from .dtypes import keep_fp32
from .layers.attnres import attn_res_mix
from .layers.kda import KDAMixer
from .layers.mla import MLAMixer
from .layers.moe import GatedMLP, LatentMoE
from .layers.norms import RMSNorm


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # [B, T, vocab] float32 (float64 for a float64 model); None with token logprobs
    cache: ModelCache | None = None
    routing: torch.Tensor | None = None  # [B, T, n_moe_layers, top_k] long
    indexer_loss: torch.Tensor | None = None  # DSA indexer KL (when requested)
    token_logprobs: torch.Tensor | None = None  # [B, T] log p(input_ids[:, t] | < t); 0 at t = 0
    token_entropy: torch.Tensor | None = None  # [B, T] entropy of that prediction (no grad); 0 at t = 0


class LMHead(nn.Linear):
    """The untied output projection (`lm_head.weight`). Called with targets it returns their
    log-probabilities and the entropies without building the logits (kimi_kernels/logprobs.py);
    a call, not a weight read from outside, so a sharded engine gathers the weight for it."""

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None,
                scale: float = 1.0) -> Any:
        if targets is None:
            logits = super().forward(h)
            logits = logits if logits.dtype == torch.float64 else logits.float()
            return logits if scale == 1.0 else logits * scale
        return linear_token_logprobs(h, self.weight, targets, scale)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx, self.kind = idx, cfg.layer_types[idx]
        self.attn_res = cfg.attn_res
        if self.attn_res:
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn: KDAMixer | MLAMixer = (
            KDAMixer(cfg, idx) if self.kind == "kda" else MLAMixer(cfg, idx, sparse=self.kind == "dsa"))
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.is_moe = cfg.is_moe(idx)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = GatedMLP(d, cfg.intermediate_size, cfg)

    def mix(self, x: torch.Tensor, cache: Any, use_cache: bool, want_idx_loss: bool,
            token_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
        """Attention sublayer: (output, new layer cache or None, DSA indexer loss or None)."""
        if self.kind == "kda":
            y, c = self.self_attn(x, cache, use_cache, token_mask, cu_seqlens)
            return y, c, None
        return self.self_attn(x, cache, use_cache, want_idx_loss, token_mask, cu_seqlens)

    def ffn(self, x: torch.Tensor, routing: torch.Tensor | None, token_mask: torch.Tensor | None,
            record: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FFN sublayer: (output, chosen experts [B, T, k] or None for a dense layer). `record`:
        whether a training forward adds to the MoE balancing statistics."""
        if self.is_moe:
            return self.block_sparse_moe(x, routing, token_mask, record)
        return self.mlp(x), None

    def step(self, stream: "_Residual", dt: torch.dtype, cache: Any, use_cache: bool, want_idx_loss: bool,
             routing: torch.Tensor | None, token_mask: torch.Tensor | None, record: bool = True,
             cu_seqlens: torch.Tensor | None = None,
             ) -> tuple["_Residual", Any, torch.Tensor | None, torch.Tensor | None]:
        """The whole layer on a copy of the residual stream (`stream` is left as it was, so that a
        recomputation in backward starts from the same state), sublayers in dtype `dt`: (stream after
        this layer, new layer cache or None, DSA indexer loss or None, chosen experts or None)."""
        stream = stream.copy()
        a, c, il = self.mix(self.input_layernorm(stream.attn_input(self)).to(dt), cache, use_cache,
                            want_idx_loss, token_mask, cu_seqlens)
        h = stream.add_attn(self, a)
        m, idx = self.ffn(self.post_attention_layernorm(h).to(dt), routing, token_mask, record)
        stream.add_ffn(m)
        return stream, c, il, idx

    def checkpointed_step(self, stream: "_Residual", dt: torch.dtype, want_idx_loss: bool,
                          routing: torch.Tensor | None, token_mask: torch.Tensor | None,
                          cu_seqlens: torch.Tensor | None = None,
                          ) -> tuple["_Residual", Any, torch.Tensor | None, torch.Tensor | None]:
        """`step` whose activations are recomputed in backward instead of stored. The recomputation
        replays the experts the first pass chose (the same routes even where the scores tie) and
        adds nothing to the MoE statistics (each token is counted once, as without checkpointing)."""
        first: list[torch.Tensor | None] = []

        def run(stream: _Residual) -> tuple[_Residual, Any, torch.Tensor | None, torch.Tensor | None]:
            if first:  # the recomputation during backward
                return self.step(stream, dt, None, False, want_idx_loss, first[0], token_mask, record=False,
                                 cu_seqlens=cu_seqlens)
            out = self.step(stream, dt, None, False, want_idx_loss, routing, token_mask, cu_seqlens=cu_seqlens)
            first.append(out[3])
            return out

        return checkpoint(run, stream, use_reentrant=False)


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        if cfg.attn_res:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = HybridModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)  # untied
        self.moe_layer_ids = cfg.moe_layers
        # recompute each decoder layer in backward instead of storing its activations (training only)
        self.gradient_checkpointing = False
        self.data_parallel_group = None  # set_data_parallel: the ranks training this model together
        self.init_weights()

    # ---- init ----------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("_res_proj.weight"):
                nn.init.zeros_(p)  # AttnRes starts as the uniform mean of its sources
            elif name.endswith(("A_log", "dt_bias", "conv1d.weight", "sinks")) or p.dim() == 1:
                continue  # set by their modules (norm weights ones, gates fla-style, sinks 0)
            else:
                nn.init.normal_(p, mean=0.0, std=std)
        for layer in self.model.layers:
            if isinstance(layer.self_attn, KDAMixer):
                layer.self_attn.reset_gate_parameters()
        # residual-output projections scaled down with depth (GPT-2 style) for a stable start
        scale = 1.0 / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            writes_residual = name.endswith(("o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight",
                                             "routed_expert_up_proj.weight"))
            if writes_residual or (name.endswith("experts.w2") and self.config.routed_expert_hidden_size is None):
                p.mul_(scale)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None, use_cache: bool = False,
                routing: torch.Tensor | None = None, return_routing: bool = False,
                return_indexer_loss: bool = False, logits_to_keep: int = 0, return_token_logprobs: bool = False,
                logit_scale: float = 1.0, token_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, target_mask: torch.Tensor | None = None) -> CausalLMOutput:
        """Logits [B, T, vocab] float32, times `logit_scale` (1 / sampling temperature); only the
        last `logits_to_keep` positions when > 0: a prefill with a 160K vocab needs just the last
        row. `return_token_logprobs`: instead of logits, the log-probability and entropy of each
        input token's prediction, computed blockwise from the hidden states (what a learner
        needs, at a fraction of the memory).
        `token_mask` [B, T] bool marks real tokens of right-padded rows: padding never changes a
        cache (KDA state, conv window, MLA keys), never counts in MoE balancing statistics, and
        with logits_to_keep=1 the logits are each row's at its last real token.
        `routing` entries of -1 (a token whose experts were not recorded) route as usual.
        `cu_seqlens` [N+1]: input_ids [1, T] is a packed row of N sequences (kimi_kernels/varlen.py),
        a training forward: no sequence sees another (KDA state and short convs start from zero,
        attention within each), and each sequence's first token logprob is 0 like position 0's.
        `target_mask` [B, T] bool: the tokens a learner trains on; their logprobs are kept, the others'
        set to 0 (the head still runs on every row: a row count read from the data would stall a GPU).
        See docs/architecture.md."""
        cfg = self.config
        if return_token_logprobs and logits_to_keep:
            raise ValueError("forward: return_token_logprobs and logits_to_keep cannot be combined")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"forward: input_ids must be a LongTensor [B, T], got {shape}")
        B, T = input_ids.shape
        if T < 1:
            raise ValueError("forward: input_ids must hold at least one token (T >= 1)")
        if cache is not None:
            if not isinstance(cache, ModelCache) or len(cache) != cfg.num_hidden_layers:
                raise ValueError(f"forward: cache must be a ModelCache with {cfg.num_hidden_layers} layers")
            if cache.batch_size != B:
                raise ValueError(f"forward: cache has batch {cache.batch_size} but input_ids has {B} rows")
        n_moe, k = len(self.moe_layer_ids), cfg.num_experts_per_token
        if routing is not None:
            if tuple(routing.shape) != (B, T, n_moe, k):
                raise ValueError(f"forward: routing must be [B, T, n_moe_layers, top_k] = {(B, T, n_moe, k)}, "
                                 f"got {tuple(routing.shape)}")
            if n_moe and (int(routing.min()) < -1 or int(routing.max()) >= cfg.num_experts):
                raise ValueError(f"forward: routing holds expert ids outside [0, {cfg.num_experts}) (-1: not recorded)")
        if token_mask is not None and tuple(token_mask.shape) != (B, T):
            raise ValueError(f"forward: token_mask must be [B, T] = {(B, T)}, got {tuple(token_mask.shape)}")
        if token_mask is not None and logits_to_keep > 1:
            raise ValueError("forward: token_mask takes logits_to_keep 0 or 1 (each row's last real token)")
        if cu_seqlens is not None:
            if cache is not None or use_cache or logits_to_keep:
                raise ValueError("forward: a packed row (cu_seqlens) is a training forward: no cache, no logits_to_keep")
            check_cu_seqlens(cu_seqlens, B, T, "forward")

        dt = self.model.embed_tokens.weight.dtype  # sublayers run in the model dtype
        stream = _Residual.start(self.model.embed_tokens(input_ids), cfg)
        recompute = (self.gradient_checkpointing and self.training and torch.is_grad_enabled()
                     and cache is None and not use_cache)
        new_layers: list[Any] = []
        chosen: list[torch.Tensor] = []
        idx_losses: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            r = routing[:, :, len(chosen)] if (routing is not None and layer.is_moe) else None
            if recompute:
                stream, c, il, idx = layer.checkpointed_step(stream, dt, return_indexer_loss, r, token_mask, cu_seqlens)
            else:
                stream, c, il, idx = layer.step(stream, dt, None if cache is None else cache.layers[i], use_cache,
                                                return_indexer_loss, r, token_mask, cu_seqlens=cu_seqlens)
            new_layers.append(c)
            if il is not None:
                idx_losses.append(il)
            if idx is not None:
                chosen.append(idx)
        h = stream.output(self.model)
        real = None if token_mask is None else token_mask.sum(1)  # [B] real tokens per row
        if logits_to_keep == 1 and real is not None:
            h = h.gather(1, (real - 1).clamp_min(0).view(B, 1, 1).expand(B, 1, h.shape[-1]))
        elif logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        h = self.model.norm(h).to(dt)
        logits = token_logp = token_entropy = None
        if return_token_logprobs:
            logp, ent = self.lm_head(h[:, :-1].reshape(-1, h.shape[-1]), input_ids[:, 1:].reshape(-1), logit_scale)
            token_logp, token_entropy = (F.pad(x.reshape(B, T - 1), (1, 0)) for x in (logp, ent))
            if cu_seqlens is not None:  # a sequence's first token has no prediction of its own
                starts = segment_starts(cu_seqlens, T)[None]
                token_logp, token_entropy = token_logp.masked_fill(starts, 0.0), token_entropy.masked_fill(starts, 0.0)
            if target_mask is not None:
                off = ~target_mask.to(torch.bool)
                token_logp, token_entropy = token_logp.masked_fill(off, 0.0), token_entropy.masked_fill(off, 0.0)
        else:
            logits = self.lm_head(h, scale=logit_scale)

        out_cache = None
        if use_cache:
            past = cache.lengths if cache is not None else torch.zeros(B, dtype=torch.long, device=input_ids.device)
            out_cache = ModelCache(new_layers, past + (T if real is None else real))
        out_routing = None
        if return_routing:
            out_routing = (torch.stack(chosen, dim=2) if chosen
                           else torch.zeros(B, T, 0, k, dtype=torch.long, device=input_ids.device))
        idx_loss = torch.stack(idx_losses).mean() if idx_losses else None
        return CausalLMOutput(logits, out_cache, out_routing, idx_loss, token_logp, token_entropy)

    # ---- training hooks ------------------------------------------------------------------
    @torch.no_grad()
    def after_optimizer_step(self) -> dict[str, float]:
        """MoE bias balancing and QK-Clip; call after every optimizer.step(). Returns a few stats."""
        stats: dict[str, float] = {}
        clipped = 0
        for layer in self.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe.update_bias()
            if isinstance(layer.self_attn, MLAMixer):
                if self.config.qk_clip_tau is not None:
                    gamma = layer.self_attn.qk_clip(self.config.qk_clip_tau, self.data_parallel_group)
                    clipped += int((gamma < 1).sum())
                else:
                    layer.self_attn.qk_max.fill_(float("-inf"))
        stats["qk_clip_heads"] = float(clipped)
        return stats

    @torch.no_grad()
    def moe_statistics(self) -> dict[str, object]:
        """Since the last optimizer step (read before `after_optimizer_step` resets them): each MoE
        layer's share of routed real tokens per expert, and how often replayed routing agreed with
        the learner's own top-k choice."""
        load, agree, total = {}, 0.0, 0.0
        for i, layer in enumerate(self.model.layers):
            if layer.is_moe:
                moe = layer.block_sparse_moe
                load[i] = (moe.load / moe.load.sum().clamp_min(1.0)).tolist()
                agree += float(moe.replay_agree)
                total += float(moe.replay_total)
        return {"load": load, "routing_agreement": agree / total if total else None}

    def set_activation_checkpointing(self, on: bool) -> None:
        """Training forwards with grad recompute each decoder layer in backward instead of storing
        its activations: less memory for about one more forward of compute."""
        self.gradient_checkpointing = on

    def shard_experts(self, group: "torch.distributed.ProcessGroup") -> None:
        """Expert parallelism over `group`: each MoE layer keeps only this rank's routed experts
        (LatentMoE.shard_experts). Every rank builds the same model first, then shards it."""
        for layer in self.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe.shard_experts(group)

    def set_data_parallel(self, group: "torch.distributed.ProcessGroup") -> None:
        """Training on several ranks, each on its own rows: the statistics that move weights outside
        the optimizer (MoE load for the balancing bias, QK-Clip's largest logit) are combined over
        `group`, so every replica takes the same update."""
        self.data_parallel_group = group
        for layer in self.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe.stats_group = group

    def routed_expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of every MoE layer's stacked routed experts: what shard_experts splits."""
        return [(f"model.layers.{i}.block_sparse_moe.experts.{w}", getattr(layer.block_sparse_moe.experts, w))
                for i, layer in enumerate(self.model.layers) if layer.is_moe for w in ("w1", "w2", "w3")]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict with every routed expert. On an expert-parallel model each sharded layer's
        experts are gathered onto the first rank of its group: a collective, every rank calls it; only
        that rank's result is whole."""
        state = {k: v.detach() for k, v in self.state_dict().items()}
        for i, layer in enumerate(self.model.layers):
            if layer.is_moe and layer.block_sparse_moe.ep_group is not None:
                for w, t in layer.block_sparse_moe.gathered_experts().items():
                    state[f"model.layers.{i}.block_sparse_moe.experts.{w}"] = t
        return state

    def set_dsa_stage(self, stage: str) -> None:
        """'warmup': dense attention, only the indexer learns (KL to it); 'sparse': top-k attention."""
        if stage not in ("warmup", "sparse"):
            raise ValueError(f"set_dsa_stage: stage must be 'warmup' or 'sparse', got {stage!r}")
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MLAMixer) and layer.self_attn.sparse:
                layer.self_attn.dsa_stage = stage

    # ---- conveniences --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def num_parameters(self) -> dict[str, int]:
        from .params import count_parameters

        return count_parameters(self)


class _Residual:
    """The residual path: plain pre-norm sums, or Block AttnRes.

    AttnRes sources are the embedding, the completed blocks and the running partial block sum,
    all float32; a layer with layer_idx % block_size == 0 closes the running partial into a block.
    Each sublayer input is a learned softmax mix of the sources (layers/attnres.py)."""

    def __init__(self, on: bool, block: int, eps: float, h: torch.Tensor, blocks: list[torch.Tensor],
                 partial: torch.Tensor | None) -> None:
        self.on, self.block, self.eps = on, block, eps
        self.h, self.blocks, self.partial = h, blocks, partial

    @classmethod
    def start(cls, x: torch.Tensor, cfg: ModelConfig) -> "_Residual":
        """The stream at the embedding x (plain sums keep no AttnRes sources)."""
        return cls(cfg.attn_res, cfg.attn_res_block_size, cfg.rms_norm_eps, x, [x.float()] if cfg.attn_res else [], None)

    def copy(self) -> "_Residual":
        """The same tensors in new containers: updating the copy leaves this one as it is. (Built
        field by field, not with copy.copy, which torch.compile cannot trace: a compiled decode step
        would fall back to eager for every layer.)"""
        return _Residual(self.on, self.block, self.eps, self.h, list(self.blocks), self.partial)

    def _sources(self) -> list[torch.Tensor]:
        return self.blocks if self.partial is None else self.blocks + [self.partial]

    def attn_input(self, layer: DecoderLayer) -> torch.Tensor:
        if not self.on:
            return self.h
        if layer.layer_idx > 0 and layer.layer_idx % self.block == 0 and self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None
        return attn_res_mix(self._sources(), layer.self_attention_res_norm.weight,
                            layer.self_attention_res_proj.weight, self.eps)

    def add_attn(self, layer: DecoderLayer, a: torch.Tensor) -> torch.Tensor:
        """Adds the attention output; returns the FFN sublayer's input."""
        if not self.on:
            self.h = self.h + a
            return self.h
        self.partial = a.float() if self.partial is None else self.partial + a.float()
        return attn_res_mix(self._sources(), layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, self.eps)

    def add_ffn(self, m: torch.Tensor) -> None:
        if self.on:
            self.partial = self.partial + m.float()
        else:
            self.h = self.h + m

    def output(self, model: HybridModel) -> torch.Tensor:
        if not self.on:
            return self.h
        return attn_res_mix(self._sources(), model.output_attn_res_norm.weight,
                            model.output_attn_res_proj.weight, self.eps)


def build_model(config: str | ModelConfig = "toy", device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, **overrides: Any) -> HybridForCausalLM:
    """A model from a preset name or a ModelConfig, with config overrides (e.g. vocab_size=...).
    device="meta" builds without memory (parameter counting of the large presets)."""
    cfg = get_config(config, **overrides)
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            model = HybridForCausalLM(cfg)
    else:
        model = HybridForCausalLM(cfg)
        if device is not None:
            model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
        keep_fp32(model)
    return model
