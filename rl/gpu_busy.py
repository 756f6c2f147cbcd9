"""How busy the GPUs were during each GRPO step: NVML's utilization ("percent of time over the
past sample period during which one or more kernels was executing on the GPU"), sampled for every
visible GPU in a background thread of the driver, averaged over a window of wall time.

    busy = GpuBusy.start()                 # a no-op object where there is no GPU (or no NVML)
    ...
    metrics.update(busy.read(t0, t3))      # {"gpu/busy_frac": ..., "gpu/busy_frac/gpu0": ...} or {}
    busy.close()

A sample taken at time t covers (previous sample's time, t]: NVML reports the busy fraction of the
period just past. A window's figure is the time-weighted mean of the samples over the part of the
window they cover; a window shorter than one sampling interval takes the first sample after it.
The driver is where NVML is read: Ray's actors hold the GPUs, but NVML sees every device of the
node, so the figure counts every process's kernels (learner and rollout engines alike).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Sequence

Source = Callable[[], Sequence[float]]  # each visible GPU's busy fraction in [0, 1], one call a sample


class GpuBusy:
    """Samples `source` every `interval_s` seconds (in a daemon thread once `run()` is called, or by
    hand through `sample()`), and averages the samples over windows of `clock`'s time."""

    def __init__(self, source: Source | None, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 keep_s: float = 3600.0) -> None:
        self.source, self.interval_s, self.clock, self.keep_s = source, interval_s, clock, keep_s
        self._samples: list[tuple[float, tuple[float, ...]]] = []  # (time, each GPU's busy fraction)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_read: float | None = None

    @classmethod
    def start(cls, interval_s: float = 0.1) -> "GpuBusy":
        """Sampling NVML in a background thread; without a GPU or NVML, an object that reads {}."""
        busy = cls(nvml_source(), interval_s)
        if busy.source is not None:
            busy.run()
        return busy

    @property
    def active(self) -> bool:
        return self.source is not None

    def run(self) -> None:
        self._last_read = self.clock()
        self._thread = threading.Thread(target=self._loop, name="gpu-busy", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # NVML went away (driver reset, shutdown): the figures stop, the run does not
                return

    def sample(self) -> None:
        """One sample of every GPU, stamped now."""
        if self.source is None:
            return
        fracs = tuple(min(1.0, max(0.0, float(f))) for f in self.source())
        now = self.clock()
        with self._lock:
            self._samples.append((now, fracs))
            horizon = now - self.keep_s
            if self._samples[0][0] < horizon:
                self._samples = [s for s in self._samples if s[0] >= horizon]

    def read(self, start: float | None = None, end: float | None = None) -> dict[str, float]:
        """The mean busy fraction over [start, end] (default: since the last read, until now): all
        GPUs' mean as gpu/busy_frac, and with several GPUs each one's as gpu/busy_frac/gpuN. {} where
        nothing was sampled."""
        end = self.clock() if end is None else end
        start = (self._last_read if self._last_read is not None else end) if start is None else start
        self._last_read = end
        with self._lock:
            samples = list(self._samples)
        per_gpu = window_mean(samples, start, end)
        if not per_gpu:
            return {}
        out = {"gpu/busy_frac": sum(per_gpu) / len(per_gpu)}
        if len(per_gpu) > 1:
            out.update({f"gpu/busy_frac/gpu{i}": f for i, f in enumerate(per_gpu)})
        return out

    def step(self, t0: float, t1: float, t2: float, t3: float) -> dict[str, float]:
        """A GRPO step's figures: gpu/busy_frac over [t0, t3] (per GPU too, with several), and its mean
        over all GPUs in each part of the step: rollout [t0, t1], learner [t1, t2], weight sync [t2, t3]."""
        out = self.read(t0, t3)
        if out:
            for part, (a, b) in (("rollout", (t0, t1)), ("learner", (t1, t2)), ("sync", (t2, t3))):
                got = self.read(a, b)
                if got:
                    out[f"gpu/busy_frac_{part}"] = got["gpu/busy_frac"]
        self._last_read = t3
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1.0)
            self._thread = None


def window_mean(samples: Sequence[tuple[float, Sequence[float]]], start: float, end: float) -> list[float]:
    """Each GPU's time-weighted mean over [start, end] of samples (time-ordered), sample i holding
    over (t[i-1], t[i]] (the first over a period as long as the next gap, or none when alone). A
    window no sample's period overlaps takes the first sample after it; none after it: []."""
    if not samples or end < start:
        return []
    n = len(samples[0][1])
    total, acc = 0.0, [0.0] * n
    for i, (t, fracs) in enumerate(samples):
        if i:
            lo = samples[i - 1][0]
        elif len(samples) > 1:
            lo = t - (samples[1][0] - t)
        else:
            lo = t
        overlap = min(t, end) - max(lo, start)
        if overlap > 0 and len(fracs) == n:
            total += overlap
            acc = [a + f * overlap for a, f in zip(acc, fracs)]
    if total > 0:
        return [a / total for a in acc]
    after = [fracs for t, fracs in samples if t >= start]
    return list(after[0]) if after else []


def _visible(count: int) -> list[int | str]:
    """The devices CUDA_VISIBLE_DEVICES leaves this process (indices or UUIDs); unset: all."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    out: list[int | str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item.lstrip("-").isdigit():
            if int(item) < 0:
                break  # CUDA stops at the first invalid index
            if int(item) < count:
                out.append(int(item))
        else:
            out.append(item)
    return out


def nvml_source() -> Source | None:
    """A source reading NVML's utilization of each visible GPU; None without NVML or GPUs (a run
    on CPUs says nothing about it)."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        handles = []
        for dev in _visible(pynvml.nvmlDeviceGetCount()):
            if isinstance(dev, int):
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(dev))
            else:
                handles.append(pynvml.nvmlDeviceGetHandleByUUID(dev if dev.startswith("GPU-") else f"GPU-{dev}"))
        if not handles:
            return None
        for h in handles:  # one read now: a device NVML cannot report on makes no source
            pynvml.nvmlDeviceGetUtilizationRates(h)
    except Exception:
        return None

    def read() -> list[float]:
        return [pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0 for h in handles]

    return read
