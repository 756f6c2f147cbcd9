"""The small-M expert kernels' launch configurations on one GPU, beside CUTLASS's grouped GEMM.

A decode step's routed experts at the Kimi-Linear shape (d 2304, I 1024, 64 experts, top-8; bf16
random weights, tokens routed uniformly at random): for each batch size and row block, every
launch configuration of kimi_kernels/grouped_experts.py's two kernels (gate and up with the GLU; down)
is timed, then the best pair beside the table's pair (what the policy uses) and beside
torch._grouped_mm's three products with the GLU between them (what it uses past the small-M
threshold). Rates are the expert weights' bytes over the time (every expert has rows at these
sizes, so each step reads them all).

    python3 benchmarks/grouped_experts_gpu.py --seqs 64 256 --json $OUT/grouped_experts.json

Timings: triton.testing.do_bench (median, L2 flushed between calls); a configuration that does not
fit the GPU's shared memory is skipped and said so."""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from bench_common import log, write_json
from kimi_kernels.grouped_experts import DOWN_CONFIGS, GLU_CONFIGS, LaunchConfig, project


def routed_rows(seqs: int, experts: int, top_k: int, dim: int, gen: torch.Generator):
    """Each of `seqs` tokens to top_k distinct experts at random: rows sorted by expert, offs [E+1]."""
    choice = torch.rand(seqs, experts, generator=gen, device="cuda").topk(top_k, dim=-1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    zs = torch.randn(seqs * top_k, dim, generator=gen, device="cuda").bfloat16()
    return zs, counts, offs


def grid(block_ns: list[int], block_ks: list[int]) -> list[LaunchConfig]:
    pipelines = [(4, 3), (4, 4), (4, 5), (8, 3), (8, 4)]
    return [LaunchConfig(n, k, w, s) for n, k, (w, s) in itertools.product(block_ns, block_ks, pipelines)]


def time_ms(fn) -> float | None:
    import triton
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=40)
    except Exception as err:  # noqa: BLE001 (Triton's OutOfResources and compile errors: the config is skipped)
        if "OutOfResources" not in type(err).__name__ and "shared memory" not in str(err):
            raise
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--block-m", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--block-k", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    E, top_k, d, inter = 64, 8, 2304, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = (torch.randn(E, inter, d, generator=gen, device="cuda").bfloat16() / d**0.5 for _ in range(2))
    w2 = torch.randn(E, d, inter, generator=gen, device="cuda").bfloat16() / inter**0.5
    glu_bytes, down_bytes = 2 * w1.numel() * 2, w2.numel() * 2
    tbs = lambda nbytes, ms: nbytes / ms / 1e9  # noqa: E731
    results = {"args": vars(args), "rows": []}
    configs = grid(args.block_n, args.block_k)
    for seqs in args.seqs:
        zs, counts, offs = routed_rows(seqs, E, top_k, d, gen)
        h = torch.randn(len(zs), inter, generator=gen, device="cuda").bfloat16()
        ends = offs[1:].to(torch.int32)
        cutlass = {
            "gate+up+glu": time_ms(lambda: torch._grouped_mm(zs, w3.transpose(-2, -1), offs=ends).mul_(
                F.silu(torch._grouped_mm(zs, w1.transpose(-2, -1), offs=ends)))),
            "down": time_ms(lambda: torch._grouped_mm(h, w2.transpose(-2, -1), offs=ends))}
        log(f"{seqs} sequences: {len(zs)} rows over {E} experts (mean {len(zs) / E:.0f}, max "
            f"{int(counts.max())}); CUTLASS gate+up+GLU {cutlass['gate+up+glu']:.3f} ms "
            f"({tbs(glu_bytes, cutlass['gate+up+glu']):.2f} TB/s), down {cutlass['down']:.3f} ms "
            f"({tbs(down_bytes, cutlass['down']):.2f} TB/s)")
        for block_m in args.block_m:
            best = {}
            for kind, run, nbytes, table in (
                    ("gate+up+glu", lambda c: project(zs, w1, w3, offs, block_m, "silu", 0.0, 0.0, c), glu_bytes,
                     GLU_CONFIGS),
                    ("down", lambda c: project(h, w2, None, offs, block_m, config=c), down_bytes, DOWN_CONFIGS)):
                timed = []
                for config in configs:
                    ms = time_ms(lambda: run(config))
                    if ms is None:
                        log(f"  {kind} block_m {block_m} {tuple(config)}: does not fit shared memory, skipped")
                        continue
                    timed.append((ms, config))
                    results["rows"].append({"seqs": seqs, "kind": kind, "block_m": block_m, **config._asdict(),
                                            "ms": ms, "tb_s": tbs(nbytes, ms)})
                timed.sort(key=lambda t: t[0])
                table_ms = time_ms(lambda: run(None))
                best[kind] = timed[0][0]
                log(f"  block_m {block_m}, {kind}: best " + ", ".join(
                    f"{tuple(c)} {ms:.3f} ms ({tbs(nbytes, ms):.2f} TB/s)" for ms, c in timed[:3])
                    + f"; the table's {tuple(table.get(block_m, ()))} {table_ms:.3f} ms; worst {timed[-1][0]:.3f} ms")
            both, base = best["gate+up+glu"] + best["down"], cutlass["gate+up+glu"] + cutlass["down"]
            log(f"  block_m {block_m}: best pair {both:.3f} ms a layer "
                f"({tbs(glu_bytes + down_bytes, both):.2f} TB/s), CUTLASS {base:.3f} ms: {base / both:.2f}x")
            results["rows"].append({"seqs": seqs, "block_m": block_m, "best_pair_ms": both, "cutlass_ms": base})
        write_json(results, args.json)


if __name__ == "__main__":
    main()
