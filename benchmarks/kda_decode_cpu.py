"""CPU benchmark: one KDA decode step on states held in slots, as the native engine runs it.

`kimi_kernels.kda.kda_in_slots` (the rows' states gathered once, updated in place with batched
products, put back) beside what it did before: gather, `kda` (the token-by-token recurrence),
scatter. Same inputs, one process, interleaved, float32, in a dedicated worker thread at one torch
thread (where the engine runs its forwards). Prints microseconds per call and the ratio:

    .venv/bin/python benchmarks/kda_decode_cpu.py [--rows 8 32 128 --heads 4 --dim 32 --calls 300]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_kernels.kda import kda, kda_in_slots  # noqa: E402


def gather_recurrence_scatter(q, k, v, g, beta, pool, slots) -> torch.Tensor:
    o, final = kda(q, k, v, g, beta, initial_state=pool.index_select(0, slots), output_final_state=True,
                   backend="torch")
    pool.index_copy_(0, slots, final)
    return o


def inputs(rows: int, heads: int, dim: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(rows, 1, heads, dim, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(rows, 1, heads, dim, generator=gen)
    g = -torch.rand(rows, 1, heads, dim, generator=gen)
    beta = torch.rand(rows, 1, heads, generator=gen)
    pool = torch.randn(rows + 8, heads, dim, dim, generator=gen)
    return [q, k, v, g, beta], pool, torch.randperm(rows + 8, generator=gen)[:rows]


def us_per_call(fn: Callable, args: list, calls: int) -> float:
    for _ in range(20):
        fn(*args)
    started = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - started) / calls * 1e6


@torch.no_grad()
def measure(rows: int, heads: int, dim: int, calls: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    (q, k, v, g, beta), pool, slots = inputs(rows, heads, dim)
    pool_ref = pool.clone()
    o, o_ref = (fn(q, k, v, g, beta, p, slots) for fn, p in ((kda_in_slots, pool), (gather_recurrence_scatter, pool_ref)))
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(pool, pool_ref, atol=1e-5)
    times: dict[str, list[float]] = {"in place": [], "gather, recurrence, scatter": []}
    for _ in range(repeats):
        times["in place"].append(us_per_call(kda_in_slots, [q, k, v, g, beta, pool, slots], calls))
        times["gather, recurrence, scatter"].append(
            us_per_call(gather_recurrence_scatter, [q, k, v, g, beta, pool, slots], calls))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=32, help="K = V head dim (the rollout benchmark's toy: 4 x 32)")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    worker = ThreadPoolExecutor(max_workers=1)  # the engine's forwards run in one dedicated thread
    print("| rows | in place us/call | gather, recurrence, scatter us/call | ratio |\n|---|---|---|---|")
    for rows in args.rows:
        r = worker.submit(measure, rows, args.heads, args.dim, args.calls, args.repeats).result()
        ours, before = r["in place"], r["gather, recurrence, scatter"]
        print(f"| {rows} | {ours:.0f} | {before:.0f} | {before / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
