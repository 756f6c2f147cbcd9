"""The rollout scheduler: a Ray actor (asyncio) between the rollout workers and the learner.

It draws GRPO groups from a deterministic stream (environment by per-domain weight, task, effort
level; group n depends only on (seed, n)), plays them on the rollout workers, and hands the
learner batches of `groups_per_step` whole groups, as an object reference the driver never opens.

One scheduler, two modes, set by `max_staleness` k:
- k = 0 (synchronous): a step's groups all start from the weights that step trains; the next
  step's groups wait for the new weights. The same config and seed give the same samples.
- k > 0: rollout runs up to k policy versions ahead of the learner. Groups keep running while the
  learner trains (partial rollouts: an episode continues under new weights, each token records the
  version that sampled it); a group that could only be trained with staleness above k is aborted
  and re-issued, never trained on.
Admission (AReaL's rule): groups in flight plus groups ready count towards the batch they will
land in, which may be at most k versions ahead of the newest weights.

Groups whose rewards all agree are dropped and replaced by new draws (dynamic sampling), up to a
cap per step. A dead worker's groups are re-issued, so no group is lost or counted twice; a group
whose environment keeps raising is reported and left out. Rollout and environment workers that die
are restarted by Ray: groups wait until the worker answers again, each death and the groups it
cut off are counted and said in the batch report, and a worker Ray will not restart again stops
the run (`next_batch` raises WorkerLost)."""
from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from rl.config import LevelShaping, RolloutConfig
from rl.faults import first_line
from rl.metrics import rollout_metrics
from rl.shaping import shape_rewards
from rl.rollout.adaptive import AdaptiveWeights, distribution, draw
from rl.rollout.env_worker import EpisodeLost
from rl.rollout.worker import NoWeightsError
from rl.types import RolloutBatch, RolloutRecord, Sample, WorkItem, env_worker_index

WORKER_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError)
RESTART_TIMEOUT_S = 300.0  # a worker Ray restarts must answer again within this


DEATH_METRICS = {"rollout worker": "faults/rollout_worker_deaths", "environment worker": "faults/env_worker_deaths"}
DEAD = 0  # in `pids`: the worker's death is counted, the next pid is its successor's


class WorkerLost(RuntimeError):
    """A worker died and will not come back (Ray's restarts for it are used up): the run cannot go on."""


def worker_died(exc: BaseException) -> bool:
    """Whether a call failed because the actor called died (a RayTaskError is its own error, or one
    of its arguments': weights whose owner, the learner, died arrive as RayTaskError(ActorDiedError))."""
    return isinstance(exc, WORKER_FAILURES) and not isinstance(exc, RayTaskError)


def env_worker_fault(exc: BaseException) -> BaseException | None:
    """Why a group failed, when its environment worker died under it: the rollout worker answered
    (a RayTaskError), and what it raised is a failed call to the environment worker (a RayActorError)
    or an episode its restarted successor does not hold (EpisodeLost). None otherwise."""
    if not isinstance(exc, RayTaskError):
        return None  # the rollout worker itself died
    cause = exc.cause
    while not isinstance(cause, (RayActorError, EpisodeLost)):
        if not isinstance(cause, RayTaskError):
            return None
        cause = cause.cause
    return cause


@dataclass(frozen=True)
class SamplingPlan:
    env_weights: dict[str, float]
    effort_weights: dict[str, float]
    effort_budgets: dict[str, int]
    group_size: int
    temperature: float
    top_p: float
    seed: int
    # effort.shaping: a group is uniform when the rewards the learner trains on (shaped) all agree
    shaping: Mapping[str, LevelShaping] = field(default_factory=dict)

    @functools.cached_property
    def _envs(self) -> tuple[list[str], np.ndarray]:  # once: a run may draw from thousands of domains
        return distribution(self.env_weights)

    @functools.cached_property
    def _levels(self) -> tuple[list[str], np.ndarray]:
        return distribution(self.effort_weights)

    def item(self, index: int, task_ids: dict[str, list[str]],
             env_weights: tuple[list[str], np.ndarray] | None = None) -> WorkItem:
        """Training group `index` of the run's stream: a pure function of (seed, index), and of
        `env_weights` (adaptive sampling's, rl.rollout.adaptive.distribution) when given."""
        rng = np.random.default_rng([self.seed, index])
        envs, env_cdf = env_weights or self._envs
        levels, level_cdf = self._levels
        env = envs[draw(rng, env_cdf)]
        level = levels[draw(rng, level_cdf)]
        tasks = task_ids[env]
        task = tasks[int(rng.integers(len(tasks)))]
        return WorkItem(uid=f"g{index}", env=env, task_id=task, effort=level, group_size=self.group_size,
                        seed=int(rng.integers(2**31)), max_new_tokens=self.effort_budgets[level],
                        temperature=self.temperature, top_p=self.top_p, index=index)


@dataclass
class GroupOutcome:
    item: WorkItem
    samples: list[Sample] | None  # None: the group failed (its errors say why)
    reissued: int = 0
    error: str | None = None


@dataclass
class EvalResult:
    """Held-out episodes, and one line for each group left out because it failed (uid: error)."""

    samples: list[Sample]
    failed: list[str] = field(default_factory=list)

    def failure_line(self) -> str | None:
        """What the evaluation left out, for the console; None when nothing."""
        if not self.failed:
            return None
        return (f"evaluation: {len(self.failed)} held-out group(s) failed and were left out of the table "
                f"(first: {self.failed[0]})")


@dataclass
class BatchReport:
    """What the driver logs about a batch, without opening it."""

    step: int
    groups: int
    metrics: dict[str, float]
    records: list[RolloutRecord]  # one per sample, for rollouts.jsonl
    errors: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # workers that died since the last batch, one line each


class RolloutScheduler:
    def __init__(self, workers: list, env_workers: list, task_ids: dict[str, dict[str, list[str]]],
                 plan: SamplingPlan, cfg: RolloutConfig) -> None:
        self.workers = list(workers)
        self.env_workers = list(env_workers)
        self.task_ids = task_ids  # env -> split -> task ids
        self.train_ids = {env: ids["train"] for env, ids in task_ids.items()}  # what the stream draws from
        self.plan = plan
        self.cfg = cfg
        self.load = [0] * len(self.workers)
        self._attempt_ids = itertools.count(1)
        self.down: dict[int, asyncio.Task] = {}  # workers restarting (Ray restarts them): not given groups
        self.weights_ref: list = []  # [ObjectRef] of the newest weights, wrapped so Ray does not fetch it here
        self.version = -1  # newest policy version pushed to the workers
        self._changed = asyncio.Condition()
        # training stream
        self._producer: asyncio.Task | None = None
        self.next_index = 0
        self.reissue: deque[WorkItem] = deque()
        self.flights: dict[str, asyncio.Task] = {}  # uid -> task playing the group
        self.flight_version: dict[str, int] = {}  # uid -> newest weights when it was issued
        self.ready: dict[str, list[Sample]] = {}  # whole informative groups not yet trained on
        self.ready_items: dict[str, WorkItem] = {}
        self.batches_taken = 0  # the training step the next batch is for
        self.draws_since_batch = 0  # new draws since the last batch was taken (capped)
        self.fresh: set[str] = set()  # uids drawn since the last batch (a resumed run replays them as draws)
        self.redraw: deque[WorkItem] = deque()  # a resumed run's draws since its checkpoint's batch, replayed
        self.dropped: dict[int, list[Sample]] = {}  # groups dropped since the last batch, by stream index
        self.dropped_items: dict[int, WorkItem] = {}
        self.counters: dict[str, float] = {}
        self.errors: list[str] = []
        # adaptive sampling (rollout.adaptive): domain weights by the pass rates the batches show
        self.adaptive = AdaptiveWeights(plan.env_weights, cfg.adaptive) if cfg.adaptive.enabled else None
        # worker faults (rl.rollout.scheduler's recovery paths): "rollout worker 0" / "environment worker 1" ->
        self.pids: dict[str, int] = {}  # the process that last answered (DEAD: its death is counted)
        self.deaths: dict[str, int] = {}  # deaths counted per worker, over the run
        self.died: set[str] = set()  # died since the last batch
        self.cut_off: dict[str, int] = {}  # groups it cut off since the last batch (played again)
        self.env_back: dict[int, asyncio.Task] = {}  # environment workers being waited for
        self.awaited: dict[str, float] = {}  # workers waited for (restarting), since when (monotonic)
        self.fatal: str | None = None  # a worker that will not come back: the run stops

    # -- weights ---------------------------------------------------------------------------------
    async def set_weights(self, wrapped_ref: list, version: int) -> float:
        """Push new weights to every worker (each loads them between two forward passes); drop what
        could now only be trained too stale. Returns the seconds the push took."""
        started = time.monotonic()
        # the deaths counted before the push; None for a worker known to be restarting: its push failing
        # is that death again (a failure Ray gives at once, read only when the slowest worker has loaded)
        seen = [None if w in self.down else self._deaths_of(f"rollout worker {w}") for w in range(len(self.workers))]
        pushes = [w.set_weights.remote(wrapped_ref[0], version) for w in self.workers]
        for w, outcome in enumerate(await asyncio.gather(*pushes, return_exceptions=True)):
            if worker_died(outcome):  # restarting: it gets them when back
                self._worker_down(w, died_after=seen[w])
            elif isinstance(outcome, BaseException):  # e.g. the weights are gone: the learner died
                raise outcome
        async with self._changed:
            self.weights_ref, self.version = wrapped_ref, version
            self._retire_stale()
            self._changed.notify_all()
        return time.monotonic() - started

    def _retire_stale(self) -> None:
        """Groups that could only land in a step more than max_staleness versions after their
        weights: abort (in flight) or discard (ready), and play them again."""
        oldest_allowed = self.version - self.cfg.max_staleness
        for uid, version in list(self.flight_version.items()):
            if version < oldest_allowed:
                self._abort(uid)
        for uid, samples in list(self.ready.items()):
            if oldest_version(samples) < oldest_allowed:
                self.reissue.append(self.ready_items.pop(uid))
                del self.ready[uid]
                self._count("async/aborted_groups")

    def _abort(self, uid: str) -> None:
        task = self.flights.pop(uid)
        self.flight_version.pop(uid)
        task.cancel()
        self.reissue.append(task.item)  # type: ignore[attr-defined]
        self._count("async/aborted_groups")

    def _count(self, name: str, n: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + n

    # -- training stream -------------------------------------------------------------------------
    async def start_training(self, resume: "StreamPosition | None" = None) -> None:
        """Start producing groups; a resumed run passes its checkpoint's position: the groups issued
        but not trained on are played again first, in stream order, each counted as it was (a draw
        since the last batch again counts toward the draw cap), so a synchronous run trains on
        exactly what an uninterrupted one does."""
        position = resume or StreamPosition()
        self.next_index = position.next_index
        self.batches_taken = position.batches_taken
        if self.adaptive is not None and position.sampling:
            self.adaptive.restore(position.sampling)
        drawn = set(position.drawn)
        for item in sorted(position.pending, key=lambda it: it.index):
            (self.redraw if item.uid in drawn else self.reissue).append(item)
        self._producer = asyncio.get_running_loop().create_task(self._produce())

    def snapshot(self) -> "StreamPosition":
        """What a checkpoint needs to resume the stream: every group issued and neither trained on nor
        reported (played again), which of them were drawn since the last batch, and the step the
        next batch is for. Nothing trained twice, nothing skipped."""
        pending = [*self.redraw, *self.reissue, *(t.item for t in self.flights.values()),  # type: ignore[attr-defined]
                   *self.ready_items.values(), *self.dropped_items.values()]
        pending.sort(key=lambda it: it.index)
        return StreamPosition(self.next_index, self.batches_taken, pending,
                              sorted(uid for uid in self.fresh if any(it.uid == uid for it in pending)),
                              self.adaptive.to_dict() if self.adaptive is not None else None)

    async def stop_training(self) -> None:
        if self._producer is not None:
            self._producer.cancel()
        for uid in list(self.flights):
            task = self.flights.pop(uid)
            self.flight_version.pop(uid, None)
            task.cancel()
        await asyncio.sleep(0)

    def _room(self) -> bool:
        """AReaL's admission rule: the batch a new group would land in is at most max_staleness
        versions ahead of the newest weights, and a worker has a free place for it."""
        if self.version < 0 or self._free_worker() is None:
            return False
        # (a resumed run's replayed draws were within the cap when first drawn)
        if not self.reissue and not self.redraw and self.draws_since_batch >= self._draw_cap():
            return False  # dynamic sampling at its cap: the next batch takes what is ready
        live = len(self.flights) + len(self.ready)
        landing_batch = self.batches_taken + live // self.cfg.groups_per_step
        return landing_batch <= self.version + self.cfg.max_staleness

    async def _produce(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(self._room)
                item = self.reissue.popleft() if self.reissue else self._draw()
                task = asyncio.get_running_loop().create_task(self._play(item))
                task.item = item  # type: ignore[attr-defined]
                self.flights[item.uid] = task
                self.flight_version[item.uid] = self.version
                task.add_done_callback(lambda t, uid=item.uid: asyncio.ensure_future(self._landed(uid, t)))

    def _draw_cap(self) -> float:
        return self.cfg.max_draws_per_step * self.cfg.groups_per_step

    def _draw(self) -> WorkItem:
        """The next group of the stream (or, resuming, the next one drawn before the checkpoint)."""
        if self.redraw:
            item = self.redraw.popleft()
        else:
            item = self.plan.item(self.next_index, self.train_ids,
                                  self.adaptive.distribution() if self.adaptive is not None else None)
            self.next_index += 1
        self.draws_since_batch += 1
        self.fresh.add(item.uid)
        self._count("rollout/drawn_groups")
        return item

    async def _landed(self, uid: str, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        async with self._changed:
            if self.flights.get(uid) is not task:
                return  # aborted meanwhile
            del self.flights[uid]
            self.flight_version.pop(uid, None)
            outcome: GroupOutcome = task.result()
            self._count("rollout/reissued", outcome.reissued)
            if outcome.samples is None:
                self._count("rollout/failed_groups")
                self.errors.append(outcome.error or f"group {uid} failed")
            elif self.cfg.drop_uniform_groups and len(set(shape_rewards(outcome.samples, self.plan.shaping)[0])) == 1:
                self._count("rollout/dropped_uniform_groups")
                self.dropped[outcome.item.index] = outcome.samples
                self.dropped_items[outcome.item.index] = outcome.item
            elif oldest_version(outcome.samples) < self.version - self.cfg.max_staleness:
                self.reissue.append(outcome.item)  # finished, but only under weights now too old
                self._count("async/aborted_groups")
            else:
                self.ready[uid] = outcome.samples
                self.ready_items[uid] = outcome.item
            self._changed.notify_all()

    async def next_batch(self, step: int) -> tuple[list, BatchReport]:
        """The next `groups_per_step` ready groups (oldest in the stream first), as [ObjectRef]. With
        dynamic sampling at its cap, the ready groups so far (fewer) make the batch."""
        need = self.cfg.groups_per_step
        started = time.monotonic()
        await self._notice_restarts()
        async with self._changed:

            def enough() -> bool:
                capped = self.draws_since_batch >= self._draw_cap() and not self.reissue and not self.redraw
                return len(self.ready) >= need or (capped and not self.flights)

            await self._changed.wait_for(lambda: self.fatal is not None or enough())
            if self.fatal is not None:
                raise WorkerLost(self.fatal)
            self.draws_since_batch = 0
            self.fresh = set()
            uids = sorted(self.ready, key=lambda u: self.ready_items[u].index)[:need]
            samples = [s for u in uids for s in self.ready.pop(u)]
            for u in uids:
                self.ready_items.pop(u)
            self.batches_taken += 1
            counters, self.counters = self.counters, {}
            errors, self.errors = self.errors, []
            faults = self._fault_lines()
            dropped = [s for index in sorted(self.dropped) for s in self.dropped[index]]  # stream order
            self.dropped, self.dropped_items = {}, {}
            if self.adaptive is not None:  # before the next draw: the stream weighs what this batch showed
                self.adaptive.observe(samples + dropped)
            self._changed.notify_all()
        # rollout statistics cover every group reported now, dropped ones included (dropping the
        # all-correct and all-wrong groups would bias the reward curve)
        metrics = rollout_metrics(samples + dropped, step)
        if self.adaptive is not None:
            metrics.update(self.adaptive.metrics())
        metrics.update({k: v for k, v in counters.items() if k != "rollout/drawn_groups"})
        metrics["rollout/trained_samples"] = float(len(samples))
        metrics["rollout/refilled_groups"] = max(0.0, counters.get("rollout/drawn_groups", 0.0) - len(uids))
        metrics["time/batch_wait_s"] = time.monotonic() - started
        records = [rollout_record(step, s, trained=True) for s in samples]
        records += [rollout_record(step, s, trained=False) for s in dropped]
        report = BatchReport(step, len(uids), metrics, records, errors, faults)
        return [ray.put(RolloutBatch(step, samples))], report

    # -- playing one group ------------------------------------------------------------------------
    def _free_worker(self) -> int | None:
        """The least-loaded worker that is up and has room for another group."""
        up = [w for w in range(len(self.workers)) if w not in self.down and self.load[w] < self.cfg.groups_per_worker]
        return min(up, key=lambda w: self.load[w]) if up else None

    async def _play(self, item: WorkItem) -> GroupOutcome:
        """Run one group to completion on some worker. A group cut off by a worker's death is played
        again once the worker answers again (Ray restarts rollout and environment workers), a group
        that raised is played again at once; either `max_retries` times at most."""
        attempts, reissued = 0, 0
        env = env_worker_index(item.env, len(self.env_workers))
        while True:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self.fatal is not None or any(w not in self.down for w in range(len(self.workers))))
            if env in self.env_back:  # its environment worker is restarting: a group sent now would fail
                await asyncio.shield(self.env_back[env])
            if self.fatal is not None:
                return GroupOutcome(item, None, reissued, self.fatal)
            w = min((w for w in range(len(self.workers)) if w not in self.down), key=lambda w: self.load[w])
            self.load[w] += 1
            # every attempt has its own episode ids: a cancelled attempt's clean-up, arriving late,
            # can never release the episodes of the next one
            item = replace(item, attempt=next(self._attempt_ids))
            # the deaths counted before the call: a failure of a call made before a death was counted
            # is that death, not another one
            seen_w, seen_env = self._deaths_of(f"rollout worker {w}"), self._deaths_of(f"environment worker {env}")
            ref = self.workers[w].run_group.remote(item)
            try:
                return GroupOutcome(item, await ref, reissued)
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            except (RayTaskError, *WORKER_FAILURES) as exc:  # (NoWeightsError arrives as a RayTaskError)
                failure = exc
            finally:
                self.load[w] -= 1
            if isinstance(failure, NoWeightsError):  # restarted between two calls: nothing was played
                await self._recover_worker(w, item, died_after=None)
                reissued += 1
                continue
            attempts += 1
            if env_worker_fault(failure) is not None:
                self._cut_off(f"environment worker {env}")
                await self._env_worker_back(env, died_after=seen_env)
            elif isinstance(failure, RayTaskError):  # the group itself raised (a broken task or environment)
                await self._abort_episodes(item)
                if attempts > self.cfg.max_retries:
                    return GroupOutcome(item, None, reissued,
                                        f"{item.uid} ({item.env} task {item.task_id}): {first_line(failure)}")
                continue
            else:  # the rollout worker died
                self._cut_off(f"rollout worker {w}")
                await self._recover_worker(w, item, died_after=seen_w)
            if attempts > self.cfg.max_retries:
                return GroupOutcome(item, None, reissued,
                                    f"group {item.uid} failed {attempts} times; last: {first_line(failure)}")
            reissued += 1

    async def _recover_worker(self, w: int, item: WorkItem, died_after: int | None) -> None:
        await self._abort_episodes(item)
        self._worker_down(w, died_after)

    def _worker_down(self, w: int, died_after: int | None) -> None:
        """The actor restarts on its own (max_restarts) and comes back without weights: no group
        goes to it until it answers again and holds the current weights. died_after: a call to it
        failed, made when its deaths counted were this many (None: it did not die)."""
        if died_after is not None:
            self._count_failed_call(f"rollout worker {w}", died_after)
        if w not in self.down:
            self.down[w] = asyncio.get_running_loop().create_task(self._bring_back(w))

    def _deaths_of(self, name: str) -> int:
        return self.deaths.get(name, 0)

    def _count_failed_call(self, name: str, died_after: int) -> None:
        """A call to a worker failed: its death is counted unless a death was counted since the call
        was made (the late failure of a call to the predecessor: a ping's answer decided that before,
        and a successor slow to answer it under load counted one death twice)."""
        if self._deaths_of(name) == died_after and self.pids.get(name) != DEAD:
            self._died(name)

    async def _bring_back(self, w: int) -> None:
        try:
            while await self._answers(f"rollout worker {w}", self.workers[w]) is not None:
                if not self.weights_ref:
                    return
                try:
                    await self.workers[w].set_weights.remote(self.weights_ref[0], self.version)
                    return
                except WORKER_FAILURES as exc:
                    if not worker_died(exc):  # the weights are gone (the learner died): the driver stops
                        return
                    continue  # died again before it took them
        finally:  # back, or gone for good (`fatal` stops the run)
            async with self._changed:
                self.down.pop(w, None)
                self._changed.notify_all()

    async def _env_worker_back(self, e: int, died_after: int) -> None:
        """Wait until environment worker e answers again. Every group it cut off waits on one ping,
        shielded: a group aborted meanwhile must not cancel the others' wait. Its death is counted
        once (_count_failed_call: counting at each failed call counted one death six times in a
        14-step run)."""
        name = f"environment worker {e}"
        self._count_failed_call(name, died_after)
        waiting = self.env_back.get(e)
        if waiting is None or waiting.done():
            answers = self._answers(name, self.env_workers[e])
            waiting = self.env_back[e] = asyncio.get_running_loop().create_task(answers)
        await asyncio.shield(waiting)

    async def _answers(self, name: str, actor) -> int | None:
        """Wait until a worker Ray restarts answers again: its pid, or None when it never will (the
        run stops; `fatal` says why)."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        delay = 0.2
        self.awaited.setdefault(name, time.monotonic())
        try:
            return await self._answer_loop(name, actor, deadline, delay)
        finally:
            self.awaited.pop(name, None)

    def waiting_on(self, longer_than_s: float) -> list[tuple[str, float]]:
        """(worker, seconds) of the restarting workers waited for longer than `longer_than_s`: a lost
        node's workers wait until a node with room for them joins (the driver says so)."""
        now = time.monotonic()
        return [(name, now - since) for name, since in self.awaited.items() if now - since > longer_than_s]

    async def _answer_loop(self, name: str, actor, deadline: float, delay: float) -> int | None:
        while True:
            try:
                pid = await actor.ping.remote()
            except ActorDiedError:  # Ray says so only once the actor's restarts are used up
                await self._stop(f"{name} died for good: Ray's restarts for it are used up")
                return None
            except WORKER_FAILURES:  # restarting
                if time.monotonic() > deadline:
                    await self._stop(f"{name} died for good: it did not answer within {RESTART_TIMEOUT_S:.0f} s "
                                     f"of its death")
                    return None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
                continue
            self._note_pid(name, pid, after_fault=True)
            return pid

    def _died(self, name: str) -> None:
        """Count a worker's death, once: the next pid it answers with is its successor's."""
        self.pids[name] = DEAD
        self.deaths[name] = self._deaths_of(name) + 1
        self.died.add(name)
        self._count(DEATH_METRICS[name.rsplit(" ", 1)[0]])

    def _note_pid(self, name: str, pid: int, after_fault: bool) -> None:
        """A pid other than the one known is a death not counted yet (the worker died between two
        calls, or while idle). The first pid seen is a successor's only when a fault led here."""
        known = self.pids.get(name)
        if known not in (pid, DEAD) and (known is not None or after_fault):
            self._died(name)
        self.pids[name] = pid

    def _cut_off(self, name: str) -> None:
        self.cut_off[name] = self.cut_off.get(name, 0) + 1
        self._count("faults/cut_off_groups")

    async def _stop(self, reason: str) -> None:
        async with self._changed:
            self.fatal = self.fatal or reason
            self._changed.notify_all()

    async def _notice_restarts(self) -> None:
        """Every worker's pid: a death that cut off no group (the worker was idle, or came back
        before its next call) is counted too. A worker that does not answer now is restarting: its
        next call fails, which counts it."""
        named = [*((f"rollout worker {w}", a) for w, a in enumerate(self.workers) if w not in self.down),
                 *((f"environment worker {e}", a) for e, a in enumerate(self.env_workers))]
        answers = await asyncio.gather(*[asyncio.wait_for(a.ping.remote(), 10.0) for _, a in named],
                                       return_exceptions=True)
        for (name, _), pid in zip(named, answers):
            if isinstance(pid, int):
                self._note_pid(name, pid, after_fault=False)

    def _fault_lines(self) -> list[str]:
        """One line per worker that died since the last batch: what it cut off."""
        lines = []
        for name in sorted({*self.died, *self.cut_off}):
            n = self.cut_off.get(name, 0)
            if name in self.died:
                lines.append(f"{name} died; Ray restarts it and the {n} group(s) it cut off are played again" if n
                             else f"{name} died; Ray restarts it (no group was cut off)")
            else:  # its death was said at an earlier batch
                lines.append(f"{n} more group(s) cut off by {name}'s death are played again")
        self.died, self.cut_off = set(), {}
        return lines

    async def _abort_episodes(self, item: WorkItem) -> None:
        """Close the half-played episodes (and sandboxes) of a group that will not finish. An
        environment worker that is restarting or gone holds none: they died with its process."""
        env_worker = self.env_workers[env_worker_index(item.env, len(self.env_workers))]
        try:
            await env_worker.abort.remote(item.episode_prefix)
        except WORKER_FAILURES:
            pass

    # -- evaluation -------------------------------------------------------------------------------
    def plan_eval(self, env: str, efforts: list[str], n_tasks: int, samples: int, temperature: float,
                  tag: str) -> list[WorkItem]:
        tasks = self.task_ids[env]["heldout"][:n_tasks]
        return [WorkItem(uid=f"{tag}/{env}/{level}/{t}", env=env, task_id=task, effort=level, group_size=samples,
                         seed=t, max_new_tokens=self.plan.effort_budgets[level], temperature=temperature, top_p=1.0)
                for level in efforts for t, task in enumerate(tasks)]

    async def evaluate(self, envs: list[str], efforts: list[str], n_tasks: int, samples: int, temperature: float,
                       tag: str) -> EvalResult:
        """Held-out episodes, every group played to completion (failed groups are left out, and named)."""
        await self._notice_restarts()  # the pids a fault is told by
        items = [it for env in envs for it in self.plan_eval(env, efforts, n_tasks, samples, temperature, tag)]
        room = asyncio.Semaphore(self.cfg.groups_per_worker * len(self.workers))

        async def one(item: WorkItem) -> GroupOutcome:
            async with room:
                return await self._play(item)

        outcomes = await asyncio.gather(*[one(it) for it in items])
        if self.fatal is not None:
            raise WorkerLost(self.fatal)
        return EvalResult([s for o in outcomes if o.samples for s in o.samples],
                          [f"{o.item.uid} ({o.item.env}): {o.error}" for o in outcomes if not o.samples])


def rollout_record(step: int, s: Sample, trained: bool) -> RolloutRecord:
    """One line of rollouts.jsonl: what the sample was asked, what it did, how it was graded, and
    whether the learner trained on it (a group whose rewards all agree is dropped)."""
    return {"step": step, "uid": s.uid, "group": s.group_uid, "trained": trained, "env": s.env, "domain": s.domain,
            "task_id": s.task_id, "effort": s.effort, "reward": s.reward, "passed": s.passed,
            "version": s.weight_version, "versions": [s.weight_version, s.newest_version],
            # None: the sample generated no token, so no weights sampled it
            "staleness": step - s.weight_version if s.weight_version >= 0 else None,
            "engine": s.engine, "tokens": s.response_tokens, "sequence_tokens": len(s.tokens),
            "turns": s.num_turns, "truncated": s.truncated, "phase_s": s.phase_s, "error": s.grade_error,
            # the effort budget: what it allowed, the reasoning among `tokens`, what it forced or cut
            "budget": s.budget, "reasoning_tokens": s.reasoning_tokens, "forced_turns": s.forced_turns,
            "budget_cut": s.budget_cut,
            "grade": s.grade_details, "transcript": s.transcript}


def oldest_version(samples: list[Sample]) -> int:
    """The oldest weights that sampled a token of the group. A sample with no generated token (a turn
    budget used up by its prompt) was sampled by no weights and is never stale: it does not count;
    a group of only such samples is as fresh as the newest weights."""
    versions = [s.weight_version for s in samples if s.weight_version >= 0]
    return min(versions) if versions else np.iinfo(np.int64).max


@dataclass
class StreamPosition:
    """Where a run's stream of training groups stands at a checkpoint (scheduler.json)."""

    next_index: int = 0  # the next stream index to draw
    batches_taken: int = 0  # the training step the next batch is for
    pending: list[WorkItem] = field(default_factory=list)  # issued, neither trained on nor reported
    drawn: list[str] = field(default_factory=list)  # uids among `pending` drawn since the last batch
    sampling: dict[str, Any] | None = None  # adaptive sampling's state after the last batch (rl/rollout/adaptive.py)

    def to_dict(self) -> dict[str, Any]:
        return {"next_index": self.next_index, "batches_taken": self.batches_taken,
                "pending": [vars(it) for it in self.pending], "drawn": self.drawn, "sampling": self.sampling}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StreamPosition":
        return cls(int(data["next_index"]), int(data["batches_taken"]), [WorkItem(**d) for d in data["pending"]],
                   list(data.get("drawn", [])), data.get("sampling"))
