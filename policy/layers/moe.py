"""Dense gated MLP and Stable LatentMoE.

    scores = sigmoid(router(x))                       router on the full-dim x, float32
    idx    = topk(scores + e_bias)                    the bias changes selection only
    w      = renorm(scores[idx]) * routed_scaling
    z      = W_down x             (d -> l)            experts live in the latent dim
    out    = W_up(RMSNorm_l(sum_e w_e Expert_e(z))) + SharedExperts(x)

Names follow the HF `kimi_k3` checkpoints (block_sparse_moe.*): gate.weight,
gate.e_score_correction_bias, routed_expert_down_proj, routed_expert_norm, routed_expert_up_proj,
shared_experts.{gate,up,down}_proj. Routed experts are stored stacked (experts.w1 [E, I, l],
experts.w2 [E, l, I], experts.w3 [E, I, l]); checkpoint.py splits them into experts.{j}.w{1,2,3}.

Balancing without an auxiliary loss (after each optimizer step, no gradient):
  "bias":     e_bias += rate * sign(mean_load - load_e)
  "quantile": c_j = the (q+1)-th largest of s_ij + b_j - alpha_i over tokens, alpha_i = the
              (k+1)-th largest biased score of token i, q = kT/n; e_bias -= rate_q * mean(c_j).
              (Third-party description of K3's Quantile Balancing, UNVERIFIED; rate_q = 0.5 here.)
"""
from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kimi_kernels.expert_rows import row_of_pair, token_sums, weighted_token_sums, weighted_token_sums_backward
from kimi_kernels.grouped_experts import experts_small_m, small_m_block
from kimi_kernels.triton_support import runs_triton

from ..config import ModelConfig
from ._ops import ONE_GEMM_MIN_ROWS, glu
from .moe_parallel import expert_parallel
from .norms import RMSNorm

_QUANTILE_EMA = 0.5
# KIMI_MOE_GROUPED_MM=0 turns the grouped GEMM off (benchmarks time the per-expert loop with it)
_GROUPED_MM = os.environ.get("KIMI_MOE_GROUPED_MM", "1") != "0"
# KIMI_MOE_SMALL_M=0 keeps decode batches on the grouped GEMM too (benchmarks compare the two)
_SMALL_M = os.environ.get("KIMI_MOE_SMALL_M", "1") != "0"


def set_small_m(enabled: bool) -> bool:
    """Route decode batches' experts to the small-M kernels (True) or CUTLASS's grouped GEMM;
    returns the previous setting."""
    global _SMALL_M
    prev, _SMALL_M = _SMALL_M, bool(enabled)
    return prev


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with SwiGLU or SiTU-GLU."""

    def __init__(self, dim: int, hidden: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < ONE_GEMM_MIN_ROWS * x.shape[-1]:  # decoding: copying the weights would cost more
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:  # one GEMM on the stacked weights: one pass over x, and x's gradient one GEMM, not two and a sum
            gate, up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight])).chunk(2, dim=-1)
        return self.down_proj(glu(gate, up, *self.act))


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x.float() @ self.weight.float().t())  # [N, E]


class _WeightedTokenSums(torch.autograd.Function):
    """Each token's k expert output rows gathered, weighted and summed (kimi_kernels/expert_rows.py),
    its gradient gathers too: autograd's gradient of indexing out by pair_rows would scatter with an
    accumulating index_put, not knowing it is a permutation."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, w: torch.Tensor, pair_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(out, w, pair_rows)
        return weighted_token_sums(out, w, pair_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        out, w, pair_rows = ctx.saved_tensors
        grad_out, grad_w = weighted_token_sums_backward(grad, out, w, pair_rows)
        return grad_out, grad_w, None


class StackedExperts(nn.Module):
    def __init__(self, n: int, dim: int, hidden: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))  # down
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))  # up
        self.act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def forward(self, z: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
                ep_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """z: [N, dim]; w, idx: [N, k] routing weights and experts. Returns sum_e w_e Expert_e(z),
        [N, dim] in the experts' dtype (summed in float32). With `ep_group` this rank holds only its
        slice of the experts and the token rows travel to the ranks that hold theirs (moe_parallel.py)."""
        flat_e = idx.reshape(-1)
        order = expert_order(flat_e)
        pair_rows = row_of_pair(order)  # where each (token, choice) lies in expert order
        zs = rows_by_expert(z, order, pair_rows, idx.shape[1])
        if ep_group is None:
            out = self.grouped(zs, expert_counts(flat_e, self.w1.shape[0]), capacity=len(z))
        else:
            n_experts = self.w1.shape[0] * dist.get_world_size(ep_group)
            out = expert_parallel(self.grouped, zs, expert_counts(flat_e, n_experts), ep_group)
        # each token's k output rows gathered, weighted and summed (no atomics, unlike adding each row
        # into its token's sum; the gradient is a gather too)
        return _WeightedTokenSums.apply(out, w, pair_rows)

    def grouped(self, zs: torch.Tensor, counts: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
        """zs: [M, dim] rows sorted by expert, counts[e] of them for expert e -> Expert_e(row),
        [M, dim]: one grouped GEMM per projection on CUDA, one GEMM per used expert elsewhere, or
        inside `fixed_capacity_experts()` batched products over `capacity` rows per expert (at most
        that many rows go to one expert: the tokens, each routed to an expert once; default M)."""
        if _grouped_mm_usable(zs, self.w1):
            offs = counts.cumsum(0).to(torch.int32)
            block_m = _small_m_block(zs, self.w1)
            if block_m is not None:  # a decode batch: the fused small-M kernels (kimi_kernels/grouped_experts.py)
                act, gate_cap, up_cap = self.act
                return experts_small_m(zs, torch.cat([offs.new_zeros(1), offs]), self.w1, self.w3, self.w2, block_m,
                                       act, float(gate_cap), float(up_cap))
            w1, w2, w3 = (_aligned(w) for w in (self.w1, self.w2, self.w3))
            gate = torch._grouped_mm(zs, w1.transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(zs, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(glu(gate, up, *self.act), w2.transpose(-2, -1), offs=offs)
        if _fixed_capacity.enabled:
            return self._fixed_capacity(zs, counts, zs.shape[0] if capacity is None else capacity)
        return self._per_expert(zs, counts)

    def _fixed_capacity(self, zs: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
        """The experts as three batched products over [E, capacity, dim]: every expert's rows in its
        own padded block. Shapes never depend on the counts (no host read), so a CUDA graph can
        hold it; the cost is E x capacity rows, for decoding batches."""
        E, M = counts.shape[0], zs.shape[0]
        expert = torch.repeat_interleave(torch.arange(E, device=zs.device), counts, output_size=M)
        pos = torch.arange(M, device=zs.device) - (counts.cumsum(0) - counts)[expert]
        blocks = zs.new_zeros(E, capacity, zs.shape[1]).index_put_((expert, pos), zs)
        h = glu(torch.bmm(blocks, self.w1.transpose(1, 2)), torch.bmm(blocks, self.w3.transpose(1, 2)), *self.act)
        return torch.bmm(h, self.w2.transpose(1, 2))[expert, pos]

    def _per_expert(self, zs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (zs.requires_grad or self.w1.requires_grad):
            return _per_expert_with_grad(zs, counts, self.w1, self.w3, self.w2, *self.act)
        # no gradient (a rollout engine's forward): an opaque op, so a compiled decode step stays one graph
        return experts_per_expert(zs, counts, self.w1, self.w3, self.w2, *self.act)


def _per_expert_loop(zs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                     act: str, gate_cap: float, up_cap: float) -> torch.Tensor:
    """One GEMM chain per used expert over its rows (zs sorted by expert, counts[e] rows each)."""
    parts = []
    # one split and one unbind per weight, not a slice or an index per expert: each of those would get a
    # zero-filled gradient the size of the whole, all of them summed (E of them per weight)
    for ze, g, u, dn in zip(zs.split(counts.tolist()), w1.unbind(0), w3.unbind(0), w2.unbind(0)):
        if len(ze):
            h = glu(ze @ g.t(), ze @ u.t(), act, gate_cap, up_cap)
            parts.append(h @ dn.t())
    return torch.cat(parts) if parts else zs.new_zeros(0, w2.shape[1])


# data-dependent sizes: left eager inside a compiled training forward
_per_expert_with_grad = torch.compiler.disable(_per_expert_loop)


@torch.library.custom_op("kimi::experts_per_expert", mutates_args=())
def experts_per_expert(zs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                       act: str, gate_cap: float, up_cap: float) -> torch.Tensor:
    """The per-expert loop as one op without gradient: its output shape [M, d] does not depend on
    the counts it reads, so torch.compile keeps it inside the graph instead of breaking around it."""
    return _per_expert_loop(zs, counts, w1, w3, w2, act, gate_cap, up_cap)


@experts_per_expert.register_fake
def _(zs, counts, w1, w3, w2, act, gate_cap, up_cap):
    return zs.new_empty(zs.shape[0], w2.shape[1])


class _FixedCapacity(threading.local):
    enabled = False


_fixed_capacity = _FixedCapacity()


@contextmanager
def fixed_capacity_experts() -> Iterator[None]:
    """Within it (this thread), routed experts that have no grouped GEMM (float32, or before sm90)
    run at a fixed capacity instead of one GEMM per used expert: what a CUDA graph can capture."""
    previous, _fixed_capacity.enabled = _fixed_capacity.enabled, True
    try:
        yield
    finally:
        _fixed_capacity.enabled = previous


RANKING_MAX_PAIRS = 2048  # token-expert pairs up to which expert_order ranks them by comparison


class _RowsByExpert(torch.autograd.Function):
    """z[order // k]: each token's row once per chosen expert, listed expert by expert. Its gradient
    gathers each token's k rows and sums them (kimi_kernels/expert_rows.py's token_sums), where
    autograd's gradient of the indexing scatters them with an accumulating index_put: on an H100 that
    and its sort were ~2.8 ms of a ~116 ms learner step (three MoE layers, the Kimi-Linear shape at 8K
    tokens)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, order: torch.Tensor, pair_rows: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(pair_rows)
        ctx.k = k
        return z.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (pair_rows,) = ctx.saved_tensors
        return token_sums(grad, pair_rows, ctx.k), None, None, None


def rows_by_expert(z: torch.Tensor, order: torch.Tensor, pair_rows: torch.Tensor, k: int) -> torch.Tensor:
    """z [N, d], order: expert_order of the N*k token-expert pairs, pair_rows: its inverse (row_of_pair)
    -> [N*k, d], pair order[i]'s token row."""
    return _RowsByExpert.apply(z, order, pair_rows, k)


def expert_order(expert_ids: torch.Tensor) -> torch.Tensor:
    """The permutation that lists token-expert pairs expert by expert, each expert's in their
    original order (a stable argsort). A decode batch's few hundred pairs are ranked by comparing
    every pair with every other (pair i's place: the pairs before it in (expert, position)
    order), in a handful of small kernels: a radix sort of them took ~27 us on an H200. On a CPU the
    sort wins at every size (64 pairs: 6 us vs 33; 2,048 pairs, a 1,024-token prefill at top-2: 32 us
    vs 29 ms for the quadratic ranking)."""
    m = expert_ids.numel()
    if m > RANKING_MAX_PAIRS or not expert_ids.is_cuda:
        return torch.argsort(expert_ids, stable=True)
    return expert_order_by_ranking(expert_ids)


def expert_order_by_ranking(expert_ids: torch.Tensor) -> torch.Tensor:
    """expert_order's CUDA path for a decode batch: every pair compared with every other."""
    m = expert_ids.numel()
    position = torch.arange(m, device=expert_ids.device)
    key = expert_ids * m + position  # distinct, ordered by (expert, position)
    place = (key[None, :] < key[:, None]).sum(1)
    return torch.empty_like(expert_ids).scatter_(0, place, position)


def expert_counts(expert_ids: torch.Tensor, n_experts: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens per expert (each counted with `weight`, default 1). Not torch.bincount: on CUDA it
    reads the largest id back to the host, a sync that stalls the launch queue at every MoE layer."""
    if weight is None:
        counts = torch.zeros(n_experts, dtype=torch.long, device=expert_ids.device)
        return counts.index_add_(0, expert_ids, torch.ones_like(expert_ids))
    counts = torch.zeros(n_experts, dtype=weight.dtype, device=expert_ids.device)
    return counts.index_add_(0, expert_ids, weight)


def _grouped_mm_usable(a: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm: CUDA (sm90+), bf16, dims a multiple of 16 (its alignment rule)."""
    return (_GROUPED_MM and a.is_cuda and a.dtype == w.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(a.device)[0] >= 9 and all(d % 16 == 0 for d in w.shape[1:]))


def _small_m_block(zs: torch.Tensor, w: torch.Tensor) -> int | None:
    """The row block of the small-M expert kernels for these rows, or None where they do not apply:
    turned off (KIMI_MOE_SMALL_M=0), without Triton, when a gradient is wanted (they have no
    backward), or where the busiest expert would get more rows than their largest block
    (prefill, batches past ~300 sequences at top-8 of 64: there CUTLASS's grouped GEMM is used)."""
    if not _SMALL_M or not runs_triton(zs):
        return None
    if torch.is_grad_enabled() and (zs.requires_grad or w.requires_grad):
        return None
    return small_m_block(zs.shape[0], w.shape[0])


def _aligned(w: torch.Tensor) -> torch.Tensor:
    """w, or a copy of it when its storage is not 16-byte aligned (grouped GEMM's rule): DeepSpeed's
    bf16 mode keeps parameters as views into one flat buffer. The copy passes gradients through.
    (Read from the storage offset, the allocator's blocks being aligned: torch.compile can trace it,
    not data_ptr.)"""
    return w if w.storage_offset() * w.element_size() % 16 == 0 else w.clone()


class LatentMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.n_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_token
        self.scaling, self.renorm = cfg.routed_scaling_factor, cfg.moe_renormalize
        self.balance, self.rate = cfg.balance, cfg.bias_update_rate
        self.latent = cfg.routed_expert_hidden_size
        self.gate = Router(d, self.n_experts)
        if self.latent is not None:
            self.routed_expert_down_proj = nn.Linear(d, self.latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(self.latent, d, bias=False)
            self.routed_expert_norm = RMSNorm(self.latent, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.experts = StackedExperts(self.n_experts, self.latent or d, cfg.moe_intermediate_size, cfg)
        self.shared_experts = (GatedMLP(d, cfg.moe_intermediate_size * cfg.num_shared_experts, cfg)
                               if cfg.num_shared_experts > 0 else None)
        # balancing statistics since the last optimizer step (not saved)
        self.register_buffer("load", torch.zeros(self.n_experts), persistent=False)
        self.register_buffer("quantile_shift", torch.zeros(self.n_experts), persistent=False)
        self.register_buffer("n_stat", torch.zeros(()), persistent=False)
        self.register_buffer("replay_agree", torch.zeros(()), persistent=False)
        self.register_buffer("replay_total", torch.zeros(()), persistent=False)
        self.ep_group: dist.ProcessGroup | None = None  # set by shard_experts
        # the ranks whose statistics are summed before the bias update (set_data_parallel); None: this rank's
        self.stats_group: dist.ProcessGroup | None = None

    def shard_experts(self, group: dist.ProcessGroup) -> None:
        """Keep only this rank's routed experts, [r*E/ep, (r+1)*E/ep) for rank r of `group` (size
        ep), and exchange tokens with the other ranks in every forward (moe_parallel.py). Call it
        on a model built the same way on every rank, before its optimizer is made. Unless
        set_data_parallel gave another group, the statistics are then summed over the default group
        (each rank of an expert-parallel job trains on its own tokens)."""
        if self.ep_group is not None:
            raise ValueError("shard_experts: this layer's experts are already sharded")
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        if self.n_experts % ep:
            raise ValueError(f"shard_experts: num_experts {self.n_experts} is not divisible by the group size {ep}")
        n = self.n_experts // ep
        for name in ("w1", "w2", "w3"):
            full = getattr(self.experts, name).detach()
            setattr(self.experts, name, nn.Parameter(full[rank * n:(rank + 1) * n].clone()))
        self.ep_group = group
        if self.stats_group is None:
            self.stats_group = dist.group.WORLD

    def gathered_experts(self) -> dict[str, torch.Tensor]:
        """{"w1" | "w2" | "w3": [E, ...]}: every routed expert, gathered from the ranks of the
        expert-parallel group onto its first rank (a collective: every rank of the group calls it;
        the others get only their own slice back)."""
        held = {name: getattr(self.experts, name).detach() for name in ("w1", "w2", "w3")}
        if self.ep_group is None:
            return held
        ep = dist.get_world_size(self.ep_group)
        first = dist.get_global_rank(self.ep_group, 0)
        mine = dist.get_rank(self.ep_group) == 0
        out = {}
        for name, t in held.items():
            parts = [torch.empty_like(t) for _ in range(ep)] if mine else None
            dist.gather(t.contiguous(), parts, dst=first, group=self.ep_group)
            out[name] = torch.cat(parts) if mine else t
        return out

    def route(self, x: torch.Tensor, routing: torch.Tensor | None = None,
              real: torch.Tensor | None = None, record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, d] -> (weights [N, k] float32, indices [N, k] long). `routing` replays indices
        (-1: not recorded, choose as usual); `real` [N] bool: the tokens the balancing statistics
        count (padding is routed but never counted, nor are tokens whose routing was not recorded);
        `record`: whether a training forward counts (an activation-checkpointing recomputation
        does not)."""
        scores = self.gate(x)
        with torch.no_grad():
            idx = torch.topk(scores + self.gate.e_score_correction_bias, self.top_k, dim=-1).indices
        record = record and self.training
        replay = scores.new_zeros(2)
        if routing is not None:
            recorded = (routing >= 0).all(-1)
            if record:  # how often the learner's own choice equals the rollout's (the set of k)
                with torch.no_grad():
                    counted = recorded if real is None else recorded & real
                    same = (routing.sort(-1).values == idx.sort(-1).values).all(-1)
                    replay = torch.stack([(same & counted).sum(), counted.sum()]).float()
            # a token the engine never fed (the last one sampled) has no recorded load to count
            real = recorded if real is None else real & recorded
            idx = torch.where(routing >= 0, routing, idx)
        w = scores.gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if record:  # replayed routing counts too: it is the load the step actually used
            self._record(scores.detach(), idx, real, replay)
        return w * self.scaling, idx

    @torch.no_grad()
    def _record(self, scores: torch.Tensor, idx: torch.Tensor, real: torch.Tensor | None,
                replay: torch.Tensor) -> None:
        """Add this forward's statistics; replay: [agreeing, recorded] replayed tokens."""
        weight = None if real is None else real.to(self.load.dtype)[:, None].expand_as(idx).reshape(-1)
        load = expert_counts(idx.reshape(-1), self.n_experts, weight).to(self.load.dtype)
        shift = torch.zeros_like(self.quantile_shift)
        if self.balance == "quantile" and real is not None:
            scores = scores[real]  # the quantiles are over real tokens (a host sync; "bias" needs none)
        if self.balance == "quantile" and scores.shape[0] > 0:
            n_tok = scores.shape[0]
            biased = scores + self.gate.e_score_correction_bias
            kk = min(self.top_k + 1, self.n_experts)
            alpha = biased.topk(kk, dim=-1).values[:, -1:]  # (k+1)-th largest per token
            m = biased - alpha  # [N, E]
            q = int(math.ceil(self.top_k * n_tok / self.n_experts))
            qq = min(q + 1, n_tok)
            shift = m.topk(qq, dim=0).values[-1]  # (q+1)-th largest per expert
        stats = torch.cat([load, shift, load.new_ones(1), replay])
        if self.stats_group is not None:
            # Every data-parallel rank trains on its own tokens: summed over all of them, the statistics
            # (and so the bias update, the same on every rank) are one rank's over all the tokens.
            dist.all_reduce(stats, group=self.stats_group)
        E = self.n_experts
        self.load += stats[:E]
        self.quantile_shift += stats[E:2 * E]
        self.n_stat += stats[2 * E]
        self.replay_agree += stats[2 * E + 1]
        self.replay_total += stats[2 * E + 2]

    @torch.no_grad()
    def update_bias(self) -> None:
        """Aux-loss-free balancing after an optimizer step; resets the statistics."""
        if self.n_stat.item() > 0 and self.balance != "none":
            b = self.gate.e_score_correction_bias
            if self.balance == "bias":
                b += self.rate * torch.sign(self.load.mean() - self.load)
            else:
                b -= _QUANTILE_EMA * self.quantile_shift / self.n_stat
        self.load.zero_()
        self.quantile_shift.zero_()
        self.n_stat.zero_()
        self.replay_agree.zero_()
        self.replay_total.zero_()

    def forward(self, x: torch.Tensor, routing: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None, record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, d]; routing: [B, T, k] or None; token_mask [B, T] bool: real tokens; record:
        whether a training forward adds to the balancing statistics.
        Returns (y [B, T, d], indices [B, T, k])."""
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        r = None
        if routing is not None:
            r = routing.reshape(-1, self.top_k).to(device=x.device, dtype=torch.long)
        real = None if token_mask is None else token_mask.reshape(-1).to(x.device)
        w, idx = self.route(flat, r, real, record)
        z = self.routed_expert_down_proj(flat) if self.latent is not None else flat
        y = self.experts(z, w, idx, self.ep_group)
        y = y.to(x.dtype)
        if self.latent is not None:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.reshape(B, T, d), idx.reshape(B, T, self.top_k)
