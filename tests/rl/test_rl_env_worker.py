"""The environment worker under concurrent groups: a full sandbox pool makes groups wait, never
wait on each other forever; a run's worker keeps a sandbox warm for each episode in flight."""
from __future__ import annotations

import threading
import time
from typing import Callable

import pytest

from envs.registry import resolve
from rl.cluster import start_env_side
from rl.config import validate
from rl.rollout.env_worker import EnvWorker
from rl.types import WorkItem

from tests_rl_config import TINY


def open_groups_at_once(worker: EnvWorker, env: str, groups: int, members: int, timeout: float,
                        then: Callable[[str], None] | None = None) -> list[int]:
    """`groups` threads each open one group of `members` episodes on the same task at the same
    moment (then call `then(episode_prefix)`); returns the groups that got through."""
    task = worker.task_ids(env, "train")[0]
    start = threading.Barrier(groups)
    finished: list[int] = []
    errors: list[BaseException] = []

    def play(g: int) -> None:
        item = WorkItem(f"g{g}", env, task, "low", members, seed=g, max_new_tokens=8, temperature=1.0, top_p=1.0)
        try:
            start.wait()
            worker.reset_group(item, [f"{item.episode_prefix}/{m}" for m in range(members)])
            if then is not None:
                then(item.episode_prefix)
            finished.append(g)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=play, args=(g,), daemon=True) for g in range(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors
    return sorted(finished)


def test_groups_larger_than_the_free_sandboxes_all_open_in_turn(ray_session):
    """Six groups of 3 at once against a pool of 4 sandboxes: opened member by member, two groups
    could each hold 2 and wait for a third forever; taken a group at a time, every group opens."""
    worker = EnvWorker({"shell": resolve("shell", {"n_train": 8, "n_heldout": 2})}, {"num_actors": 1}, "env-worker-test",
                       sandbox_backend="process", warm_sandboxes=0, max_sandboxes=4)
    try:
        # the episodes end once open; their sandboxes go back
        finished = open_groups_at_once(worker, "shell", groups=6, members=3, timeout=90, then=worker.abort)
        assert finished == list(range(6)), f"groups {sorted(set(range(6)) - set(finished))} never opened"
        assert worker.health_report().sandboxes_live <= 4
    finally:
        worker.close()


def test_concurrent_episodes_build_the_task_set_once(ray_session, monkeypatch):
    """Every live episode holds its own environment instance; they share the worker's task set.
    Built per instance, 16 groups of 8 at once built it 128 times (minutes on a GPU machine)."""
    from envs.domains.math import MathEnv

    builds: list[int] = []
    original = MathEnv.build_tasks
    monkeypatch.setattr(MathEnv, "build_tasks", lambda self: builds.append(1) or original(self))
    worker = EnvWorker({"math": resolve("math", {"n_train": 40, "n_heldout": 8})}, {"num_actors": 1}, "tasks-once")
    try:
        assert open_groups_at_once(worker, "math", groups=8, members=4, timeout=60) == list(range(8))
        assert len(worker.episodes) == 32
        assert len(builds) == 1, f"the task set was built {len(builds)} times for 32 episodes"
    finally:
        worker.close()


def test_a_run_keeps_a_sandbox_warm_for_every_episode_it_plays_at_once(ray_session):
    """rollout.warm_sandboxes by default: each episode the rollout can hold at once finds a started
    sandbox (2 workers x 1 group x 2 members = 4), so a group's start never waits for cold starts."""
    cfg = validate({**TINY, "envs": [e for e in TINY["envs"] if e["name"] == "shell"], "rollout": {
        **TINY["rollout"], "num_workers": 2, "groups_per_worker": 1, "group_size": 2}})
    [worker] = start_env_side(cfg, "warm-test")
    try:
        task = ray_session.get(worker.task_ids.remote("shell", "train"))[0]
        item = WorkItem("g0", "shell", task, "low", 2, seed=0, max_new_tokens=8, temperature=1.0, top_p=1.0)
        ray_session.get(worker.reset_group.remote(item, [f"{item.episode_prefix}/{m}" for m in range(2)]))
        deadline, live = time.monotonic() + 60, 0
        while time.monotonic() < deadline and live < 6:
            live = ray_session.get(worker.health_report.remote()).sandboxes_live
            time.sleep(0.2)
        assert live == 6, f"{live} live sandboxes: the group's 2 and 4 warm expected"
        ray_session.get(worker.abort.remote(item.episode_prefix))
    finally:
        ray_session.get(worker.close.remote())
        ray_session.kill(worker)
