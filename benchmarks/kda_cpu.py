"""CPU benchmark: KDA forward+backward tokens/s, ours (kimi_kernels.kda.kda_chunk) vs transformers' torch fallback.

Both run on the same inputs in one process, interleaved, float32, chunk 64, with an initial
state; the ratio ours/theirs is printed. Usage:

    .venv/bin/python benchmarks/kda_cpu.py [--batch 1 --seq 2048 --heads 4 --dim 128 --repeats 3 --threads 0]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from kimi_kernels.kda import kda_chunk, kda_gate


def reference_fn() -> Callable:
    """transformers' pure-torch chunk KDA (bypass its optional hub/fla kernel wrapper)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as m

    fn = m.chunk_kimi_delta_attention
    return getattr(fn, "__wrapped__", fn)


def make_inputs(B: int, T: int, H: int, D: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    g = kda_gate(torch.randn(B, T, H, D, generator=gen), A_log, torch.randn(H * D, generator=gen),
                 lower_bound=-5.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, D, D, generator=gen) * 0.1
    return [q, k, v, g, beta, h0]


def fwd_bwd_seconds(fn: Callable, inputs: list[torch.Tensor], w_o: torch.Tensor, w_s: torch.Tensor) -> float:
    args = [x.clone().requires_grad_(True) for x in inputs]
    t0 = time.perf_counter()
    o, s = fn(*args[:5], initial_state=args[5], output_final_state=True)
    ((o * w_o).sum() + (s * w_s).sum()).backward()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128, help="K = V head dim")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    inputs = make_inputs(a.batch, a.seq, a.heads, a.dim)
    gen = torch.Generator().manual_seed(1)
    w_o = torch.randn(a.batch, a.seq, a.heads, a.dim, generator=gen)
    w_s = torch.randn(a.batch, a.heads, a.dim, a.dim, generator=gen)
    ref = reference_fn()
    ours = lambda *x, **kw: kda_chunk(*x, **kw, chunk_size=64)  # noqa: E731
    theirs = lambda *x, **kw: ref(*x, **kw, chunk_size=64)  # noqa: E731

    # Same answer first (otherwise the speed comparison means nothing).
    with torch.no_grad():
        o1, s1 = ours(*inputs[:5], initial_state=inputs[5], output_final_state=True)
        o2, s2 = theirs(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    rel = ((o1 - o2).norm() / o2.norm()).item()
    print(f"shape B={a.batch} T={a.seq} H=HV={a.heads} K=V={a.dim} fp32 chunk=64 threads={torch.get_num_threads()}")
    print(f"agreement: rel err o={rel:.2e} state={((s1 - s2).norm() / s2.norm()).item():.2e}")

    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    fwd_bwd_seconds(ours, inputs, w_o, w_s)  # warm-up both
    fwd_bwd_seconds(theirs, inputs, w_o, w_s)
    for i in range(a.repeats):  # interleaved so both see the same machine load
        times["ours"].append(fwd_bwd_seconds(ours, inputs, w_o, w_s))
        times["transformers"].append(fwd_bwd_seconds(theirs, inputs, w_o, w_s))
        print(f"  repeat {i + 1}/{a.repeats}: ours {times['ours'][-1]:.3f}s  transformers {times['transformers'][-1]:.3f}s",
              flush=True)
    tokens = a.batch * a.seq
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, t in med.items():
        print(f"{name:>13}: {tokens / t:10.0f} tokens/s (median {t:.3f}s fwd+bwd)")
    print(f"ratio ours/transformers: {med['transformers'] / med['ours']:.2f}x")


if __name__ == "__main__":
    main()
