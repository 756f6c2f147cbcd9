"""Environment worker: a Ray actor that hosts live episodes (one environment instance and, when the
environment needs one, one sandbox each) and sends finished episodes to the grader pool.

Environment instances are reused across episodes (building one can mean generating its dataset);
sandboxes never are: each episode takes a fresh one from a pool that keeps some warm."""
from __future__ import annotations

import traceback
from typing import Any

from rl.types import WorkItem


def failed_grade(error: str) -> dict[str, Any]:
    return {"reward": 0.0, "passed": False, "error": error, "grader_version": ""}


class EnvWorker:
    def __init__(self, env_specs: dict[str, Any], grading: dict[str, Any], run_name: str,
                 sandbox_backend: str = "auto", warm_sandboxes: int = 8) -> None:
        from envs.grading import GraderPool

        self.env_specs = env_specs  # name -> envs.registry.EnvRecipe, resolved by the driver
        self.grader_pool = GraderPool(**grading)
        self.run_name = run_name
        self.sandbox_backend = sandbox_backend
        self.warm_sandboxes = warm_sandboxes
        self.episodes: dict[str, tuple[str, Any]] = {}  # episode id -> (environment name, instance)
        self.sandboxes: dict[str, Any] = {}
        self._idle_envs: dict[str, list[Any]] = {name: [] for name in env_specs}
        self._sandbox_pool = None  # started on the first episode that needs a sandbox
        self.errors: dict[str, str] = {}  # episode id -> why its environment failed
        self._templates = {name: recipe.make() for name, recipe in env_specs.items()}

    def task_ids(self, env: str, split: str) -> list[str]:
        return list(self._templates[env].dataset(split)["task_id"])

    def _sandboxes(self):
        if self._sandbox_pool is None:
            from sandbox import SandboxPool

            self._sandbox_pool = SandboxPool(backend=self.sandbox_backend, warm=self.warm_sandboxes,
                                             max_live=max(64, 4 * self.warm_sandboxes), labels={"run": self.run_name})
        return self._sandbox_pool

    def _open(self, env_name: str, episode_id: str):
        idle = self._idle_envs[env_name]
        env = idle.pop() if idle else self.env_specs[env_name].make()
        sandbox = None
        if env.needs_sandbox:
            sandbox = self._sandboxes().acquire(labels={"episode": episode_id})
            self.sandboxes[episode_id] = sandbox
        self.episodes[episode_id] = (env_name, env)
        return env, sandbox

    def reset_group(self, item: WorkItem, episode_ids: list[str]) -> dict[str, Any]:
        """Start one episode per id on the same task; all members see the same first observation."""
        messages = None
        for eid in episode_ids:
            env, sandbox = self._open(item.env, eid)
            obs, _ = env.reset(seed=item.seed, options={"task_id": item.task_id, "effort": item.effort,
                                                        "sandbox": sandbox})
            messages = messages or obs
        template = self._templates[item.env]
        return {"messages": messages, "domain": template.domain, "max_turns": template.max_turns}

    def step_many(self, actions: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """One assistant turn per (episode id, text); the reply says whether the episode ended."""
        replies = []
        for eid, text in actions:
            env = self.episodes[eid][1]
            try:
                obs, _reward, terminated, truncated, _info = env.step(text)
            except Exception as exc:  # a broken environment ends its episode, never the run
                obs, terminated, truncated = None, True, False
                self.errors[eid] = f"{type(exc).__name__}: {exc}"
            done = bool(terminated or truncated or obs is None)
            replies.append({"observation": obs, "done": done, "truncated": bool(truncated)})
        return replies

    def finish_many(self, episode_ids: list[str]) -> list[dict[str, Any]]:
        """Grade every episode through the grader pool and release its resources."""
        requests, grades = [], []
        for eid in episode_ids:
            env = self.episodes[eid][1]
            error = self.errors.get(eid)
            if error:
                requests.append(None)
                grades.append(failed_grade(f"environment error: {error}"))
                continue
            try:
                requests.append(env.grade_request())
                grades.append(None)
            except Exception as exc:
                requests.append(None)
                grades.append(failed_grade(f"grade request failed: {type(exc).__name__}: {exc}"))
        todo = [i for i, r in enumerate(requests) if r is not None]
        if todo:
            results = self.grader_pool.grade_many([requests[i] for i in todo])
            for i, grade in zip(todo, results):
                grades[i] = {"reward": float(grade.reward), "passed": bool(grade.passed), "error": grade.error,
                             "grader_version": grade.grader_version}
        for eid in episode_ids:
            self._release(eid)
        return grades

    def abort(self, uid_prefix: str) -> int:
        """Drop the episodes of a group whose rollout worker died (they are re-issued elsewhere)."""
        doomed = [eid for eid in self.episodes if eid.startswith(uid_prefix + "/")]
        for eid in doomed:
            self._release(eid)
        return len(doomed)

    def _release(self, eid: str) -> None:
        """End an episode: its sandbox is destroyed, its environment instance kept for the next one."""
        name, env = self.episodes.pop(eid, (None, None))
        sandbox = self.sandboxes.pop(eid, None)
        self.errors.pop(eid, None)
        if sandbox is not None:
            try:
                sandbox.close()
            except Exception:
                traceback.print_exc()
        if env is not None:
            self._idle_envs[name].append(env)

    def close(self) -> None:
        for eid in list(self.episodes):
            self._release(eid)
        for instances in self._idle_envs.values():
            for env in instances:
                env.close()
        if self._sandbox_pool is not None:
            self._sandbox_pool.close()
        self.grader_pool.close()

    def reference_episodes(self, env_name: str, task_ids: list[str], effort: str, seed: int) -> list[dict[str, Any]]:
        """Play the environment's reference solution: the data for the tokenizer and the SFT warm-up."""
        out = []
        for task_id in task_ids:
            eid = f"ref/{env_name}/{task_id}"
            env, sandbox = self._open(env_name, eid)
            try:
                messages, _ = env.reset(seed=seed, options={"task_id": task_id, "effort": effort, "sandbox": sandbox})
                turns = []
                for action in env.reference_actions(task_id):
                    obs, _r, terminated, truncated, _i = env.step(action)
                    done = bool(terminated or truncated or obs is None)
                    turns.append({"action": action, "observation": None if done else obs})
                    if done:
                        break
                out.append({"task_id": task_id, "messages": messages, "turns": turns})
            finally:
                self._release(eid)
        return out
