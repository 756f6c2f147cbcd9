"""DSA key selection: `kimi_kernels.ops.topk_mask` (one top-k for the threshold, ties by position)
against the stable descending sort it replaced, side by side in one run, same scores.

    python benchmarks/dsa_select.py [--T 4096] [--k 2048] [--batch 1] [--device cpu|cuda] [--iters 5]

Scores are indexer-like: causal (-inf above the diagonal) with ReLU-style exact zeros, so ties
are common. Checks that both select the same keys, then prints the median time of each.
"""
from __future__ import annotations

import argparse

import torch

from bench_common import median_wall_s
from kimi_kernels.ops import topk_mask, topk_to_mask


def by_sort(scores: torch.Tensor, k: int) -> torch.Tensor:
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return topk_to_mask(top, scores.shape[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()
    g = torch.Generator(device=a.device).manual_seed(0)
    scores = torch.relu(torch.randn(a.batch, a.T, a.T, device=a.device, generator=g))
    scores = scores.masked_fill(torch.ones(a.T, a.T, dtype=torch.bool, device=a.device).triu(1), float("-inf"))
    assert torch.equal(topk_mask(scores, a.k), by_sort(scores, a.k)), "the two selections differ"
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    t_sort = median_wall_s(lambda: by_sort(scores, a.k), a.iters, sync)
    t_mask = median_wall_s(lambda: topk_mask(scores, a.k), a.iters, sync)
    print(f"device {a.device}, scores [{a.batch}, {a.T}, {a.T}], k={a.k}: same selection; "
          f"stable sort {1e3 * t_sort:.1f} ms, topk_mask {1e3 * t_mask:.1f} ms, {t_sort / t_mask:.2f}x faster")


if __name__ == "__main__":
    main()
