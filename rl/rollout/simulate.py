"""A discrete-event simulation of the rollout scheduler at lab scale, run through the real
`RolloutScheduler` (admission, dispatch, staleness bound, partial rollouts, dynamic sampling, batching)
on a virtual clock, with no Ray.

The event loop's clock jumps to the next timer whenever nothing is ready, so an hour of cluster time
costs only the CPU the code spends. Around the scheduler: simulated rollout workers (each plays up to
`groups_per_worker` groups; a group's episodes run at once, each holding a sandbox from a shared pool
for a long-tailed, lognormal time), environment workers (abort only), a learner that takes
`learn_s` a step, and a weight push of `sync_s` to every worker. Rewards are Bernoulli in each
domain's pass rate, so dynamic sampling drops and redraws as in a run. What it measures: the
scheduler's CPU time per step (all the process's CPU but the simulated world's own callbacks and the
driver's bookkeeping: an upper bound), the driver's bookkeeping of each batch (its metrics line, every
sample's record to rollouts.jsonl, the hack monitor), the staleness of the trained samples, and the
idle share of the rollout workers' group places, the sandboxes and the learner."""
from __future__ import annotations

import asyncio
import contextlib
import json
import selectors
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from rl.config import RolloutConfig
from rl.hack_monitor import HackMonitor, responses_from_records
from rl.rollout import scheduler as scheduler_module
from rl.rollout.scheduler import RolloutScheduler, SamplingPlan
from rl.run_folder import ROLLOUTS, append_jsonl
from rl.types import Sample, WorkItem


class _VirtualSelector(selectors.DefaultSelector):
    """A selector that never blocks: waiting `timeout` seconds moves the virtual clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):  # type: ignore[override]
        ready = super().select(0)
        if not ready and timeout is None:
            raise RuntimeError("simulation deadlock: nothing scheduled and nothing ready")
        if not ready and timeout:
            self.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


@dataclass
class SimConfig:
    rollout_workers: int = 1000
    groups_per_worker: int = 2
    sandboxes: int = 10_000
    domains: int = 2000
    tasks_per_domain: int = 64
    groups_per_step: int = 1024
    group_size: int = 8
    max_staleness: int = 0
    steps: int = 12
    warmup_steps: int = 2  # not measured: the pipeline fills
    episode_median_s: float = 20.0  # lognormal episode wall time (tools, sandboxes, generation)
    episode_sigma: float = 1.2  # p99 / median = exp(2.33 sigma): 16x at 1.2
    episode_cap_s: float = 1800.0
    learn_s: float = 30.0
    sync_s: float = 2.0
    seed: int = 0
    pass_rates: tuple[float, ...] | None = None  # each domain's in turn; None: drawn from Beta(0.6, 0.6)
    adaptive: bool = False  # rollout.adaptive.enabled
    transcript_chars: int = 2000  # each sample's transcript, as rollouts.jsonl records it


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


@dataclass
class _Group:
    item: WorkItem
    worker: "_Worker"
    future: asyncio.Future
    pending: int
    started: float
    handles: list[asyncio.TimerHandle] = field(default_factory=list)
    on_slot: bool = False  # playing on one of its worker's slots (else in the worker's backlog)
    holding: int = 0  # sandboxes held now
    waiting: int = 0  # episodes queued for a sandbox
    samples: list[Sample] = field(default_factory=list)


class _Worker:
    def __init__(self, world: "World", index: int) -> None:
        self.world, self.index, self.version = world, index, -1
        self.running = 0  # groups its engine plays now (at most groups_per_worker: its slots)
        self.backlog: deque[_Group] = deque()  # groups sent beyond that, waiting for a slot
        self.run_group = _Method(lambda item: world.start_group(self, item))
        self.set_weights = _Method(lambda _ref, version: world.push(self, version))
        self.ping = _Method(lambda: world.done(1000 + index))


class _EnvWorker:
    def __init__(self, world: "World", index: int) -> None:
        self.abort = _Method(lambda _prefix: world.done(0))
        self.ping = _Method(lambda: world.done(index + 1))


class World:
    """Rollout workers, sandboxes and episodes in virtual time; `cpu_s` is what its callbacks cost."""

    def __init__(self, cfg: SimConfig, loop: asyncio.AbstractEventLoop, pass_rate: dict[str, float]) -> None:
        self.cfg, self.loop, self.pass_rate = cfg, loop, pass_rate
        self.rng = np.random.default_rng(cfg.seed)
        self.workers = [_Worker(self, i) for i in range(cfg.rollout_workers)]
        self.env_workers = [_EnvWorker(self, i) for i in range(max(1, cfg.rollout_workers // 50))]
        self.free_sandboxes = cfg.sandboxes
        self.queue: deque[_Group] = deque()  # episodes waiting for a sandbox, a group's at a time
        self.cpu_s = 0.0
        self.most_backlog = 0  # the most groups one worker held beyond its slots (admission's overshoot)
        self.running_groups = 0  # groups on workers' slots now
        self.busy_since = 0.0
        self.group_time = 0.0  # integral of running groups over time
        self.sandbox_time = 0.0  # integral of held sandboxes over time
        turn = "x" * (cfg.transcript_chars // 4)
        self.transcript = [{"role": role, "content": turn} for role in ("system", "user", "assistant", "tool")]

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.process_time()
        try:
            yield
        finally:
            self.cpu_s += time.process_time() - t0

    def done(self, value: Any) -> asyncio.Future:
        fut = self.loop.create_future()
        fut.set_result(value)
        return fut

    def _account(self) -> None:
        now = self.loop.time()
        self.group_time += self.running_groups * (now - self.busy_since)
        self.sandbox_time += (self.cfg.sandboxes - self.free_sandboxes) * (now - self.busy_since)
        self.busy_since = now

    def push(self, worker: _Worker, version: int) -> asyncio.Future:
        fut = self.loop.create_future()

        def loaded() -> None:
            worker.version = version
            fut.set_result(None)
        self.loop.call_later(self.cfg.sync_s, loaded)
        return fut

    def start_group(self, worker: _Worker, item: WorkItem) -> asyncio.Future:
        with self._timed():
            group = _Group(item, worker, self.loop.create_future(), item.group_size, self.loop.time())
            group.future.add_done_callback(lambda f: self._ended(group))
            if worker.running < self.cfg.groups_per_worker:
                self._on_slot(group)
            else:
                worker.backlog.append(group)
                self.most_backlog = max(self.most_backlog, len(worker.backlog))
            return group.future

    def _on_slot(self, group: _Group) -> None:
        """A group takes one of its worker's slots; its episodes queue for sandboxes."""
        self._account()
        group.worker.running += 1
        group.on_slot = True
        self.running_groups += 1
        group.waiting = group.item.group_size
        self.queue.append(group)
        self._hand_out()

    def _hand_out(self) -> None:
        """Sandboxes to the queued episodes, first come first served."""
        while self.queue and self.free_sandboxes:
            group = self.queue[0]
            take = min(group.waiting, self.free_sandboxes)
            self.free_sandboxes -= take
            group.waiting -= take
            group.holding += take
            for _ in range(take):
                spread = float(np.exp(self.cfg.episode_sigma * self.rng.standard_normal()))
                latency = min(self.cfg.episode_cap_s, self.cfg.episode_median_s * spread)
                version = group.worker.version
                group.handles.append(self.loop.call_later(latency, self._episode_done, group, version))
            if not group.waiting:
                self.queue.popleft()

    def _episode_done(self, group: _Group, start_version: int) -> None:
        with self._timed():
            self._account()
            group.holding -= 1
            self.free_sandboxes += 1
            item, i = group.item, len(group.samples)
            passed = bool(self.rng.random() < self.pass_rate[item.env])
            group.samples.append(Sample(
                uid=f"{item.uid}/{i}", group_uid=item.uid, env=item.env, domain=item.env, task_id=item.task_id,
                effort=item.effort, tokens=[1, 2], loss_mask=[1, 1], behavior_logprobs=[0.0, 0.0],
                token_versions=[start_version, group.worker.version], reward=float(passed), passed=passed,
                transcript=self.transcript))
            group.pending -= 1
            if not group.pending:
                group.future.set_result(group.samples)
            self._hand_out()

    def _ended(self, group: _Group) -> None:
        """A group finished, or was cancelled (aborted as too stale): its slot and sandboxes free up."""
        with self._timed():
            worker = group.worker
            if not group.on_slot:  # cancelled in the backlog
                worker.backlog.remove(group)
                return
            self._account()
            self.running_groups -= 1
            worker.running -= 1
            if group.future.cancelled():
                for handle in group.handles:
                    handle.cancel()
                self.free_sandboxes += group.holding
                if group.waiting:
                    self.queue.remove(group)
            while worker.backlog and worker.running < self.cfg.groups_per_worker:
                self._on_slot(worker.backlog.popleft())
            self._hand_out()


class _Driver:
    """What `rl train`'s loop does with each batch report besides waiting: the metrics line, every
    sample to rollouts.jsonl (a file in a temporary folder), the hack monitor (rl/trainer.py)."""

    def __init__(self) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="sim-run-")
        self.hacks = HackMonitor()
        self.cpu_s = 0.0
        self.bytes = 0

    def keep(self, step: int, report: Any, measured: bool) -> None:
        t0 = time.process_time()
        path = Path(self.folder.name) / ROLLOUTS
        json.dumps({"step": step, **report.metrics})  # the metrics line's cost (its file is not the question)
        self.hacks.observe(step, responses_from_records(report.records))
        append_jsonl(path, report.records)
        if measured:
            self.cpu_s += time.process_time() - t0
            self.bytes += path.stat().st_size
        path.unlink()

    def close(self) -> None:
        self.folder.cleanup()


class _NoRay:
    """What the scheduler asks of Ray on its data path (ray.put, ray.cancel), here in one process."""

    @staticmethod
    def put(value: Any) -> Any:
        return value

    @staticmethod
    def cancel(_ref: Any) -> None:
        pass


@contextlib.contextmanager
def without_ray() -> Iterator[None]:
    real = scheduler_module.ray
    scheduler_module.ray = _NoRay  # type: ignore[assignment]
    try:
        yield
    finally:
        scheduler_module.ray = real


@dataclass
class SimResult:
    config: SimConfig
    steps: int  # measured
    sim_s: float  # virtual seconds of the measured steps
    scheduler_cpu_s_per_step: float
    world_cpu_s_per_step: float
    driver_cpu_s_per_step: float  # the trainer's bookkeeping of a batch: metrics line, rollouts.jsonl, hack monitor
    rollouts_bytes_per_step: float
    samples_per_s: float
    staleness: dict[int, float]  # share of trained samples by staleness
    slot_idle: float  # rollout workers' group places without a group
    sandbox_idle: float
    learner_idle: float  # share of the learner's time waiting for a batch
    aborted_groups: float
    redrawn_groups: float
    most_backlog: int  # groups a worker was sent beyond its slots, at most
    drawn: dict[str, int]  # groups played per domain in the measured steps (trained and dropped)
    position: dict[str, Any]  # the scheduler's StreamPosition at the end, as a checkpoint holds it

    def core_share(self) -> float:
        """Of one core, what the scheduler needs to keep up in real time."""
        return self.scheduler_cpu_s_per_step * self.steps / self.sim_s


def simulate(cfg: SimConfig) -> SimResult:
    loop = VirtualClockLoop()
    try:
        with without_ray():
            return loop.run_until_complete(_run(cfg, loop))
    finally:
        left = asyncio.all_tasks(loop)  # groups still landing when the run stopped
        for task in left:
            task.cancel()
        loop.run_until_complete(_settle(left))
        loop.close()


async def _settle(tasks: set[asyncio.Task]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


async def _run(cfg: SimConfig, loop: asyncio.AbstractEventLoop) -> SimResult:
    rng = np.random.default_rng(cfg.seed + 1)
    domains = [f"family{d % 20}:domain-{d}" for d in range(cfg.domains)]
    rates = (rng.beta(0.6, 0.6, size=cfg.domains).tolist() if cfg.pass_rates is None  # many solved or hopeless
             else [cfg.pass_rates[d % len(cfg.pass_rates)] for d in range(cfg.domains)])
    pass_rate = dict(zip(domains, rates))
    world = World(cfg, loop, pass_rate)
    task_ids = {d: {"train": [f"{d}/t{i}" for i in range(cfg.tasks_per_domain)], "heldout": []} for d in domains}
    plan = SamplingPlan(env_weights={d: 1.0 for d in domains}, effort_weights={"medium": 1.0},
                        effort_budgets={"medium": 64}, group_size=cfg.group_size, temperature=1.0, top_p=1.0,
                        seed=cfg.seed)
    rollout = RolloutConfig(num_workers=cfg.rollout_workers, groups_per_step=cfg.groups_per_step,
                            group_size=cfg.group_size, groups_per_worker=cfg.groups_per_worker,
                            max_staleness=cfg.max_staleness, max_slots=cfg.groups_per_worker * cfg.group_size,
                            max_sandboxes=cfg.sandboxes, adaptive={"enabled": cfg.adaptive})
    scheduler = RolloutScheduler(world.workers, world.env_workers, task_ids, plan, rollout)
    await scheduler.set_weights([None], 0)
    await scheduler.start_training(None)
    staleness: Counter[int] = Counter()
    drawn: Counter[str] = Counter()
    driver = _Driver()
    waited = aborted = redrawn = 0.0
    trained = 0
    marks: dict[str, float] = {}
    for step in range(cfg.steps):
        if step == cfg.warmup_steps:
            world._account()
            marks = {"t": loop.time(), "cpu": time.process_time(), "world": world.cpu_s, "groups": world.group_time,
                     "sandboxes": world.sandbox_time}
        t0 = loop.time()
        batch, report = await scheduler.next_batch(step)
        driver.keep(step, report, measured=step >= cfg.warmup_steps)
        if step >= cfg.warmup_steps:
            waited += loop.time() - t0
            staleness.update(r["staleness"] for r in report.records if r["trained"] and r["staleness"] is not None)
            drawn.update(r["env"] for r in report.records if r["uid"].endswith("/0"))
            trained += int(report.metrics["rollout/trained_samples"])
            aborted += report.metrics.get("async/aborted_groups", 0.0)
            redrawn += report.metrics.get("rollout/refilled_groups", 0.0)
        await asyncio.sleep(cfg.learn_s)
        await scheduler.set_weights([None], step + 1)
    world._account()
    position = scheduler.snapshot().to_dict()
    await scheduler.stop_training()
    measured = cfg.steps - cfg.warmup_steps
    sim_s = loop.time() - marks["t"]
    world_cpu = world.cpu_s - marks["world"]
    cpu = time.process_time() - marks["cpu"] - world_cpu - driver.cpu_s
    driver.close()
    total = sum(staleness.values()) or 1
    return SimResult(
        config=cfg, steps=measured, sim_s=sim_s, scheduler_cpu_s_per_step=cpu / measured,
        world_cpu_s_per_step=world_cpu / measured, driver_cpu_s_per_step=driver.cpu_s / measured,
        rollouts_bytes_per_step=driver.bytes / measured, samples_per_s=trained / sim_s,
        staleness={k: v / total for k, v in sorted(staleness.items())},
        slot_idle=1.0 - (world.group_time - marks["groups"]) / (sim_s * cfg.rollout_workers * cfg.groups_per_worker),
        sandbox_idle=1.0 - (world.sandbox_time - marks["sandboxes"]) / (sim_s * cfg.sandboxes),
        learner_idle=waited / sim_s, aborted_groups=aborted / measured, redrawn_groups=redrawn / measured,
        most_backlog=world.most_backlog, drawn=dict(drawn), position=position)

