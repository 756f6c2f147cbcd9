"""Fixtures for the sandbox tests: every backend through the public interface.

`backend` runs a test on the process backend with bubblewrap, on its unshare fallback
and on Docker (through the session fixture `docker_image` of tests/conftest.py, which builds
the base image when absent and skips only where no daemon answers).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

_HERE = str(Path(__file__).resolve().parent)  # sandbox_testutil, also under --import-mode=importlib
if _HERE not in sys.path:
    sys.path.append(_HERE)
import sandbox  # noqa: E402
from sandbox import Sandbox  # noqa: E402

from sandbox_testutil import RUN, use_unshare_fallback  # noqa: E402


@pytest.fixture(scope="session")
def base_rootfs_dir() -> Path:
    """The debootstrap rootfs the base image is made from, built when absent (needs root and debootstrap)."""
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("building the base rootfs needs root and debootstrap (apt-get install -y debootstrap)")
    from sandbox.images import ensure_base_rootfs

    return ensure_base_rootfs()


@pytest.fixture(scope="session", autouse=True)
def _reap_session_leftovers() -> Iterator[None]:
    """Whatever a failing test left behind in this session is removed at the end."""
    yield
    if sandbox.docker_available():
        from sandbox.docker_backend import gc_docker_sandboxes

        gc_docker_sandboxes(run=RUN)


@pytest.fixture(params=["bwrap", "unshare", "docker"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    kind = request.param
    if kind == "docker":
        request.getfixturevalue("docker_image")
        return "docker"
    if kind == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    if kind == "unshare":
        use_unshare_fallback(monkeypatch)
    return "process"


@pytest.fixture(params=["process", "docker"])
def backend_name(request: pytest.FixtureRequest) -> str:
    """A backend by the name open_sandbox / SandboxPool / the CLI take (process = bubblewrap
    when installed)."""
    if request.param == "docker":
        request.getfixturevalue("docker_image")
    return request.param


@pytest.fixture
def make_sb(backend: str) -> Iterator[Callable[..., Sandbox]]:
    """Open sandboxes of the current backend; all are closed after the test."""
    opened: list[Sandbox] = []

    def make(episode: str = "e", **kw: object) -> Sandbox:
        labels = {"run": RUN, "episode": episode, **kw.pop("labels", {})}  # type: ignore[dict-item]
        sb = sandbox.open_sandbox(backend, labels=labels, **kw)  # type: ignore[arg-type]
        opened.append(sb)
        return sb

    yield make
    for sb in opened:
        sb.close()
