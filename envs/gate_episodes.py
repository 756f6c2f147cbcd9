"""Scripted episodes for the quality gate: play a policy on one task, with the sandbox taken from
the gate's warm pool, and record what the environment did (a crash is a result, not an exception)."""
from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from envs.adversaries import Policy, View, script
from envs.base import Environment
from envs.grades import GradeRequest


@dataclass
class Episode:
    """One scripted episode: its grade request (None when the environment raised) and transcript."""

    request: GradeRequest | None
    messages: list[dict[str, str]]
    observations: list[str]
    final_answer: str | None = None
    error: str | None = None  # the environment raised: "ExcType: message"
    accepted_after_final: bool = False


def run_episode(env: Environment, task_id: str, policy: Policy, seed: int = 0,
                timings: dict[str, list[float]] | None = None, after_final: str | None = None,
                sandboxes: Any = None) -> Episode:
    """Play one episode with a scripted policy; an exception from the environment is recorded, not raised.

    sandboxes: where the episode's sandbox comes from (acquire/release, like a SandboxPool) as the
    environment workers do; None: the environment opens its own."""
    view: View | None = None
    sandbox = None
    try:
        t0 = time.perf_counter()
        if sandboxes is not None and env.needs_sandbox:
            sandbox = sandboxes.acquire(timeout=120)
        messages, _ = env.reset(seed=seed, options={"task_id": task_id, "sandbox": sandbox})
        add_timing(timings, "reset", time.perf_counter() - t0)
        view = View(prompt=messages[-1]["content"])
        while not env.done:
            action = policy(view)
            t0 = time.perf_counter()
            obs, _, _, _, info = env.step(action)
            add_timing(timings, "tool_step" if info.get("tool") or info.get("tool_error") else "step", time.perf_counter() - t0)
            view.turn += 1
            if obs is not None:
                view.observations.append(obs)
        accepted = False
        if after_final is not None:  # the environment must refuse it, or at least not run it
            try:
                accepted = env.step(after_final)[0] is not None
            except Exception:  # noqa: BLE001 - refusing the turn is the right answer
                pass
        return Episode(env.grade_request(), env.messages, view.observations, env.final_answer, None, accepted)
    except Exception as exc:  # noqa: BLE001 - a crashing environment is a finding, not a gate crash
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return Episode(None, env.messages, view.observations if view else [], None, error)
    finally:
        if sandbox is not None:
            sandboxes.release(sandbox)


def reference_policy(actions: list[str]) -> Policy:
    return script(actions)


def add_timing(timings: dict[str, list[float]] | None, key: str, value: float) -> None:
    if timings is not None:
        timings.setdefault(key, []).append(value)


def state_digest(env: Environment) -> str | None:
    """A hash of every file in the episode sandbox's work dir (names and contents)."""
    if not env.needs_sandbox:
        return None
    r = env.sandbox.exec("find . -type f ! -path './.cache/*' -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum", timeout=30)
    return hashlib.sha256((r.stdout + str(r.exit_code)).encode()).hexdigest()


class GateSandboxes:
    """The gate's episode sandboxes: a warm pool, so starts overlap the episodes, and closes off
    the main thread. Most of the gate's time on a sandboxed environment is sandbox starts."""

    def __init__(self, backend: str) -> None:
        from sandbox import SandboxPool

        self.pool = SandboxPool(backend=backend, warm=4, max_live=12, start_parallelism=4,
                                labels={"role": "quality-gate"})
        self.closer = ThreadPoolExecutor(max_workers=1)

    def acquire(self, timeout: float | None = None) -> Any:
        return self.pool.acquire(timeout)

    def release(self, sandbox: Any) -> None:
        self.closer.submit(sandbox.close)

    def close(self) -> None:
        self.closer.shutdown(wait=True)
        self.pool.close()
