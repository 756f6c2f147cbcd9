"""Gated MLA (NoPE) with a latent KV cache, and gated DSA (MLA + lightning indexer top-k).

Parameter names follow the HF `kimi_k3` / `kimi_linear` checkpoints (self_attn.*):
q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a_proj_with_mqa (kv_lora + rope dims),
kv_a_layernorm, kv_b_proj, g_proj (output gate), o_proj; DSA adds indexer.{wq_b, wk, k_norm,
weights_proj} (DeepSeek-V3.2 names). `qk_rope_head_dim` keeps the checkpoint layout of a key part
shared by all heads, but nothing is rotated (NoPE), so positions never enter the math.

DSA: the indexer's top-k becomes a key mask on the gated NoPE MLA (how K3.1 composes the two is
UNVERIFIED; this is the DeepSeek-V3.2 composition). Ties in the indexer score go to the earlier
key. Stage "warmup" attends densely and only trains the indexer (KL to the summed head
attention); stage "sparse" applies the mask and restricts the KL to the selected keys.

The latent norms use eps 1e-6 (as the HF Kimi Linear code does), the rest cfg.rms_norm_eps.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from kimi_kernels.attention import attention
from kimi_kernels.fusion import fused_on_cuda
from kimi_kernels.mla_decode import mla_decode, mla_decode_paged, mla_decode_supported
from kimi_kernels.ops import masked_logit_max, topk_mask
from kimi_kernels.varlen import check_cu_seqlens, repad_buckets, repad_index, to_packed, to_padded

from ..cache import MLACache, PagedMLAKeys
from ..config import ModelConfig
from .norms import RMSNorm

_LATENT_EPS = 1e-6
_INDEX_HEAD_CHUNK = 8
_QK_STAT_CHUNK = 1024
# KIMI_MLA_DECODE_KERNEL=0 keeps absorbed decode steps on the fp32 reference (benchmarks compare the two)
_DECODE_KERNEL = os.environ.get("KIMI_MLA_DECODE_KERNEL", "1") != "0"
# KIMI_MLA_PAGED_KEYS=0 gathers a paged cache's keys before the decode kernel (benchmarks compare the two)
_PAGED_KEYS = os.environ.get("KIMI_MLA_PAGED_KEYS", "1") != "0"


def set_decode_kernel(enabled: bool) -> bool:
    """Absorbed decode steps through kimi_kernels/mla_decode.py (True) or the fp32 reference attention;
    returns the previous setting."""
    global _DECODE_KERNEL
    prev, _DECODE_KERNEL = _DECODE_KERNEL, bool(enabled)
    return prev


def set_paged_keys(enabled: bool) -> bool:
    """The decode kernel reads a paged cache's keys in place (True) or gathered into [B, S] first;
    returns the previous setting."""
    global _PAGED_KEYS
    prev, _PAGED_KEYS = _PAGED_KEYS, bool(enabled)
    return prev


class LightningIndexer(nn.Module):
    """I[t, s] = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s]), w = W_w x * H_I^-0.5 * d_I^-0.5."""

    def __init__(self, cfg: ModelConfig, q_in_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(q_in_dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_norm(self.wk(x))  # [B, T, d_I]

    def scores(self, x: torch.Tensor, q_in: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # in the model's dtype (bf16 on GPU: tensor cores; DeepSeek-V3.2 runs its indexer in FP8)
        q = self.wq_b(q_in).reshape(B, T, self.n_heads, self.head_dim)
        w = self.weights_proj(x).float() * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        kt = keys.to(q.dtype).transpose(1, 2)  # [B, d_I, S]
        out = None
        # a few heads at a time: never hold [B, T, H_I, S] (17 GB for K3.1's 64 heads at 8K)
        for h0 in range(0, self.n_heads, _INDEX_HEAD_CHUNK):
            h1 = min(h0 + _INDEX_HEAD_CHUNK, self.n_heads)
            part = _weighted_relu_scores(q[:, :, h0:h1], kt, w[:, :, h0:h1])
            out = part if out is None else out + part
        return out  # [B, T, S]


@fused_on_cuda  # on CUDA the ReLU, weighting and head sum read the GEMM's output once
def _weighted_relu_scores(q: torch.Tensor, kt: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_h w[b, t, h] * ReLU(q[b, t, h] . kt[b, :, s]): q [B, T, h, d], kt [B, d, S], w [B, T, h]
    float32. Returns [B, T, S] float32."""
    dots = torch.relu(torch.einsum("bthd,bds->bhts", q, kt))  # head-major: the sum is over whole planes
    return (dots.float() * w.transpose(1, 2)[..., None]).sum(1)


def _kl_to_indexer(p: torch.Tensor, logits: torch.Tensor, allowed: torch.Tensor,
                   queries: torch.Tensor | None) -> torch.Tensor:
    """Mean over queries (those marked in `queries` [B, T], all when None: padding teaches the
    indexer nothing) of KL(p || softmax(logits)) restricted to `allowed` keys (p renormalised)."""
    p = torch.where(allowed, p, torch.zeros_like(p))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
    logq = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    term = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - logq), torch.zeros_like(p)).sum(-1)
    return term.mean() if queries is None else term[queries].sum() / queries.sum().clamp_min(1)


class MLAMixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, sparse: bool = False) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.layer_idx = layer_idx
        self.H, self.nope, self.rope, self.vd = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                                                 cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.kv_lora, self.q_lora = cfg.kv_lora_rank, cfg.q_lora_rank
        self.qk = self.nope + self.rope
        self.scale = self.qk ** -0.5
        if self.q_lora is None:
            self.q_proj = nn.Linear(d, self.H * self.qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora, eps=_LATENT_EPS)
            self.q_b_proj = nn.Linear(self.q_lora, self.H * self.qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps=_LATENT_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.H * (self.nope + self.vd), bias=False)
        self.output_gate = cfg.mla_use_output_gate
        if self.output_gate:
            self.g_proj = nn.Linear(d, self.H * self.vd, bias=False)
        self.o_proj = nn.Linear(self.H * self.vd, d, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.H)) if cfg.attention_sink else None
        self.sparse = sparse
        self.indexer = LightningIndexer(cfg, self.q_lora or d) if sparse else None
        # "warmup": dense attention, indexer fit to it; "sparse": top-k selection is used
        self.dsa_stage = "sparse"
        self.register_buffer("qk_max", torch.full((self.H,), float("-inf")), persistent=False)

    # ---- pieces --------------------------------------------------------------------------
    def _query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (q [B, T, H, qk], indexer query input)."""
        B, T, _ = x.shape
        if self.q_lora is None:
            return self.q_proj(x).reshape(B, T, self.H, self.qk), x
        lat = self.q_a_layernorm(self.q_a_proj(x))
        return self.q_b_proj(lat).reshape(B, T, self.H, self.qk), lat

    def _new_latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        return self.kv_a_layernorm(latent), k_rope

    def empty_cache(self, batch: int, device: torch.device, dtype: torch.dtype) -> MLACache:
        ik = torch.zeros(batch, 0, self.indexer.head_dim, device=device, dtype=dtype) if self.sparse else None
        return MLACache(torch.zeros(batch, 0, self.kv_lora, device=device, dtype=dtype),
                        torch.zeros(batch, 0, self.rope, device=device, dtype=dtype),
                        torch.zeros(batch, 0, dtype=torch.bool, device=device), ik)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cache: MLACache | None = None, use_cache: bool = False,
                indexer_loss: bool = False, token_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, MLACache | None, torch.Tensor | None]:
        """token_mask [B, T] bool (right padding): padded tokens enter the cache as invalid keys.
        cu_seqlens: a packed row of sequences (kimi_kernels/varlen.py), run as batches of its
        sequences right-padded, like lengths together (each sees only its own keys; the attention's
        cost is about the sum of their squares, not the packed row's square)."""
        if cu_seqlens is not None:
            return self._forward_packed(x, indexer_loss, token_mask, cu_seqlens)
        B, T, _ = x.shape
        q, q_in = self._query(x)
        latent, k_rope = self._new_latents(x)
        idx_k = self.indexer.keys(x.detach()) if self.sparse else None
        if cache is None:
            cache = self.empty_cache(B, x.device, latent.dtype)
        full = cache.append(latent, k_rope, idx_k, valid=token_mask)
        S, past = full.seq_len, cache.seq_len

        # decode steps attend in the latent space (weights absorbed into q and the output) when
        # that is cheaper than expanding K and V for every cached token
        absorb = (not self.training and not indexer_loss and past > 0
                  and T * (2 * self.kv_lora + self.rope) < (self.nope + self.vd) * self.kv_lora)
        k = v = None
        if not absorb:
            kv = self.kv_b_proj(full.latent).reshape(B, S, self.H, self.nope + self.vd)
            k_nope, v = kv.split([self.nope, self.vd], dim=-1)  # one node in backward, not two zero-filled slices summed
            k = torch.cat([k_nope, full.k_rope.unsqueeze(2).expand(B, S, self.H, self.rope)], -1)

        # key j is visible to new token t when it holds a real token and is not in t's future
        j = torch.arange(S, device=x.device)
        t = torch.arange(T, device=x.device)
        allowed = full.valid[:, None, :] & (j[None, :] <= past + t[:, None])[None]  # [B, T, S]
        visible, selected = allowed, None  # selected: the DSA top-k keys, when they apply
        idx_scores = None
        if self.sparse and (self.dsa_stage == "sparse" or indexer_loss):
            idx_scores = self.indexer.scores(x.detach(), q_in.detach(), full.index_k)
            if self.dsa_stage == "sparse" and self.indexer.topk < S:
                # ties (ReLU zeros are common) go to the earlier key, so the choice depends only on
                # the order of real keys, not on gaps from batched caches
                masked = idx_scores.masked_fill(~allowed, float("-inf"))
                selected = topk_mask(masked, self.indexer.topk)
                visible = allowed & selected

        if absorb:
            o = self._attend_absorbed(q, full, selected)
        else:
            # a fresh cache holds only this call's tokens, all real: no key mask, so the plain causal
            # case reaches the flash kernel without checking the mask on the host (a sync)
            o = attention(q, k, v, scale=self.scale, causal=True, key_mask=None if past == 0 else full.valid,
                          mask=selected, sink=self.sinks)  # [B, T, H, vd]
        if self.output_gate:
            o = o * torch.sigmoid(self.g_proj(x).float()).reshape(B, T, self.H, self.vd).to(o.dtype)
        y = self.o_proj(o.reshape(B, T, self.H * self.vd))

        if self.training:
            self._track_qk_max(q, k, visible, past)
        loss = None
        if indexer_loss and idx_scores is not None:
            logits = torch.einsum("bthd,bshd->bhts", q.detach().float(), k.detach().float()) * self.scale
            p = torch.softmax(logits.masked_fill(~visible[:, None], float("-inf")), dim=-1).sum(1)
            loss = _kl_to_indexer(p, idx_scores, visible, token_mask)  # heads summed; L1-normalised in the KL
        return y, (full if use_cache else None), loss

    def _forward_packed(self, x: torch.Tensor, indexer_loss: bool, token_mask: torch.Tensor | None,
                        cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        """The row's sequences re-padded into buckets of like lengths (kimi_kernels/varlen.py), each run
        as a padded batch; the indexer loss is the mean over every bucket's real queries."""
        check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], "MLA")
        y = x.new_zeros(x.shape[1], self.o_proj.out_features)
        loss_sum, queries = None, None
        for bucket in repad_buckets(*repad_index(cu_seqlens), cu_seqlens):
            counted = bucket.real if token_mask is None else bucket.real & to_padded(token_mask, bucket.index)
            y_b, _, loss_b = self.forward(to_padded(x, bucket.index), None, False, indexer_loss, counted)
            y = to_packed(y_b, bucket, y)
            if loss_b is not None:  # counts stay on the device: a host read would drain the GPU's queue
                n = counted.sum()
                loss_sum = loss_b * n if loss_sum is None else loss_sum + loss_b * n
                queries = n if queries is None else queries + n
        loss = None if loss_sum is None else loss_sum / queries.clamp(min=1)
        return y.unsqueeze(0), None, loss

    @torch.no_grad()
    def _track_qk_max(self, q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, past: int) -> None:
        """QK-Clip statistic: the largest scaled logit per head, a block of queries at a time
        (the fused attention does not expose its logits; a full [B, H, T, S] fp32 copy would cost
        more memory than the attention itself). A block's queries see no key past the last one's
        position, so the later keys are left out of its product."""
        T = q.shape[1]
        for t0 in range(0, T, _QK_STAT_CHUNK):
            t1 = min(t0 + _QK_STAT_CHUNK, T)
            horizon = past + t1  # keys beyond it are in the future of every query of the block
            m = masked_logit_max(q[:, t0:t1], k[:, :horizon], visible[:, t0:t1, :horizon], self.scale)
            self.qk_max.copy_(torch.maximum(self.qk_max, m))

    def _attend_absorbed(self, q: torch.Tensor, full: MLACache, selected: torch.Tensor | None) -> torch.Tensor:
        """Attention with W_UK folded into the query and W_UV applied after: one shared latent
        key/value head (MQA over [latent, k_rope]). Same result as expanding K and V."""
        w = self.kv_b_proj.weight.view(self.H, self.nope + self.vd, self.kv_lora)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        q_lat = torch.einsum("bthn,hnl->bthl", q[..., :self.nope], w_uk)
        q_abs = torch.cat([q_lat, q[..., self.nope:]], -1)  # [B, T, H, L + R]
        kernel = self._decode_kernel(q_abs, full) if q.shape[1] == 1 else None
        if kernel is not None:
            keys = full.valid if selected is None else full.valid & selected[:, 0]
            if kernel == "paged":  # the keys where the paged cache keeps them, never gathered
                ctx = mla_decode_paged(q_abs[:, 0], full.pool_latent, full.pool_rope, full.index, keys, self.scale)
            else:
                ctx = mla_decode(q_abs[:, 0], full.latent, full.k_rope, keys, self.scale)
            return torch.einsum("bthl,hvl->bthv", ctx.unsqueeze(1), w_uv)
        k_abs = torch.cat([full.latent, full.k_rope], -1).unsqueeze(2)  # [B, S, 1, L + R]
        ctx = attention(q_abs, k_abs, full.latent.unsqueeze(2), scale=self.scale, causal=True,
                        key_mask=full.valid, mask=selected, sink=self.sinks)  # [B, T, H, L]
        return torch.einsum("bthl,hvl->bthv", ctx, w_uv)

    def _decode_kernel(self, q_abs: torch.Tensor, full: MLACache | PagedMLAKeys) -> str | None:
        """Which of kimi_kernels/mla_decode.py's ops takes a query token per row, if one does: where
        Triton runs, without sinks (the kernel has none) or a gradient (nor a backward), unless turned
        off. "paged": paged keys whose pools hold q's dtype; "gathered": keys in [B, S] layout."""
        if not (_DECODE_KERNEL and self.sinks is None and not (torch.is_grad_enabled() and q_abs.requires_grad)):
            return None
        if _PAGED_KEYS and isinstance(full, PagedMLAKeys) and mla_decode_supported(q_abs, full.pool_latent,
                                                                                    full.pool_rope):
            return "paged"
        return "gathered" if mla_decode_supported(q_abs, full.latent, full.k_rope) else None

    # ---- QK-Clip ---------------------------------------------------------------------------
    @torch.no_grad()
    def qk_clip(self, tau: float, group: "dist.ProcessGroup | None" = None) -> torch.Tensor:
        """Rescale this layer's head-specific q/k weights so the largest logit seen drops to tau.
        q^C and k^C (nope parts) by sqrt(gamma), q^R (the part meeting the shared key) by gamma.
        With `group` (data-parallel ranks), the largest logit over all of them: every replica
        rescales alike. Returns gamma per head and resets the statistic."""
        if group is not None:
            dist.all_reduce(self.qk_max, op=dist.ReduceOp.MAX, group=group)
        gamma = torch.clamp(tau / self.qk_max.clamp_min(1e-30), max=1.0)
        gamma = torch.where(torch.isfinite(self.qk_max), gamma, torch.ones_like(gamma))
        if bool((gamma < 1).any()):
            qw = self.q_proj.weight if self.q_lora is None else self.q_b_proj.weight
            qw = qw.view(self.H, self.qk, -1)
            qw[:, :self.nope] *= gamma.sqrt().to(qw.dtype)[:, None, None]
            qw[:, self.nope:] *= gamma.to(qw.dtype)[:, None, None]
            kw = self.kv_b_proj.weight.view(self.H, self.nope + self.vd, -1)
            kw[:, :self.nope] *= gamma.sqrt().to(kw.dtype)[:, None, None]
        self.qk_max.fill_(float("-inf"))
        return gamma
