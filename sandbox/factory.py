"""Choosing a backend and opening one sandbox: what `open_sandbox` and the pools share."""
from __future__ import annotations

import os
from typing import Mapping

from .base import Sandbox, SandboxLimits, run_blocking
from .docker_backend import docker_available
from .spec import SandboxSpec

BACKENDS = ("auto", "docker", "process")


def resolve_backend(backend: str = "auto", image: str | None = None) -> str:
    """'auto': docker when a daemon answers and has the image, else the embedded process backend."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if image is not None and os.path.isdir(image):
        return "process"  # a rootfs directory is a process-backend image
    if docker_available():
        from .docker_backend import DEFAULT_IMAGE, image_exists

        try:
            if image_exists(image or DEFAULT_IMAGE):
                return "docker"
        except Exception:
            pass
    return "process"


def prepare(spec: SandboxSpec, backend: str = "auto") -> tuple[str, str | None, SandboxLimits]:
    """The backend, image and limits of a sandbox of `spec`; a Dockerfile image the spec names is
    built (offline) when absent and Docker may be used."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    docker_image = spec.image
    if spec.dockerfile is not None and (backend == "docker" or (backend == "auto" and docker_available())):
        from .images import ensure_spec_image

        docker_image = ensure_spec_image(spec)
    kind = resolve_backend(backend, docker_image)
    return kind, docker_image if kind == "docker" else spec.rootfs, spec.limits()


def open_sandbox(backend: str = "auto", image: str | None = None, limits: SandboxLimits | None = None,
                 labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
                 spec: SandboxSpec | None = None) -> Sandbox:
    """Start a fresh sandbox for one episode. Close it (or use `with`) when the episode ends.

    image: docker image name (default: the base image) for docker; a rootfs directory
    (default: the host's /usr, read-only) for process. spec: the image and limits an
    environment declared (`image` and `limits`, when given, take precedence).
    """
    if spec is not None:
        backend, spec_image, spec_limits = prepare(spec, backend)
        image, limits = image or spec_image, limits or spec_limits
    kind = resolve_backend(backend, image)
    limits = limits or SandboxLimits()
    if kind == "docker":
        from .docker_backend import DockerSandbox

        return DockerSandbox(image, limits, labels, env)
    from .process_backend import ProcessSandbox

    return ProcessSandbox(image, limits, labels, env)


async def aopen_sandbox(backend: str = "auto", image: str | None = None, limits: SandboxLimits | None = None,
                        labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
                        spec: SandboxSpec | None = None) -> Sandbox:
    return await run_blocking(open_sandbox, backend, image, limits, labels, env, spec)
