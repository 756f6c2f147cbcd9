"""What the GPU benchmarks share: timestamped progress lines, CUDA-event timing, relative error."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def log(msg: str) -> None:
    """A timestamped line, flushed (a command killed at its time limit returns only what it printed)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cuda_time_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median milliseconds of `fn` over `iters` calls, timed with CUDA events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(x - ref) / RMS(ref), in float64 (fla's own tolerance measure)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
