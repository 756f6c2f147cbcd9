"""The environment worker under concurrent groups: a full sandbox pool makes groups wait, never
wait on each other forever."""
from __future__ import annotations

import threading

import pytest

from envs.registry import resolve
from rl.rollout.env_worker import EnvWorker
from rl.types import WorkItem


def test_groups_larger_than_the_free_sandboxes_all_open_in_turn(ray_session):
    """Six groups of 3 at once against a pool of 4 sandboxes: opened member by member, two groups
    could each hold 2 and wait for a third forever; taken a group at a time, every group opens."""
    worker = EnvWorker({"shell": resolve("shell", {"n_train": 8, "n_heldout": 2})}, {"num_actors": 1}, "env-worker-test",
                       sandbox_backend="process", warm_sandboxes=0, max_sandboxes=4)
    task = worker.task_ids("shell", "train")[0]
    start = threading.Barrier(6)
    finished: list[int] = []
    errors: list[BaseException] = []

    def play(g: int) -> None:
        item = WorkItem(f"g{g}", "shell", task, "low", 3, seed=g, max_new_tokens=8, temperature=1.0, top_p=1.0)
        try:
            start.wait()
            worker.reset_group(item, [f"{item.episode_prefix}/{m}" for m in range(3)])
            worker.abort(item.episode_prefix)  # the episodes end; their sandboxes go back
            finished.append(g)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=play, args=(g,), daemon=True) for g in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not errors, errors
        assert sorted(finished) == list(range(6)), f"groups {sorted(set(range(6)) - set(finished))} never opened"
        assert worker.health_report().sandboxes_live <= 4
    finally:
        worker.close()
