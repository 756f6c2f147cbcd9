"""The rollout scheduler: a Ray actor that turns a step into GRPO groups (environment chosen by
per-domain weight, task, effort level), hands them to rollout workers, and re-issues the groups of a
worker that dies, so that every step gets exactly its groups, none lost and none counted twice."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from rl.rollout.worker import NoWeightsError
from rl.types import Sample, WorkItem, env_worker_index

WORKER_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError)


@dataclass(frozen=True)
class SamplingPlan:
    env_weights: dict[str, float]
    effort_weights: dict[str, float]
    effort_budgets: dict[str, int]
    group_size: int
    temperature: float
    top_p: float
    seed: int


class RolloutScheduler:
    def __init__(self, workers: list, env_workers: list, env_task_ids: dict[str, dict[str, list[str]]], plan: SamplingPlan,
                 max_retries: int, inflight_per_worker: int = 2) -> None:
        self.workers = list(workers)
        self.env_workers = list(env_workers)
        self.task_ids = env_task_ids  # env -> split -> task ids
        self.plan = plan
        self.max_retries = max_retries
        self.inflight_per_worker = inflight_per_worker
        self.weights_ref: list = []  # [ObjectRef] of the newest weights, wrapped so Ray does not fetch it here
        self.version = -1

    # -- weights ---------------------------------------------------------------------------------
    def set_weights(self, wrapped_ref: list, version: int) -> int:
        """Push new weights to every worker; returns once all hold them."""
        self.weights_ref, self.version = wrapped_ref, version
        ray.get([w.set_weights.remote(wrapped_ref[0], version) for w in self.workers])
        return version

    # -- planning --------------------------------------------------------------------------------
    def plan_step(self, step: int, n_groups: int) -> list[WorkItem]:
        """Deterministic in (seed, step): a resumed run draws the same groups as an unbroken one."""
        rng = np.random.default_rng([self.plan.seed, step])
        envs = sorted(self.plan.env_weights)
        p_env = np.array([self.plan.env_weights[e] for e in envs], dtype=float)
        levels = sorted(lvl for lvl, w in self.plan.effort_weights.items() if w > 0)
        p_lvl = np.array([self.plan.effort_weights[lvl] for lvl in levels], dtype=float)
        items = []
        for g in range(n_groups):
            env = envs[rng.choice(len(envs), p=p_env / p_env.sum())]
            level = levels[rng.choice(len(levels), p=p_lvl / p_lvl.sum())]
            tasks = self.task_ids[env]["train"]
            task = tasks[int(rng.integers(len(tasks)))]
            items.append(WorkItem(uid=f"s{step}/g{g}", env=env, task_id=task, effort=level,
                                  group_size=self.plan.group_size, seed=int(rng.integers(2**31)),
                                  max_new_tokens=self.plan.effort_budgets[level],
                                  temperature=self.plan.temperature, top_p=self.plan.top_p))
        return items

    def plan_eval(self, env: str, efforts: list[str], n_tasks: int, samples: int, temperature: float,
                  tag: str) -> list[WorkItem]:
        tasks = self.task_ids[env]["heldout"][:n_tasks]
        return [WorkItem(uid=f"{tag}/{env}/{level}/{t}", env=env, task_id=task, effort=level, group_size=samples,
                         seed=t, max_new_tokens=self.plan.effort_budgets[level], temperature=temperature,
                         top_p=1.0)
                for level in efforts for t, task in enumerate(tasks)]

    # -- execution -------------------------------------------------------------------------------
    def collect(self, step: int, n_groups: int) -> dict[str, Any]:
        items = self.plan_step(step, n_groups)
        return self.run(items)

    def evaluate(self, envs: list[str], efforts: list[str], n_tasks: int, samples: int, temperature: float,
                 tag: str) -> dict[str, Any]:
        items = [it for env in envs for it in self.plan_eval(env, efforts, n_tasks, samples, temperature, tag)]
        return self.run(items)

    def run(self, items: list[WorkItem]) -> dict[str, Any]:
        """Run every item to completion on the workers; a dead worker's items go to the queue again."""
        t0 = time.monotonic()
        queue: deque[WorkItem] = deque(items)
        attempts = {it.uid: 0 for it in items}
        results: dict[str, list[Sample]] = {}
        inflight: dict[Any, tuple[WorkItem, int]] = {}
        load = [0] * len(self.workers)
        reissued = 0
        errors: list[str] = []
        failed: list[str] = []  # groups whose environment kept raising: reported, not trained on
        while queue or inflight:
            while queue and min(load) < self.inflight_per_worker:
                w = int(np.argmin(load))
                item = queue.popleft()
                inflight[self.workers[w].run_group.remote(item)] = (item, w)
                load[w] += 1
            ready, _ = ray.wait(list(inflight), num_returns=1)
            ref = ready[0]
            item, w = inflight.pop(ref)
            load[w] -= 1
            try:
                samples = ray.get(ref)
            except NoWeightsError:  # restarted between calls: give it the weights, run the group again
                self._recover_worker(w, item)
                queue.append(item)
                reissued += 1
                continue
            except WORKER_FAILURES as exc:
                attempts[item.uid] += 1
                if attempts[item.uid] > self.max_retries:
                    raise RuntimeError(f"group {item.uid} failed {attempts[item.uid]} times; last: {exc}") from None
                errors.append(f"{item.uid}: worker {w} died")
                self._recover_worker(w, item)
                queue.append(item)
                reissued += 1
                continue
            except RayTaskError as exc:  # the group itself raised (a broken task or environment)
                self._abort_episodes(item)
                attempts[item.uid] += 1
                cause = getattr(exc, "cause", None) or exc
                if attempts[item.uid] > self.max_retries:
                    failed.append(item.uid)
                    errors.append(f"{item.uid} ({item.env} task {item.task_id}): {type(cause).__name__}: {cause}")
                else:
                    queue.append(item)
                continue
            if item.uid in results:  # cannot happen by construction; guard the no-double-count promise
                raise RuntimeError(f"group {item.uid} completed twice")
            results[item.uid] = samples
        ordered = [s for it in items for s in results.get(it.uid, [])]
        return {"samples": ordered, "reissued": reissued, "failed_groups": len(failed),
                "seconds": time.monotonic() - t0, "errors": errors}

    def _recover_worker(self, w: int, item: WorkItem) -> None:
        """The actor restarts on its own (max_restarts); it comes back with fresh weights only."""
        worker = self.workers[w]
        self._abort_episodes(item)
        if self.weights_ref:
            worker.set_weights.remote(self.weights_ref[0], self.version)  # ordered before its next call

    def _abort_episodes(self, item: WorkItem) -> None:
        """Close the half-played episodes (and sandboxes) of a group that will not finish."""
        env_worker = self.env_workers[env_worker_index(item.env, len(self.env_workers))]
        ray.get(env_worker.abort.remote(item.uid))
