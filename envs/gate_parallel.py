"""The quality gate of a run's many environments at once: checks spread over Ray actors (gate
workers), heaviest first (sandboxed environments), each worker grading in-process for all its checks
(no grader pool to start per environment), reports kept in the cache (envs/gate_cache.py)."""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

import ray

from envs.gate_cache import GateCache
from envs.quality import check_env
from envs.registry import EnvRecipe, record_check

WORKER_CPUS = 0.5


class GateWorker:
    """A Ray actor that checks environments one at a time with one grader (threads, with timeouts)."""

    def __init__(self, cache_root: str | None, grade_threads: int) -> None:
        from pathlib import Path

        from envs.grading import LocalGrader

        self.grader = LocalGrader(parallelism=grade_threads)
        self.cache = GateCache(Path(cache_root)) if cache_root else None

    def check(self, name: str, recipe: EnvRecipe, env_kwargs: dict[str, Any], max_tasks: int | None) -> dict[str, Any]:
        return check_env(name, env_kwargs, max_tasks=max_tasks, grader=self.grader, record=False, recipe=recipe,
                         cache=self.cache).to_dict()


def _lost(name: str, env_kwargs: dict[str, Any], exc: BaseException) -> dict[str, Any]:
    detail = str(exc).strip().splitlines()
    return {"env": name, "env_kwargs": env_kwargs, "ok": False, "tasks": 0,
            "reasons": [f"the gate worker died while checking it: {type(exc).__name__}"
                        + (f": {detail[0]}" if detail else "")]}


def check_all(checks: list[tuple[str, EnvRecipe, dict[str, Any]]], max_tasks: int | None, workers: int,
              cache: GateCache | None, on_report: Callable[[str, dict[str, Any]], None] | None = None,
              grade_threads: int = 4) -> dict[str, dict[str, Any]]:
    """{name: report} for (name, recipe, kwargs) checks, in the order given; `workers` actors check in
    parallel. Each verdict is recorded for `rl env list`, and handed to on_report as it arrives."""
    root = str(cache.root) if cache is not None else None
    spawn = ray.remote(GateWorker).options(num_cpus=WORKER_CPUS)
    idle = [spawn.remote(root, grade_threads) for _ in range(max(1, min(workers, len(checks))))]
    queue = deque(sorted(checks, key=lambda c: not c[1].cls.needs_sandbox))  # the long checks start first
    running: dict[Any, tuple[Any, str, dict[str, Any]]] = {}
    reports: dict[str, dict[str, Any]] = {}
    try:
        while queue or running:
            while idle and queue:
                actor = idle.pop()
                name, recipe, kwargs = queue.popleft()
                running[actor.check.remote(name, recipe, kwargs, max_tasks)] = (actor, name, kwargs)
            [ref], _ = ray.wait(list(running), num_returns=1)
            actor, name, kwargs = running.pop(ref)
            try:
                reports[name] = ray.get(ref)
                idle.append(actor)
            except ray.exceptions.RayError as exc:  # a check that killed its worker: it fails, a new one takes over
                reports[name] = _lost(name, kwargs, exc)
                ray.kill(actor, no_restart=True)
                idle.append(spawn.remote(root, grade_threads))
            if not reports[name].get("cached"):
                try:
                    record_check(name, reports[name])
                except OSError:
                    pass  # a read-only registry dir must not fail the gate
            if on_report is not None:
                on_report(name, reports[name])
    finally:
        for actor in [*idle, *(a for a, _, _ in running.values())]:
            ray.kill(actor, no_restart=True)
    return {name: reports[name] for name, _, _ in checks}
