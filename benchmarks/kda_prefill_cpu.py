"""CPU benchmark: KDA forwards without gradient (a rollout prefill) at the chunk `kda` now picks
for them (`kimi_kernels.kda.inference_chunk_size`: token by token up to 8 tokens, chunks of 16 up to 64,
then 32) beside the training chunk of 64 it used before. Same inputs, one process, interleaved,
float32, one torch thread in a dedicated worker thread (where the engine runs its forwards). Prints
milliseconds per call and the ratio:

    .venv/bin/python benchmarks/kda_prefill_cpu.py [--rows 8 128 --tokens 8 32 128 512 --dim 32 128]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import median_wall_s  # noqa: E402
from benchmarks.kda_cpu import make_inputs  # noqa: E402
from kimi_kernels.kda import inference_chunk_size, kda_chunk, kda_recurrent  # noqa: E402

TRAINING_CHUNK = 64


def run_at(chunk: int | None, args: list[torch.Tensor]) -> torch.Tensor:
    if chunk is None:
        return kda_recurrent(*args, output_final_state=True)[0]
    return kda_chunk(*args, output_final_state=True, chunk_size=chunk)[0]


@torch.no_grad()
def measure(rows: int, tokens: int, heads: int, dim: int, calls: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    args = make_inputs(rows, tokens, heads, dim)[:5]  # q, k, v, g, beta: a prompt from an empty state
    chosen = inference_chunk_size(tokens)
    assert torch.allclose(run_at(chosen, args), run_at(TRAINING_CHUNK, args), atol=1e-4)
    times: dict[str, list[float]] = {"chosen": [], "training": []}
    for _ in range(repeats):  # interleaved: a noisy neighbour slows both alike
        times["chosen"].append(median_wall_s(lambda: run_at(chosen, args), calls) * 1e3)
        times["training"].append(median_wall_s(lambda: run_at(TRAINING_CHUNK, args), calls) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 128])
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 512])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, nargs="+", default=[32, 128],
                   help="K = V head dim (32: the rollout benchmark's toy; 128: Kimi-Linear)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    worker = ThreadPoolExecutor(max_workers=1)  # the engine's forwards run in one dedicated thread
    print("| rows | tokens | head dim | chosen chunk | chosen ms | chunk 64 ms | ratio |\n|---|---|---|---|---|---|---|")
    for dim in args.dim:
        for rows in args.rows:
            for tokens in args.tokens:
                r = worker.submit(measure, rows, tokens, args.heads, dim, args.calls, args.repeats).result()
                chosen = inference_chunk_size(tokens)
                label = "token by token" if chosen is None else str(chosen)
                print(f"| {rows} | {tokens} | {dim} | {label} | {r['chosen']:.1f} | {r['training']:.1f} | "
                      f"{r['training'] / r['chosen']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
