"""What sandbox an environment needs: image, resource limits, network and time limits.

An environment class declares one (`Environment.sandbox_spec`); a run config may override it
per environment with a mapping of the same keys. Unset fields (None) take the defaults of
`SandboxLimits` and of the pool.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from .base import SandboxLimits

EPISODE_TIMEOUT = 600.0  # the pool's default episode deadline
GRADING_TIME = 120.0  # a sandbox outlives its episode by this plus a margin: grading reads it
TTL_MARGIN = 60.0


@dataclass(frozen=True)
class SandboxSpec:
    """One environment's sandbox.

    image: a Docker image name (default: the base image). dockerfile: a Dockerfile (its
    directory is the build context) built offline, `FROM ${BASE}` (the base image), into
    `image` or, when `image` is unset, into a tag named after its content; the pool builds it
    when absent. rootfs: the process backend's image, a root filesystem directory (default: the
    host's /usr, read-only). Limits in MiB and CPUs; exec_timeout: seconds a command may run
    when it gives no timeout of its own; episode_timeout: an episode's wall time (its sandbox
    is destroyed grading time + a margin after it).
    """

    image: str | None = None
    dockerfile: str | None = None
    rootfs: str | None = None
    memory_mb: int | None = None
    cpus: float | None = None
    pids: int | None = None
    disk_mb: int | None = None
    network: bool | None = None
    exec_timeout: float | None = None
    episode_timeout: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            kind = _KINDS[f.name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
            elif not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ValueError(f"sandbox spec: '{f.name}' must be {kind.__name__}, got {value!r}")
            if kind in (int, float) and value <= 0:
                raise ValueError(f"sandbox spec: '{f.name}' must be > 0, got {value!r}")
        if self.image is not None and Path(self.image).is_absolute():
            raise ValueError(f"sandbox spec: 'image' is a Docker image name; give a rootfs directory as 'rootfs', "
                             f"got {self.image!r}")
        self.limits()  # a spec that cannot become limits fails where it is written

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SandboxSpec":
        """A spec from a mapping (a run config's `sandbox:` entry); an unknown key is a one-line error."""
        return cls().merged(data)

    def merged(self, override: "SandboxSpec | Mapping[str, Any] | None") -> "SandboxSpec":
        """This spec with the set fields of `override` (a spec, or a mapping of field names) replacing its own."""
        if override is None:
            return self
        if isinstance(override, SandboxSpec):
            changes = {f.name: getattr(override, f.name) for f in fields(override) if getattr(override, f.name) is not None}
        elif isinstance(override, Mapping):
            unknown = [k for k in override if k not in _KINDS]
            if unknown:
                raise ValueError(f"sandbox spec: unknown key {unknown[0]!r}; expected one of {', '.join(_KINDS)}")
            changes = dict(override)
        else:
            raise ValueError(f"sandbox spec: expected a mapping of {', '.join(_KINDS)}, got {override!r}")
        return dataclasses.replace(self, **changes)

    def limits(self) -> SandboxLimits:
        """The resource limits of a sandbox of this spec. The work dir and /tmp live in the sandbox's
        memory: with only `memory_mb` given they shrink to fit it, as `rl sandbox run --memory` does."""
        base = SandboxLimits()
        memory = self.memory_mb or base.memory_mb
        tmp = min(base.tmp_mb, max(1, memory // 8))
        disk = self.disk_mb if self.disk_mb is not None else min(base.disk_mb, max(1, memory // 2))
        if disk + tmp >= memory:
            raise ValueError(f"sandbox spec: disk_mb ({disk}) plus /tmp ({tmp}) must be < memory_mb ({memory}): "
                             f"the work dir and /tmp live in the sandbox's memory")
        ttl = base.ttl if self.episode_timeout is None else self.episode_timeout + GRADING_TIME + TTL_MARGIN
        return SandboxLimits(memory_mb=memory, cpus=self.cpus or base.cpus, pids=self.pids or base.pids,
                             disk_mb=disk, tmp_mb=tmp, exec_timeout=self.exec_timeout or base.exec_timeout,
                             ttl=ttl, network=bool(self.network))

    def docker_tag(self) -> str | None:
        """The Docker image a sandbox of this spec runs (None: the base image)."""
        if self.image is not None or self.dockerfile is None:
            return self.image
        return f"rl-env-{self.recipe_digest()}:latest"

    def recipe_digest(self) -> str:
        """12 hex digits of the Dockerfile and its build context's files: a changed recipe is a new tag."""
        assert self.dockerfile is not None
        dockerfile = Path(self.dockerfile)
        h = hashlib.sha256(dockerfile.read_bytes())
        for p in sorted(dockerfile.resolve().parent.rglob("*")):
            if p.is_file():
                h.update(str(p.relative_to(dockerfile.resolve().parent)).encode() + b"\0" + p.read_bytes())
        return h.hexdigest()[:12]


_KINDS: dict[str, type] = {"image": str, "dockerfile": str, "rootfs": str, "memory_mb": int, "cpus": float,
                           "pids": int, "disk_mb": int, "network": bool, "exec_timeout": float,
                           "episode_timeout": float}
