"""Building the base image: what the `docker_image` fixture relies on (build when absent, a failed
build is an error, never a skip) and a rootfs that is never left half-built in the cache."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import sandbox
from sandbox import SandboxError
from sandbox import images


def _no_build(*_a, **_k):
    raise SandboxError("debootstrap failed (exit 1): E: Couldn't download packages")


def test_a_present_image_is_used_as_it_is(docker_image: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(images, "build_rootfs", _no_build)
    logged: list[str] = []
    assert images.build_base_image(docker_image, log=logged.append) == docker_image
    assert logged == [f"image {docker_image} already present"]


def test_an_absent_image_is_built_and_a_failed_build_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if not sandbox.docker_available():
        pytest.skip("no Docker daemon answers")
    monkeypatch.setattr(images, "ROOTFS_CACHE", tmp_path / "rootfs")  # nothing cached to import from
    monkeypatch.setattr(images, "build_rootfs", _no_build)
    with pytest.raises(SandboxError, match="debootstrap failed"):
        images.build_base_image(f"rl-sandbox-absent-{uuid.uuid4().hex[:8]}:latest", log=lambda _: None)


def test_a_failed_rootfs_build_leaves_no_half_built_rootfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "rootfs"
    monkeypatch.setattr(images, "ROOTFS_CACHE", cache)
    monkeypatch.setattr(images.shutil, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(images.os, "geteuid", lambda: 0)

    def run(argv: list[str], log, timeout: float = 900) -> None:
        if argv[0] == "debootstrap":  # the download went fine...
            (Path(argv[-2]) / "usr" / "bin").mkdir(parents=True)
            (Path(argv[-2]) / "usr" / "bin" / "python3").write_text("")
        else:  # ...the set-up in the chroot did not
            raise SandboxError("chroot failed (exit 1)")

    monkeypatch.setattr(images, "_run", run)
    with pytest.raises(SandboxError, match="chroot failed"):
        images.ensure_base_rootfs(log=lambda _: None)
    assert images.base_rootfs() is None
    assert [p.name for p in cache.iterdir()] == []  # no partial tree left beside it either
