"""What the benchmarks share: timestamped progress lines, CUDA-event and wall-clock timing, relative
error, the JSON results file."""
from __future__ import annotations

import json
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


def median_wall_s(fn: Callable[[], Any], iters: int, sync: Callable[[], Any] = lambda: None,
                  warmup: int = 1) -> float:
    """Median wall-clock seconds of `fn` over `iters` calls after `warmup` calls; `sync` waits for
    the device (torch.cuda.synchronize on CUDA)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def write_json(results: dict[str, Any], path: str | None) -> None:
    """Write the results so far (called after each section: a killed run keeps what it measured)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(x - ref) / RMS(ref), in float64 (fla's own tolerance measure)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
