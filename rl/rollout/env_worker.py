"""Environment worker: a Ray actor that hosts live episodes (one environment instance and, when the
environment needs one, one sandbox each) and sends finished episodes to the grader pool.

It serves many rollout workers' episodes at once (a threaded actor): one episode's slow tool call
or grading never stalls another's. Environment instances are reused across episodes (building one
can mean generating its dataset); sandboxes never are: each episode takes a fresh one from a pool
that keeps some warm."""
from __future__ import annotations

import contextlib
import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

from envs.grades import Grade
from rl.faults import first_line
from rl.types import WorkItem


@dataclass
class EpisodeStart:
    messages: list[dict[str, str]]  # what every member of the group sees first
    domain: str
    max_turns: int
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI-style schemas: the chat template shows them


@dataclass
class StepReply:
    observation: str | None  # the tool's output, the next thing the policy reads
    done: bool
    truncated: bool


@dataclass
class EpisodeEnd:
    grade: Grade
    transcript: list[dict[str, str]] = field(default_factory=list)


@dataclass
class EnvHealth:
    """Counts since the worker started, for the environment-health metrics (a restarted worker, a
    new pid, counts from zero again)."""

    env_errors: dict[str, int] = field(default_factory=dict)
    grade_errors: dict[str, int] = field(default_factory=dict)
    grade_timeouts: dict[str, int] = field(default_factory=dict)
    sandboxes_live: int = 0
    graders_replaced: int = 0  # grader actors that died or hung and were replaced (their grades retried)
    pid: int = 0


class EpisodeLost(RuntimeError):
    """The episode is not on this environment worker: the worker died and Ray restarted it since the
    episode began (its episodes died with it). The scheduler plays the group again."""


def _failed(error: str) -> Grade:
    return Grade.failed("", error)


class EnvWorker:
    def __init__(self, env_specs: dict[str, Any], grading: dict[str, Any], run_name: str,
                 sandbox_backend: str = "auto", warm_sandboxes: int = 8, max_sandboxes: int = 64) -> None:
        from envs.grading import GraderPool

        self.env_specs = env_specs  # name -> envs.registry.EnvRecipe, resolved by the driver
        self.grader_pool = GraderPool(**grading)
        self.run_name = run_name
        self.sandbox_backend = sandbox_backend
        self.warm_sandboxes = warm_sandboxes
        self.max_sandboxes = max(max_sandboxes, warm_sandboxes)
        self._lock = threading.Lock()  # guards the bookkeeping below (calls arrive on many threads)
        # A group takes its sandboxes one group at a time: groups that each held part of what they
        # need while waiting for the rest could fill the pool and wait on each other forever.
        self._opening = threading.Lock()
        self._building = threading.Lock()
        self.episodes: dict[str, tuple[str, Any]] = {}  # episode id -> (environment name, instance)
        self.sandboxes: dict[str, Any] = {}
        self._idle_envs: dict[str, list[Any]] = {name: [] for name in env_specs}
        self._sandbox_pool = None  # started on the first episode that needs a sandbox
        self.errors: dict[str, str] = {}  # episode id -> why its environment failed
        self.health = EnvHealth()
        self._templates = {name: recipe.make() for name, recipe in env_specs.items()}

    def ping(self) -> int:
        """Its process id: answers once the actor is up (after a restart, too)."""
        return os.getpid()

    def task_ids(self, env: str, split: str) -> list[str]:
        with self._building:
            return list(self._templates[env].dataset(split)["task_id"])

    def _sandboxes(self):
        with self._lock:
            if self._sandbox_pool is None:
                from sandbox import SandboxPools

                self._sandbox_pool = SandboxPools(backend=self.sandbox_backend, warm=self.warm_sandboxes,
                                                  max_live=self.max_sandboxes,
                                                  labels={"run": self.run_name})
            return self._sandbox_pool

    def _open(self, env_name: str, episode_id: str):
        with self._lock:
            idle = self._idle_envs[env_name]
            env = idle.pop() if idle else None
        if env is None:
            env = self.env_specs[env_name].make()
            with self._building:  # the first episode builds the task set once; the others wait for it
                env.share_tasks_of(self._templates[env_name])
        sandbox = None
        if env.needs_sandbox:  # the environment's own sandbox spec: image, limits, network, time
            sandbox = self._sandboxes().acquire(env.sandbox_spec, labels={"episode": episode_id})
        with self._lock:
            if sandbox is not None:
                self.sandboxes[episode_id] = sandbox
            self.episodes[episode_id] = (env_name, env)
        return env, sandbox

    def _episode(self, episode_id: str) -> tuple[str, Any]:
        with self._lock:
            found = self.episodes.get(episode_id)
        if found is None:
            raise EpisodeLost(f"episode {episode_id} is not on environment worker pid {os.getpid()} "
                              f"(it restarted since the episode began, or the group was aborted)")
        return found

    def reset_group(self, item: WorkItem, episode_ids: list[str]) -> EpisodeStart:
        """Start one episode per id on the same task; all members see the same first observation."""
        messages = None
        template = self._templates[item.env]
        with self._opening if template.needs_sandbox else contextlib.nullcontext():
            opened = [self._open(item.env, eid) for eid in episode_ids]
        for env, sandbox in opened:
            obs, _ = env.reset(seed=item.seed, options={"task_id": item.task_id, "effort": item.effort,
                                                        "sandbox": sandbox})
            messages = messages or obs
        return EpisodeStart(messages, template.domain, template.max_turns, template.tools)

    def step(self, episode_id: str, text: str) -> StepReply:
        """One assistant turn; the reply says whether the episode ended. A broken environment ends
        its episode (graded as an environment error), never the run."""
        env = self._episode(episode_id)[1]
        try:
            obs, _reward, terminated, truncated, _info = env.step(text)
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                self.errors[episode_id] = f"{type(exc).__name__}: {exc}"
            return StepReply(None, True, False)
        return StepReply(obs, bool(terminated or truncated or obs is None), bool(truncated))

    def finish(self, episode_id: str) -> EpisodeEnd:
        """Grade the episode through the grader pool and release its resources."""
        name, env = self._episode(episode_id)
        error = self.errors.get(episode_id)
        try:
            if error:
                grade = _failed(f"environment error: {error}")
            else:
                try:
                    request = env.grade_request()
                except Exception as exc:  # noqa: BLE001
                    grade = _failed(f"grade request failed: {type(exc).__name__}: {exc}")
                else:
                    grade = self.grader_pool.grade_many([request])[0]
            self._count(name, error, grade)
            return EpisodeEnd(grade, list(env.messages))
        finally:
            self._release(episode_id)

    def _count(self, env_name: str, env_error: str | None, grade: Grade) -> None:
        h = self.health
        with self._lock:
            if env_error:
                h.env_errors[env_name] = h.env_errors.get(env_name, 0) + 1
            elif grade.error:
                table = h.grade_timeouts if "timed out" in grade.error else h.grade_errors
                table[env_name] = table.get(env_name, 0) + 1

    def health_report(self) -> EnvHealth:
        with self._lock:
            self.health.sandboxes_live = self._sandbox_pool.live if self._sandbox_pool is not None else 0
            self.health.graders_replaced = self.grader_pool.replaced
            self.health.pid = os.getpid()
            return self.health

    def abort(self, uid_prefix: str) -> int:
        """Drop the episodes of a group that will not finish (they are re-issued elsewhere)."""
        with self._lock:
            doomed = [eid for eid in self.episodes if eid.startswith(uid_prefix + "/")]
        for eid in doomed:
            self._release(eid)
        return len(doomed)

    def _release(self, eid: str) -> None:
        """End an episode: its sandbox is destroyed, its environment instance kept for the next one."""
        with self._lock:
            name, env = self.episodes.pop(eid, (None, None))
            sandbox = self.sandboxes.pop(eid, None)
            self.errors.pop(eid, None)
        if sandbox is not None:
            try:
                sandbox.close()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        if env is not None:
            with self._lock:
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

    def reference_episodes(self, env_name: str, task_ids: list[str], effort: str,
                           seed: int) -> tuple[list[dict[str, Any]], list[str]]:
        """Play the environment's reference solution: the data for the tokenizer and the SFT warm-up.
        Returns the episodes and, for each task whose environment raised, one line saying what (the task
        is left out, as a failed group is in training)."""
        out, failures = [], []
        for task_id in task_ids:
            eid = f"ref/{env_name}/{task_id}"
            try:
                env, sandbox = self._open(env_name, eid)
                messages, _ = env.reset(seed=seed, options={"task_id": task_id, "effort": effort, "sandbox": sandbox})
                turns = []
                for action in env.reference_actions(task_id):
                    obs, _r, terminated, truncated, _i = env.step(action)
                    done = bool(terminated or truncated or obs is None)
                    turns.append({"action": action, "observation": None if done else obs})
                    if done:
                        break
                out.append({"task_id": task_id, "messages": messages, "turns": turns, "tools": env.tools,
                            "effort": effort})
            except Exception as exc:  # noqa: BLE001 - a user's environment may raise anything
                failures.append(f"{task_id}: {first_line(exc)}")
            finally:
                self._release(eid)
        return out, failures
