"""The Sandbox interface shared by every backend: results, limits, snapshots, errors.

Every blocking method has an async twin prefixed with `a` that runs the blocking call
on a shared thread pool sized for many concurrent episodes (asyncio's default pool has
only cpu+4 threads, which would serialise 64 episodes on a 2-core node).
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
import io
import os
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")

class SandboxError(RuntimeError):
    """A sandbox operation failed (the agent answered with an error, or setup failed)."""


class SandboxDead(SandboxError):
    """The sandbox is gone (closed, killed, expired or its agent stopped answering)."""


@dataclass(frozen=True)
class ExecResult:
    """What one command did. `exit_code` is 124 on timeout and 128+N when killed by signal N."""

    exit_code: int
    stdout: str
    stderr: str
    wall_time: float
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: str | None = None  # one-line reason when the command was stopped (timeout, OOM, ...)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandbox. Sizes in MiB, times in seconds.

    `memory_mb` bounds everything the sandbox holds in RAM, as `docker --memory` does:
    its processes plus the files in its work dir, /tmp and /dev/shm, which are size-limited
    tmpfs (`disk_mb`; `tmp_mb` each for /tmp and /dev/shm). Keep disk_mb + 2 * tmp_mb well
    under memory_mb so a full disk fails with ENOSPC rather than an out-of-memory kill.
    User commands are the OOM killer's first choice; the in-sandbox agent its last.

    `ttl` is the sandbox's whole lifetime: it must exceed the episode deadline plus the
    grading time (a TTL equal to the rollout deadline is a known way to hang scoring).
    """

    memory_mb: int = 1024
    cpus: float = 1.0
    pids: int = 256
    disk_mb: int = 512  # the writable work dir
    tmp_mb: int = 64  # /tmp, and /dev/shm apart
    exec_timeout: float = 60.0  # default per-exec timeout
    ttl: float = 3600.0
    max_output_bytes: int = 1 << 20  # per stream; the rest is drained and dropped
    network: bool = False

    def __post_init__(self) -> None:
        for name in ("memory_mb", "pids", "disk_mb", "tmp_mb", "max_output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        for name in ("cpus", "exec_timeout", "ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.disk_mb + self.tmp_mb >= self.memory_mb:
            raise ValueError(f"SandboxLimits: disk_mb + tmp_mb ({self.disk_mb + self.tmp_mb}) must be < memory_mb "
                             f"({self.memory_mb}): the work dir and /tmp live in the sandbox's memory")

    def with_(self, **changes: Any) -> "SandboxLimits":
        return replace(self, **changes)


@dataclass(frozen=True)
class Snapshot:
    """The state of a sandbox's work dir at one moment (a tar archive), plus what made it.

    Root filesystems are read-only in both backends, so the work dir (which also holds
    HOME, pip --user installs, venvs) is the whole persistent state; a snapshot is
    portable between backends that share the image.
    """

    backend: str
    image: str | None
    archive: bytes
    created: float = field(default_factory=time.time)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    image_ref: str | None = None  # a committed docker image, when snapshot(mode="commit")

    @property
    def size(self) -> int:
        return len(self.archive)


_POOL_LOCK = threading.Lock()
_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _EXECUTOR
    with _POOL_LOCK:
        if _EXECUTOR is None:
            workers = int(os.environ.get("RL_SANDBOX_THREADS", "256"))
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sandbox")
        return _EXECUTOR


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking call on the sandbox thread pool from async code."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))


def tar_directory(local: str | os.PathLike[str]) -> bytes:
    """A tar archive of a local directory's contents (paths relative to it)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        root = Path(local)
        if not root.is_dir():
            raise SandboxError(f"upload source is not a directory: {root}")
        for child in sorted(root.iterdir()):
            tf.add(str(child), arcname=child.name)
    return buf.getvalue()


def untar_into(archive: bytes, local: str | os.PathLike[str]) -> None:
    """Extract an archive from a sandbox into a local directory, refusing unsafe members."""
    dest = Path(local)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r") as tf:
        try:
            tf.extractall(str(dest), filter="data")  # no links out of dest, no devices, no setuid bits
        except tarfile.TarError as e:
            raise SandboxError(f"refusing the sandbox's archive: {e}") from None
        except TypeError:  # Python without extraction filters: check members ourselves
            base = dest.resolve()
            for m in tf.getmembers():
                target = (base / m.name).resolve()
                if base not in target.parents and target != base or m.issym() or m.islnk() or m.isdev():
                    raise SandboxError(f"refusing unsafe archive member: {m.name}")
            tf.extractall(str(dest))


class Sandbox(abc.ABC):
    """One isolated, persistent execution environment for one episode."""

    backend: str = "abstract"

    def __init__(self, image: str | None, limits: SandboxLimits, labels: Mapping[str, str] | None) -> None:
        self.image = image
        self.limits = limits
        self.labels: dict[str, str] = {str(k): str(v) for k, v in (labels or {}).items()}
        self.id = uuid.uuid4().hex[:12]
        self.created = time.time()
        self._on_close: list[Callable[["Sandbox"], None]] = []  # e.g. a pool freeing its slot

    def add_close_callback(self, fn: Callable[["Sandbox"], None]) -> None:
        """Call fn(self) once, right after the sandbox is destroyed."""
        self._on_close.append(fn)

    def _run_close_callbacks(self) -> None:
        callbacks, self._on_close = self._on_close, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                pass  # a failing observer must not make close() fail

    # -- blocking API -------------------------------------------------------------
    @abc.abstractmethod
    def exec(
        self,
        cmd: Sequence[str] | str,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run argv (list) or a shell string (str) inside the sandbox."""

    @abc.abstractmethod
    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file (relative paths are under the work dir); parent dirs are created."""

    @abc.abstractmethod
    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """Read a file; raises FileNotFoundError / PermissionError like open()."""

    @abc.abstractmethod
    def put_archive(self, path: str, archive: bytes) -> None:
        """Extract a tar archive into a directory of the sandbox."""

    @abc.abstractmethod
    def get_archive(self, path: str) -> bytes:
        """A tar archive of a sandbox directory's contents."""

    @abc.abstractmethod
    def ping(self) -> bool:
        """True when the sandbox answers (health check); never raises."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """Live facts about the sandbox (at least `ttl_left`, seconds until it is destroyed)."""

    @abc.abstractmethod
    def set_deadline(self, ttl: float, wait: bool = True) -> None:
        """Restart the lifetime clock: the sandbox is destroyed `ttl` seconds from now.

        wait=False does not wait for the acknowledgement (it is read before the next call)."""

    @abc.abstractmethod
    def _spawn_like(self, labels: Mapping[str, str]) -> "Sandbox":
        """A fresh sandbox with this one's backend, image and limits."""

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy the sandbox and everything running in it. Idempotent."""

    @property
    @abc.abstractmethod
    def workdir(self) -> str:
        """The writable work dir inside the sandbox (also HOME and the default cwd)."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """False once closed, expired or dead."""

    # -- derived API --------------------------------------------------------------
    def upload(self, local: str | os.PathLike[str], remote: str) -> None:
        """Copy a local file or directory into the sandbox."""
        src = Path(local)
        if src.is_dir():
            self.put_archive(remote, tar_directory(src))
        else:
            self.write_file(remote, src.read_bytes(), mode=src.stat().st_mode & 0o777)

    def download(self, remote: str, local: str | os.PathLike[str]) -> None:
        """Copy a sandbox file or directory to a local path."""
        try:
            data = self.read_file(remote)
        except IsADirectoryError:
            untar_into(self.get_archive(remote), local)
            return
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        Path(local).write_bytes(data)

    def snapshot(self) -> Snapshot:
        """Capture the work dir (files, installed packages) for fork()."""
        return Snapshot(backend=self.backend, image=self.image, archive=self.get_archive(self.workdir))

    def fork(self, snap: Snapshot | None = None, labels: Mapping[str, str] | None = None) -> "Sandbox":
        """A new, independent sandbox whose work dir starts as `snap` (default: now)."""
        snap = snap if snap is not None else self.snapshot()
        child_labels = dict(self.labels)
        child_labels.update(labels or {})
        child_labels["forked_from"] = self.id
        child = self._spawn_like(child_labels)
        try:
            child.put_archive(child.workdir, snap.archive)
        except BaseException:
            child.close()
            raise
        return child

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} image={self.image!r} alive={self.alive}>"

    # -- async twins --------------------------------------------------------------
    async def aexec(self, cmd: Sequence[str] | str, env: Mapping[str, str] | None = None,
                    cwd: str | None = None, stdin: bytes | str | None = None,
                    timeout: float | None = None) -> ExecResult:
        return await run_blocking(self.exec, cmd, env=env, cwd=cwd, stdin=stdin, timeout=timeout)

    async def awrite_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await run_blocking(self.write_file, path, data, mode)

    async def aread_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return await run_blocking(self.read_file, path, max_bytes)

    async def aput_archive(self, path: str, archive: bytes) -> None:
        await run_blocking(self.put_archive, path, archive)

    async def aget_archive(self, path: str) -> bytes:
        return await run_blocking(self.get_archive, path)

    async def aupload(self, local: str | os.PathLike[str], remote: str) -> None:
        await run_blocking(self.upload, local, remote)

    async def adownload(self, remote: str, local: str | os.PathLike[str]) -> None:
        await run_blocking(self.download, remote, local)

    async def asnapshot(self) -> Snapshot:
        return await run_blocking(self.snapshot)

    async def afork(self, snap: Snapshot | None = None, labels: Mapping[str, str] | None = None) -> "Sandbox":
        return await run_blocking(self.fork, snap, labels)

    async def aping(self) -> bool:
        return await run_blocking(self.ping)

    async def ainfo(self) -> dict[str, Any]:
        return await run_blocking(self.info)

    async def aset_deadline(self, ttl: float, wait: bool = True) -> None:
        await run_blocking(self.set_deadline, ttl, wait)

    async def aclose(self) -> None:
        await run_blocking(self.close)

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
