"""The scheduler counts each worker death once. Runs the real `RolloutScheduler` on rl/rollout/simulate.py's
virtual clock against scripted workers: which call fails when, and how slowly a restarted worker answers."""
from __future__ import annotations

import asyncio

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from rl.config import RolloutConfig
from rl.rollout.scheduler import RolloutScheduler, SamplingPlan
from rl.rollout.simulate import VirtualClockLoop
from rl.types import WorkItem


class _Call:
    def __init__(self, fn) -> None:
        self.remote = fn


def _later(delay_s: float, value=None, error: BaseException | None = None) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle() -> None:
        if future.cancelled():  # a caller that stopped waiting (asyncio.wait_for's timeout)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    loop.call_later(delay_s, settle)
    return future


class _RestartingEnvWorker:
    """Down (dead, restarting) in each of the `down` windows of virtual seconds; each successor has a new
    pid and answers a ping after `ping_s` (a busy worker on a loaded machine)."""

    def __init__(self, down: list[tuple[float, float]], ping_s: float) -> None:
        self.down, self.ping_s = down, ping_s
        self.ping = _Call(self._ping)
        self.abort = _Call(lambda _prefix: _later(0.0))

    def _ping(self) -> asyncio.Future:
        now = asyncio.get_running_loop().time()
        if any(start <= now < end for start, end in self.down):
            return _later(0.0, error=RayActorError())
        return _later(self.ping_s, 100 + sum(end <= now for _, end in self.down))


class _RolloutWorker:
    """Each group's first attempt fails after the seconds `fails_after` gives, as a rollout worker's call
    to a dead environment worker does; every later attempt plays."""

    def __init__(self, fails_after: dict[str, float]) -> None:
        self.fails_after = fails_after
        self.run_group = _Call(self._run_group)
        self.ping = _Call(lambda: _later(0.0, 1))

    def _run_group(self, item: WorkItem) -> asyncio.Future:
        delay = self.fails_after.pop(item.uid, None)
        if delay is None:
            return _later(1.0, [])
        return _later(delay, error=RayTaskError("run_group", "", RayActorError()))


def _item(uid: str) -> WorkItem:
    return WorkItem(uid, "env", "t0", "medium", 2, 0, 16, 1.0, 1.0, index=0)


def _scheduler(workers: list, env_worker) -> RolloutScheduler:
    """The real scheduler over scripted rollout workers and one environment worker."""
    rollout = RolloutConfig(num_workers=len(workers), groups_per_step=2, group_size=2, groups_per_worker=2, max_slots=4)
    plan = SamplingPlan({"env": 1.0}, {"medium": 1.0}, {"medium": 16}, 2, 1.0, 1.0, 0)
    return RolloutScheduler(workers, [env_worker], {"env": {"train": ["t0"], "heldout": []}}, plan, rollout)


def _on_virtual_clock(coroutine):
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def _deaths_counted(starts: dict[str, float], fails_after: dict[str, float], env_worker) -> float:
    """Play a group per uid in `starts` (its first call at that virtual second) and return the environment
    worker deaths the scheduler counted."""
    scheduler = _scheduler([_RolloutWorker(fails_after)], env_worker)

    async def play(uid: str):
        await asyncio.sleep(starts[uid])
        return await scheduler._play(_item(uid))

    async def play_all():
        return await asyncio.gather(*(play(uid) for uid in starts))

    outcomes = _on_virtual_clock(play_all())
    assert all(o.error is None and o.reissued == 1 for o in outcomes), outcomes
    return scheduler.counters.get("faults/env_worker_deaths", 0.0)


def test_a_late_failure_of_a_call_made_before_the_death_was_counted_is_not_a_second_death():
    """Group b's call, made before the death, fails long after the successor answered; that successor
    answers pings slowly (5 s). Counting decided by a 2 s ping counted this death twice (CI saw it)."""
    env_worker = _RestartingEnvWorker(down=[(1.0, 3.0)], ping_s=5.0)
    assert _deaths_counted({"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 20.0}, env_worker) == 1


def test_a_successor_that_dies_too_is_a_second_death():
    """Group b's call is made after the first death was counted and the successor answered; the
    successor dies under it."""
    env_worker = _RestartingEnvWorker(down=[(1.0, 3.0), (31.0, 33.0)], ping_s=5.0)
    assert _deaths_counted({"a": 0.0, "b": 30.0}, {"a": 1.0, "b": 1.0}, env_worker) == 2


class _DyingRolloutWorker:
    """Dead from `died_at` until `back_at` (virtual seconds): the group in flight on it fails at its death,
    a weight push made meanwhile fails at once (Ray's ActorUnavailableError: the caller has not yet heard
    of the death), and the successor answers a ping with a new pid once back."""

    def __init__(self, died_at: float, back_at: float) -> None:
        self.died_at, self.back_at = died_at, back_at
        self.run_group = _Call(self._run_group)
        self.ping = _Call(self._ping)
        self.set_weights = _Call(self._set_weights)

    def _dead(self) -> bool:
        return self.died_at <= asyncio.get_running_loop().time() < self.back_at

    def _run_group(self, item: WorkItem) -> asyncio.Future:
        now = asyncio.get_running_loop().time()
        if now < self.died_at:
            return _later(self.died_at - now, error=RayActorError())
        return _later(1.0, [])

    def _ping(self) -> asyncio.Future:
        if self._dead():
            return _later(0.0, error=RayActorError())
        return _later(0.0, 1 if asyncio.get_running_loop().time() < self.died_at else 2)

    def _set_weights(self, _ref, _version) -> asyncio.Future:
        if self._dead():
            return _later(0.0, error=ActorUnavailableError("restarting", None))
        return _later(0.0)


class _SlowToLoadRolloutWorker:
    """Takes `load_s` to load pushed weights (the push to every worker ends with the slowest)."""

    def __init__(self, load_s: float) -> None:
        self.set_weights = _Call(lambda _ref, _version: _later(load_s))
        self.ping = _Call(lambda: _later(0.0, 7))
        self.run_group = _Call(lambda _item: _later(1.0, []))


def test_a_push_to_a_worker_already_known_dead_is_not_a_second_death():
    """Rollout worker 0 dies under a group at 1 s (counted) and is back at 3 s; weights pushed at 1.5 s fail
    on it at once, but the push ends only when worker 1 has loaded them (6.5 s), after the successor
    answered. Counting that failed push as a death counted one kill twice (CI saw it, async)."""
    scheduler = _scheduler([_DyingRolloutWorker(died_at=1.0, back_at=3.0), _SlowToLoadRolloutWorker(5.0)],
                           _RestartingEnvWorker(down=[], ping_s=0.0))

    async def push_later():
        await asyncio.sleep(1.5)
        await scheduler.set_weights(["weights"], 1)

    async def both():
        return await asyncio.gather(scheduler._play(_item("a")), push_later())

    outcome, _ = _on_virtual_clock(both())
    assert outcome.error is None and outcome.reissued == 1, outcome
    assert scheduler.counters.get("faults/rollout_worker_deaths") == 1.0, scheduler.counters
