"""GPU benchmark (one H200): the floor under a preset's training step. Each kind of heavy kernel
the step cannot do without is timed alone at the step's shapes (forward + backward), and their sum
bounds the step time from below and the model FLOP utilisation from above:

  gemm       every nn.Linear call of one forward (shapes recorded by hooks), as F.linear
  experts    the routed experts (grouped GEMM with its token permutation), uniform routing
  kda        fla chunk_kda through kimi_kernels.kda, once per KDA layer
  attention  SDPA causal attention at the global layers' head dims (flash); the DSA top-k
             masked form is timed too but not counted (a sparse kernel would do less)
  loss       float32 logits and cross-entropy over the vocabulary

    python benchmarks/train_step_floor_gpu.py --preset small --seq 8192 --batch 4 [--json $OUT/gpu_floor.json]

Norms, gates, the indexer, routing and every other elementwise op are left out, so the real
step is slower than this floor; MFU counts 6 x active parameters per token, as train_step_gpu.py does.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench_common import cuda_time_ms, log, write_json

H200_BF16_PEAK = 989e12


def linear_shapes(model: nn.Module) -> Counter:
    """(rows per token, in, out) of every nn.Linear call in one forward, with call counts."""
    seen: Counter = Counter()
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.update(
        [(inp[0].numel() // mod.in_features, mod.in_features, mod.out_features)]))
        for m in model.modules() if isinstance(m, nn.Linear)]
    ids = torch.randint(3, model.config.vocab_size, (1, 64), device="cuda")
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return Counter({(rows // 64, i, o): n for (rows, i, o), n in seen.items()})


def time_fwd_bwd(fn, *shapes_dtypes, warmup: int = 2, iters: int = 5) -> float:
    leaves = [torch.randn(*s, device="cuda", dtype=dt).mul_(0.1).requires_grad_(dt.is_floating_point)
              for s, dt in shapes_dtypes]

    def step() -> None:
        out = fn(*leaves)
        out.backward(torch.ones_like(out))

    return cuda_time_ms(step, warmup, iters)


def floor(preset: str, B: int, T: int) -> dict[str, Any]:
    from kimi_kernels.attention import attention
    from kimi_kernels.kda import kda
    from kimi_kernels.ops import topk_mask
    from policy import build_model, get_config
    from policy.layers.moe import StackedExperts
    from policy.params import count_parameters

    cfg = get_config(preset)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    counts = count_parameters(model)
    N = B * T
    bf = torch.bfloat16
    parts: dict[str, float] = {}

    gemm = 0.0
    for (per_tok, i, o), n in sorted(linear_shapes(model).items()):
        ms = time_fwd_bwd(lambda x, w: F.linear(x, w), ((per_tok * N, i), bf), ((o, i), bf))
        log(f"gemm [{per_tok * N} x {i}] -> {o}: {ms:.3f} ms x{n}")
        gemm += ms * n
    parts["gemm"] = gemm
    del model

    n_moe = len(cfg.moe_layers)
    if n_moe:
        experts = StackedExperts(cfg.num_experts, cfg.routed_expert_hidden_size or cfg.hidden_size,
                                 cfg.moe_intermediate_size, cfg).to("cuda", bf)
        for p in experts.parameters():
            nn.init.normal_(p, std=0.02)
        idx = torch.rand(N, cfg.num_experts, device="cuda").topk(cfg.num_experts_per_token, -1).indices
        w = torch.rand(N, cfg.num_experts_per_token, device="cuda")
        ms = time_fwd_bwd(lambda z: experts(z, w, idx), ((N, experts.w1.shape[2]), bf))
        log(f"experts (grouped GEMM + permutation, {N} tokens): {ms:.3f} ms x{n_moe}")
        parts["experts"] = ms * n_moe

    n_kda = cfg.layer_types.count("kda")
    H, HV, K, V = cfg.linear_num_heads, cfg.num_v_heads, cfg.linear_head_dim, cfg.v_dim

    # dtypes as the layer passes them (a new dtype would cost fla a fresh autotune)
    def kda_call(q, k, v, g, beta):
        return kda(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, -F.softplus(g), beta.sigmoid())[0]

    log("kda: first call autotunes fla's kernels for this shape")
    ms = time_fwd_bwd(kda_call, ((B, T, H, K), bf), ((B, T, H, K), bf), ((B, T, HV, V), bf),
                      ((B, T, HV, K), torch.float32), ((B, T, HV), torch.float32))
    log(f"kda fwd+bwd: {ms:.3f} ms x{n_kda}")
    parts["kda"] = ms * n_kda

    n_glob = len(cfg.layer_types) - n_kda
    Hq, Dqk, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    qkv = (((B, T, Hq, Dqk), bf), ((B, T, Hq, Dqk), bf), ((B, T, Hq, Dv), bf))
    ms = time_fwd_bwd(lambda q, k, v: attention(q, k, v, scale=Dqk ** -0.5), *qkv)
    log(f"attention causal fwd+bwd: {ms:.3f} ms x{n_glob}")
    parts["attention"] = ms * n_glob
    res: dict[str, Any] = {}
    if cfg.index_topk and cfg.index_topk < T:
        scores = torch.rand(B, T, T, device="cuda").masked_fill(
            torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        sel = topk_mask(scores, cfg.index_topk)
        del scores
        ms = time_fwd_bwd(lambda q, k, v: attention(q, k, v, scale=Dqk ** -0.5, mask=sel), *qkv)
        log(f"attention with a DSA top-{cfg.index_topk} mask fwd+bwd (not counted): {ms:.3f} ms x{n_glob}")
        res["dsa_masked_attention_ms_per_layer"] = round(ms, 3)
        del sel

    y = torch.randint(0, cfg.vocab_size, (N,), device="cuda")
    ms = time_fwd_bwd(lambda lg: F.cross_entropy(lg.float(), y), ((N, cfg.vocab_size), bf))
    log(f"loss (fp32 logits + cross-entropy) fwd+bwd: {ms:.3f} ms")
    parts["loss"] = ms

    total = sum(parts.values())
    flops = 6 * counts["active"] * N
    res.update({"preset": preset, "batch": B, "seq": T, "active_params": counts["active"],
                "floor_ms": {k: round(v, 2) for k, v in parts.items()}, "floor_total_ms": round(total, 2),
                "mfu_6N_upper_bound_pct": round(100 * flops / (total / 1e3) / H200_BF16_PEAK, 2),
                "step_ms_for_35pct_mfu": round(1e3 * flops / (0.35 * H200_BF16_PEAK), 2)})
    log(f"floor {total:.1f} ms ({res['floor_ms']}); MFU(6N) can be at most {res['mfu_6N_upper_bound_pct']}%; "
        f"35% would need a {res['step_ms_for_35pct_mfu']} ms step")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, nargs="+", default=[4])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    results = {f"{a.preset}_B{b}_T{a.seq}": floor(a.preset, b, a.seq) for b in a.batch}
    write_json(results, a.json)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
