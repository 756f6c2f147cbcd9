"""Isolated, persistent execution for agentic RL episodes: Docker and process backends.

    from sandbox import open_sandbox, SandboxLimits
    with open_sandbox(backend="auto", labels={"run": "r1", "episode": "e7"}) as sb:
        r = sb.exec("echo hi > f && cat f")

An environment declares the sandbox it needs as a `SandboxSpec` (image or Dockerfile, limits,
network, time limits); `SandboxPools` keeps one warm pool per spec under one cap.
"""
from __future__ import annotations

from .base import ExecResult, Sandbox, SandboxDead, SandboxError, SandboxLimits, Snapshot
from .docker_backend import docker_available
from .factory import BACKENDS, aopen_sandbox, open_sandbox, resolve_backend
from .pool import PoolExhausted, SandboxPool
from .pools import SandboxPools
from .spec import SandboxSpec

__all__ = ["open_sandbox", "aopen_sandbox", "resolve_backend", "docker_available", "Sandbox", "SandboxLimits",
           "SandboxSpec", "SandboxPool", "SandboxPools", "PoolExhausted", "ExecResult", "Snapshot", "SandboxError",
           "SandboxDead"]
