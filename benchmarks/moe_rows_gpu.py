"""The MoE's row gathers on one GPU: kimi_kernels/expert_rows.py's Triton kernels beside their torch
references compiled by inductor with dynamic sizes (as kimi_kernels/fusion.py compiles) and the
permutation copies before them (30ce54d: index_copy_ back to token order, then a compiled weighted
sum; the input rows' gradient so until e141c36).

The Kimi-Linear shape at one packed 8K row: 8,192 tokens, top-8 (65,536 expert rows), d 2,304, bf16,
routes uniform at random. Per op: the forward's weighted sum over each token's rows, its backward
(the rows' and the weights' gradients), and the gradient of the experts' input rows (each token's k
rows summed). The bound column is one pass over the bytes each must move
at 3.35 TB/s (H100 SXM's HBM3).

    python3 benchmarks/moe_rows_gpu.py --json $OUT/moe_rows.json

Timings: triton.testing.do_bench (median, L2 flushed between calls)."""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from bench_common import log, write_json
from kimi_kernels import expert_rows

HBM_BYTES_PER_S = 3.35e12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dim", type=int, default=2304)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()
    n, k, d = args.tokens, args.top_k, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(n, args.experts, generator=g, device="cuda").topk(k, dim=-1).indices.reshape(-1)
    order = torch.argsort(ids, stable=True)
    pair_rows = expert_rows.row_of_pair(order)
    out = torch.randn(n * k, d, generator=g, device="cuda").bfloat16()
    w = torch.rand(n, k, generator=g, device="cuda")
    grad = torch.randn(n, d, generator=g, device="cuda").bfloat16()

    compiled = {name: torch.compile(fn, dynamic=True) for name, fn in (
        ("fwd", expert_rows.weighted_token_sums_reference),
        ("bwd", expert_rows.weighted_token_sums_backward_reference),
        ("sums", expert_rows.token_sums_reference))}

    def combine(outs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # 30ce54d's combine_experts
        return (outs.float() * weights.float()[..., None]).sum(1)

    combine_c = torch.compile(combine, dynamic=True)

    def permuted_fwd():  # 30ce54d: back to token order by a permutation, then the weighted sum
        by_token = torch.empty_like(out).index_copy_(0, order, out)
        return combine_c(by_token.view(n, k, d), w).to(out.dtype)

    by_token = torch.empty_like(out).index_copy_(0, order, out).view(n, k, d).requires_grad_()
    wr = w.clone().requires_grad_()
    y = combine_c(by_token, wr)

    def permuted_bwd():  # the compiled combine's backward, then the permutation's gradient (a gather)
        g_rows, g_w = torch.autograd.grad(y, (by_token, wr), grad.float(), retain_graph=True)
        return g_rows.reshape(n * k, d)[order], g_w

    def permuted_sums():  # 30ce54d-e141c36: the input rows' gradient back to token order by a permutation, then summed
        return torch.empty_like(out).index_copy_(0, order, out).view(n, k, d).sum(1)

    row_bytes, tok_bytes = n * k * d * 2, n * d * 2
    cases = {
        "forward (weighted sums)": (row_bytes + tok_bytes, expert_rows.weighted_token_sums,
                                    lambda: compiled["fwd"](out, w, pair_rows), permuted_fwd, (out, w, pair_rows)),
        "backward (rows' and weights' gradients)": (2 * row_bytes + tok_bytes, expert_rows.weighted_token_sums_backward,
                                                    lambda: compiled["bwd"](grad, out, w, pair_rows), permuted_bwd,
                                                    (grad, out, w, pair_rows)),
        "experts' input rows' gradient (token sums)": (row_bytes + tok_bytes, expert_rows.token_sums,
                                                       lambda: compiled["sums"](out, pair_rows, k), permuted_sums,
                                                       (out, pair_rows, k)),
    }
    results = {"gpu": torch.cuda.get_device_name(), "tokens": n, "top_k": k, "dim": d, "ops": {}}
    log(f"{results['gpu']}: {n} tokens, top-{k}, d {d}, bf16")
    for name, (nbytes, kernel, inductor, permuted, kernel_args) in cases.items():
        want, got = inductor(), kernel(*kernel_args)
        for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            err = ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-30)).item()
            assert err < 2e-2, f"{name}: kernel and reference differ by {err:.3g} of the largest value"
        ms = {"triton": do_bench(lambda: kernel(*kernel_args)), "inductor": do_bench(inductor),
              "permuted": do_bench(permuted), "bound": nbytes / HBM_BYTES_PER_S * 1e3}
        results["ops"][name] = {key: round(v, 4) for key, v in ms.items()}
        log(f"  {name}: triton {ms['triton']:.3f} ms, inductor {ms['inductor']:.3f} ms, "
            f"permutation copies (30ce54d) {ms['permuted']:.3f} ms, bound {ms['bound']:.3f} ms")
    ops = results["ops"].values()
    total = {key: round(sum(op[key] for op in ops), 3) for key in ("triton", "inductor", "permuted")}
    results["per_layer_ms"] = total
    log(f"  a MoE layer's three: triton {total['triton']} ms, inductor {total['inductor']} ms, "
        f"permutation copies {total['permuted']} ms")
    write_json(results, args.json)


if __name__ == "__main__":
    main()
