"""Sandbox images without a registry.

The base image is built from Debian's own packages: `debootstrap --variant=minbase`
plus python3 (the in-sandbox agent needs it), a non-root `sandbox` user (uid 1000) and
/work, then `docker import`. Environment images are ordinary Dockerfiles `FROM` the
base; as the base is local, building them needs no registry.
"""
from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .base import SandboxError
from .docker_backend import DEFAULT_IMAGE
from .home import home_dir
from .spec import SandboxSpec

BASE_IMAGE = DEFAULT_IMAGE  # RL_SANDBOX_IMAGE overrides it (tests use a throwaway tag that way)
SUITE = "bookworm"
MIRROR = os.environ.get("RL_SANDBOX_MIRROR", "http://deb.debian.org/debian")
# $RL_SANDBOX_ROOTFS, else $RL_HOME/sandbox-rootfs, else ~/.cache/rl-sandbox/rootfs (sandbox/home.py)
ROOTFS_CACHE = (home_dir("sandbox-rootfs", "RL_SANDBOX_ROOTFS") if os.environ.get("RL_HOME")
                else Path(os.environ.get("RL_SANDBOX_ROOTFS", Path.home() / ".cache" / "rl-sandbox" / "rootfs")))
_SETUP = (
    "set -e; groupadd -g 1000 sandbox; useradd -u 1000 -g 1000 -d /work -M -s /bin/sh sandbox;"
    "mkdir -p /work /run/rl; chown 1000:1000 /work; chmod 0755 /work;"
    "apt-get clean; rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/* /usr/share/locale/*"
)
_PACKAGES = ["python3", "ca-certificates"]  # the agent needs python3
_RECIPE_FILE = ".rl-recipe"  # written last: a rootfs without it (or with another recipe) is rebuilt

Log = Callable[[str], None]


def _run(argv: list[str], log: Log, timeout: float = 900) -> None:
    log("$ " + " ".join(argv))
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if p.returncode != 0:
        tail = p.stdout.decode(errors="replace").strip().splitlines()[-5:]
        raise SandboxError(f"{argv[0]} failed (exit {p.returncode}): {' | '.join(tail)}")


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    """Serialise image and rootfs builds node-wide: two test sessions (or a test session and
    `rl sandbox build-image`) building at once would debootstrap into the same directory."""
    ROOTFS_CACHE.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(ROOTFS_CACHE.parent / f"{ROOTFS_CACHE.name}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _recipe(packages: list[str]) -> str:
    return f"{SUITE} include={','.join(packages)} setup={_SETUP}"


def build_rootfs(dest: str | os.PathLike[str], packages: list[str] | None = None, log: Log = print) -> Path:
    """A minimal Debian root filesystem with python3 and the sandbox user, in `dest`.

    Built beside `dest` and moved into place when complete, so `dest` is never half-built."""
    if shutil.which("debootstrap") is None:
        raise SandboxError("debootstrap is not installed (apt-get install -y debootstrap)")
    if os.geteuid() != 0:
        raise SandboxError("building the base rootfs needs root (debootstrap, chroot)")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}-building-", dir=dest.parent))
    work.chmod(0o755)  # it becomes the rootfs' /
    try:
        include = [*_PACKAGES, *(packages or [])]
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(include)}", SUITE, str(work), MIRROR], log)
        _run(["chroot", str(work), "/bin/sh", "-c", _SETUP], log)
        (work / _RECIPE_FILE).write_text(_recipe(include))
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def ensure_base_rootfs(force: bool = False, log: Log = print) -> Path:
    """The base rootfs (also a process-backend image), built when absent or made by another recipe."""
    with build_lock():
        return _base_rootfs(force, log)


def _base_rootfs(force: bool, log: Log) -> Path:
    found = base_rootfs()
    if found is not None and not force:
        return found
    return build_rootfs(ROOTFS_CACHE / "base", log=log)


def _tar_stream(root: Path) -> Path:
    """Pack a rootfs with numeric owners preserved (tar keeps ownership, unlike shutil)."""
    out = Path(tempfile.mkstemp(prefix="rl-rootfs-", suffix=".tar")[1])
    subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(out), "."], check=True)
    return out


def build_base_image(name: str = BASE_IMAGE, force: bool = False, log: Log = print) -> str:
    """Build the base image unless present (force: rebuild it and its rootfs); returns its name.
    The rootfs is kept for the process backend and reused by the next build of another tag."""
    from .docker_backend import docker_client, image_exists

    with build_lock():
        if not force and image_exists(name):
            log(f"image {name} already present")
            return name
        t0 = time.time()
        rootfs = _base_rootfs(force, log)
        tarball = _tar_stream(rootfs)
        try:
            repo, _, tag = name.partition(":")
            log(f"docker import {name}")
            docker_client().api.import_image_from_file(
                str(tarball), repository=repo, tag=tag or "latest",
                changes=["WORKDIR /work", "ENV LANG=C.UTF-8", "ENV HOME=/work", "USER 1000:1000",
                         'CMD ["/bin/sh"]', "LABEL rl.sandbox.base=1"])
        finally:
            tarball.unlink(missing_ok=True)
        if not image_exists(name):
            raise SandboxError(f"docker import did not produce {name}")
        log(f"built {name} in {time.time() - t0:.1f}s")
        return name


def build_env_image(tag: str, dockerfile: str | None = None, context: str | os.PathLike[str] | None = None,
                    network: bool = False, dockerfile_name: str = "Dockerfile", log: Log = print) -> str:
    """Build an environment image from a Dockerfile (text, or `context`/Dockerfile) FROM the base.

    network=False builds with no network at all: everything must come from the base
    image or the build context (what "offline" means here). The build argument BASE names
    the base image, so a Dockerfile can say `ARG BASE` then `FROM ${BASE}`.
    """
    from .docker_backend import docker_client
    import docker.errors

    if dockerfile is None and context is None:
        raise ValueError("give a Dockerfile text or a build context directory")
    kwargs: dict[str, Any] = {"tag": tag, "rm": True, "forcerm": True, "pull": False,
                              "network_mode": "default" if network else "none", "buildargs": {"BASE": BASE_IMAGE}}
    try:
        if context is not None:
            ctx = Path(context)
            if dockerfile is not None:  # a text Dockerfile with a context dir: write it beside, remove after
                temp = ctx / f".Dockerfile.rl-{os.getpid()}"
                temp.write_text(dockerfile)
                kwargs["dockerfile"] = temp.name
                try:
                    _, logs = docker_client().images.build(path=str(ctx), **kwargs)
                finally:
                    temp.unlink(missing_ok=True)
            else:
                kwargs["dockerfile"] = dockerfile_name
                _, logs = docker_client().images.build(path=str(ctx), **kwargs)
        else:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tf:
                data = dockerfile.encode()  # type: ignore[union-attr]
                info = tarfile.TarInfo("Dockerfile")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            buf.seek(0)
            _, logs = docker_client().images.build(fileobj=buf, custom_context=True, **kwargs)
    except docker.errors.BuildError as e:
        lines = [str(x.get("stream", x.get("error", ""))).strip() for x in e.build_log if isinstance(x, dict)]
        raise SandboxError(f"building {tag} failed: {e.msg}; {' | '.join(l for l in lines if l)[-400:]}") from None
    for entry in logs:
        if isinstance(entry, dict) and entry.get("stream", "").strip():
            log(entry["stream"].rstrip())
    return tag


def ensure_spec_image(spec: SandboxSpec, log: Log = print) -> str | None:
    """The Docker image a spec's sandboxes run, its Dockerfile built offline first when the image is
    absent (None: the base image)."""
    from .docker_backend import image_exists

    if spec.dockerfile is None:
        return spec.image
    dockerfile = Path(spec.dockerfile)
    if not dockerfile.is_file():
        raise SandboxError(f"sandbox spec: no such Dockerfile: {dockerfile}")
    tag = spec.docker_tag()
    assert tag is not None
    if image_exists(tag):
        return tag
    build_base_image(BASE_IMAGE, log=log)
    with build_lock():
        if not image_exists(tag):
            build_env_image(tag, context=dockerfile.parent, dockerfile_name=dockerfile.name, log=log)
    return tag


def base_rootfs() -> Path | None:
    """The base rootfs kept by the last build (a process-backend image), if complete and current."""
    p = ROOTFS_CACHE / "base"
    try:
        recipe = (p / _RECIPE_FILE).read_text()
    except OSError:
        return None
    return p if recipe == _recipe(_PACKAGES) and (p / "usr" / "bin" / "python3").exists() else None
