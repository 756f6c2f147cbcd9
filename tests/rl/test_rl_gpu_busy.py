"""rl/gpu_busy.py: a GRPO step's GPU busy fraction, averaged over the step's wall time from samples
taken in a thread (NVML on a GPU; a fake source here), and nothing at all without a GPU."""
import time

import pytest

from rl.gpu_busy import GpuBusy, window_mean


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scripted(values):
    """A source returning the next row of `values` (each GPU's busy fraction) at each call."""
    rows = iter(values)
    return lambda: next(rows)


def test_a_step_is_the_time_weighted_mean_of_its_samples():
    clock = FakeClock()
    # two GPUs; samples at t = 1, 2, 3, 5 (the last one 2 s after the one before: it weighs twice)
    busy = GpuBusy(scripted([(0.0, 1.0), (1.0, 1.0), (0.5, 0.0), (1.0, 0.5)]), clock=clock)
    for t in (1.0, 2.0, 3.0, 5.0):
        clock.now = t
        busy.sample()
    # sample i holds over (t[i-1], t[i]]: [1, 5] is 1 s of 1.0, 1 s of 0.5, 2 s of 1.0 on GPU 0
    got = busy.read(1.0, 5.0)
    assert got["gpu/busy_frac/gpu0"] == pytest.approx((1.0 + 0.5 + 2 * 1.0) / 4)
    assert got["gpu/busy_frac/gpu1"] == pytest.approx((1.0 + 0.0 + 2 * 0.5) / 4)
    assert got["gpu/busy_frac"] == pytest.approx((3.5 / 4 + 2.0 / 4) / 2)
    # a window cutting samples' periods counts only the overlap: [2.5, 4] is 0.5 s of 0.5, 1 s of 1.0
    assert busy.read(2.5, 4.0)["gpu/busy_frac/gpu0"] == pytest.approx((0.25 + 1.0) / 1.5)
    # a window inside one period: that sample's value
    assert busy.read(3.5, 3.6)["gpu/busy_frac/gpu1"] == pytest.approx(0.5)


def test_the_steps_parts_and_reads_since_the_last_one():
    clock = FakeClock()
    # one GPU: idle while rolling out (t <= 4), busy in the learner (4, 6], half in the sync (6, 7]
    busy = GpuBusy(scripted([(v,) for v in (0.2, 0.2, 0.2, 0.2, 1.0, 1.0, 0.5)]), clock=clock)
    busy.run = lambda: None  # sampled by hand here
    for t in range(1, 8):
        clock.now = float(t)
        busy.sample()
    got = busy.step(0.0, 4.0, 6.0, 7.0)
    assert set(got) == {"gpu/busy_frac", "gpu/busy_frac_rollout", "gpu/busy_frac_learner", "gpu/busy_frac_sync"}
    assert got["gpu/busy_frac"] == pytest.approx((0.2 * 4 + 1.0 * 2 + 0.5) / 7)  # the first sample's period: 1 s
    assert got["gpu/busy_frac_rollout"] == pytest.approx(0.2)
    assert got["gpu/busy_frac_learner"] == pytest.approx(1.0)
    assert got["gpu/busy_frac_sync"] == pytest.approx(0.5)
    # read() with no window: since the last read (the step's end), until now
    clock.now = 8.0
    assert busy.read()["gpu/busy_frac"] == pytest.approx(0.5)  # nothing sampled after 7: the last sample


def test_samples_outside_0_1_are_clipped():
    clock = FakeClock()
    busy = GpuBusy(scripted([(1.5,), (-1.0,)]), clock=clock)
    for t in (1.0, 2.0):
        clock.now = t
        busy.sample()
    assert busy.read(0.0, 2.0) == {"gpu/busy_frac": pytest.approx(0.5)}


def test_no_gpu_says_nothing():
    busy = GpuBusy(None)
    busy.sample()
    assert not busy.active and busy.read() == {} and busy.step(0.0, 1.0, 2.0, 3.0) == {}
    busy.close()
    assert window_mean([], 0.0, 1.0) == []


def test_the_thread_samples_until_closed():
    calls = []

    def source():
        calls.append(time.monotonic())
        return (0.75,)

    busy = GpuBusy(source, interval_s=0.005)
    t0 = time.monotonic()
    busy.run()
    time.sleep(0.1)
    busy.close()
    n = len(calls)
    assert n >= 3 and busy.read(t0, time.monotonic())["gpu/busy_frac"] == pytest.approx(0.75)
    time.sleep(0.03)
    assert len(calls) == n  # stopped
