"""Host side of the agent protocol, shared by the Docker and process backends."""
from __future__ import annotations

import errno as errno_mod
import json
import os
import select
import struct
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from .base import ExecResult, Sandbox, SandboxDead, SandboxError, SandboxLimits

HDR = struct.Struct(">II")
LEN = struct.Struct(">I")
CHUNK = 1 << 20
AGENT_SOURCE = (Path(__file__).with_name("_agent.py")).read_text()
WORKDIR = "/work"
# how long past an exec's own timeout we wait for the agent before declaring it dead
GRACE = 10.0


def base_env(workdir: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A clean environment: nothing of the host's (tokens, keys) leaks into the sandbox."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TMPDIR": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    env.update(extra or {})
    return env


class AgentConnection:
    """Framed request/response over a pair of fds (pipes or one socket). Thread-safe."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.pending = 0  # replies owed for send_nowait() requests

    def _read_exact(self, n: int, deadline: float) -> bytes:
        parts: list[bytes] = []
        while n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("agent did not answer in time")
            r, _, _ = select.select([self.rfd], [], [], left)
            if not r:
                continue
            b = os.read(self.rfd, min(n, 1 << 20))
            if not b:
                raise EOFError("agent connection closed")
            parts.append(b)
            n -= len(b)
        return b"".join(parts)

    def _send(self, head: Mapping[str, Any], blob: bytes) -> None:
        j = json.dumps(head).encode()
        data = memoryview(HDR.pack(len(j), len(blob)) + j + blob)
        while data:
            data = data[os.write(self.wfd, data):]

    def recv(self, timeout: float) -> tuple[dict[str, Any], bytes]:
        deadline = time.monotonic() + timeout
        jlen, blen = HDR.unpack(self._read_exact(HDR.size, deadline))
        head = json.loads(self._read_exact(jlen, deadline))
        return head, self._read_exact(blen, deadline) if blen else b""

    def _send_chunks(self, head: Mapping[str, Any], blob: bytes) -> None:
        self._send({**head, "chunked": True}, b"")
        mv = memoryview(blob)
        for i in range(0, len(mv), CHUNK):
            self._write_all(LEN.pack(len(mv[i:i + CHUNK])) + bytes(mv[i:i + CHUNK]))
        self._write_all(LEN.pack(0))

    def _write_all(self, data: bytes) -> None:
        mv = memoryview(data)
        while mv:
            mv = mv[os.write(self.wfd, mv):]

    def _recv_chunks(self, deadline: float) -> tuple[dict[str, Any], bytes]:
        parts: list[bytes] = []
        while True:
            (n,) = LEN.unpack(self._read_exact(LEN.size, deadline))
            if n == 0:
                break
            parts.append(self._read_exact(n, deadline))
        return self.recv(max(deadline - time.monotonic(), 0.001))[0], b"".join(parts)

    def call(self, head: Mapping[str, Any], blob: bytes = b"", timeout: float = 60.0,
             chunked: bool = False) -> tuple[dict[str, Any], bytes]:
        """One request/response. chunked=True streams `blob` so the agent never holds it whole."""
        with self.lock:
            if self.broken:
                raise SandboxDead(self.broken)
            try:
                self._drain_pending()
                deadline = time.monotonic() + timeout
                if chunked:
                    self._send_chunks(head, blob)
                else:
                    self._send(head, blob)
                res, out = self.recv(timeout)
                if res.get("chunked"):
                    res, out = self._recv_chunks(deadline)
            except (OSError, EOFError, TimeoutError, ValueError, struct.error) as e:
                self.broken = f"sandbox agent lost during {head.get('op')!r}: {e}"
                raise SandboxDead(self.broken) from None
        if not res.get("ok"):
            raise _error_from(res)
        return res, out


    def _drain_pending(self) -> None:
        """Consume the replies of earlier send_nowait() requests (lock held)."""
        while self.pending:
            self.recv(GRACE)
            self.pending -= 1

    def send_nowait(self, head: Mapping[str, Any]) -> None:
        """Send a small request without waiting for its reply (read before the next call).

        A dead agent still fails here (EPIPE / connection reset), so only the reply's
        round trip is saved: the pool uses it to start a sandbox's TTL clock at acquire."""
        with self.lock:
            if self.broken:
                raise SandboxDead(self.broken)
            try:
                self._send(head, b"")
                self.pending += 1
            except OSError as e:
                self.broken = f"sandbox agent lost during {head.get('op')!r}: {e}"
                raise SandboxDead(self.broken) from None


def _error_from(res: Mapping[str, Any]) -> Exception:
    msg = str(res.get("error") or "sandbox operation failed")
    code = res.get("errno")
    kind = res.get("type")
    # map OS errors back so callers can catch FileNotFoundError etc. as with open()
    if isinstance(code, int) and code in errno_mod.errorcode:
        # OSError(errno, ...) builds the matching subclass (FileNotFoundError, ...)
        return OSError(code, res.get("strerror") or msg, *([res["filename"]] if res.get("filename") else []))
    if kind in ("IsADirectoryError", "NotADirectoryError", "FileNotFoundError", "PermissionError"):
        return OSError(msg)
    return SandboxError(msg)


class AgentSandbox(Sandbox):
    """A sandbox driven through its in-sandbox agent; backends supply start and kill."""

    def __init__(self, image: str | None, limits: SandboxLimits, labels: Mapping[str, str] | None,
                 env: Mapping[str, str] | None = None) -> None:
        super().__init__(image, limits, labels)
        self._env = dict(env or {})
        self._conn: AgentConnection | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._lost_reason: str | None = None  # why the agent went away; every later call says it again
        self._ttl_end = time.monotonic() + limits.ttl  # the host's view of the agent's deadline

    @property
    def workdir(self) -> str:
        return WORKDIR

    def _agent_config(self, **extra: Any) -> str:
        cfg = {"workdir": WORKDIR, "env": base_env(WORKDIR, self._env), "ttl": self.limits.ttl,
               "pids": self.limits.pids}
        cfg.update(extra)
        return json.dumps(cfg)

    def _call(self, head: Mapping[str, Any], blob: bytes = b"", timeout: float = 60.0,
              chunked: bool = False) -> tuple[dict[str, Any], bytes]:
        if self._closed or self._conn is None:
            raise SandboxDead(self._lost_reason or f"sandbox {self.id} is closed")
        try:
            return self._conn.call(head, blob, timeout, chunked)
        except SandboxDead as e:
            raise self._lost(e) from None

    def _lost(self, e: SandboxDead) -> SandboxDead:
        """The agent stopped answering: free the sandbox now (it is useless), and say why in one
        line where the backend can tell (Docker: the daemon restarted, the container is gone)."""
        if not self._closed:  # not closed by its owner: something outside killed it
            self._lost_reason = self._why_lost() or str(e)
        self.close()
        return SandboxDead(self._lost_reason or str(e))

    def _why_lost(self) -> str | None:
        """Backend-specific: why the agent went away (None: the broken connection says enough)."""
        return None

    @property
    def alive(self) -> bool:
        return not self._closed and self._conn is not None and self._conn.broken is None and self._alive()

    def _alive(self) -> bool:
        return True

    def exec(self, cmd: Sequence[str] | str, env: Mapping[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | str | None = None, timeout: float | None = None) -> ExecResult:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        if not argv:
            raise ValueError("exec needs a non-empty command")
        t = float(timeout if timeout is not None else self.limits.exec_timeout)
        if t <= 0:
            raise ValueError(f"timeout must be > 0, got {t}")
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        head = {"op": "exec", "argv": argv, "env": dict(env or {}), "cwd": cwd, "timeout": t,
                "max_output": self.limits.max_output_bytes}
        res, out = self._call(head, data, timeout=t + GRACE)
        n = res["out_len"]
        return ExecResult(
            exit_code=int(res["exit_code"]),
            stdout=out[:n].decode("utf-8", "replace"),
            stderr=out[n:].decode("utf-8", "replace"),
            wall_time=float(res["wall_time"]),
            timed_out=bool(res["timed_out"]),
            stdout_truncated=bool(res.get("out_trunc")),
            stderr_truncated=bool(res.get("err_trunc")),
            error=res.get("error"),
        )

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        blob = data.encode() if isinstance(data, str) else bytes(data)
        self._call({"op": "write", "path": str(path), "mode": int(mode)}, blob, timeout=300.0, chunked=True)

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return self._call({"op": "read", "path": str(path), "max": max_bytes}, timeout=300.0)[1]

    def put_archive(self, path: str, archive: bytes) -> None:
        self._call({"op": "tar_in", "path": str(path)}, archive, timeout=300.0, chunked=True)

    def get_archive(self, path: str) -> bytes:
        return self._call({"op": "tar_out", "path": str(path)}, timeout=300.0)[1]

    def ping(self) -> bool:
        if not self.alive:
            return False
        try:
            self._call({"op": "ping"}, timeout=5.0)
            return True
        except SandboxError:
            return False

    def info(self) -> dict[str, Any]:
        """Live facts from inside: agent pid, seconds of TTL left."""
        res, _ = self._call({"op": "ping"}, timeout=5.0)
        return {"id": self.id, "backend": self.backend, "image": self.image, "labels": dict(self.labels),
                "ttl_left": float(res["remaining"]), "agent_pid": res["pid"]}

    def set_deadline(self, ttl: float, wait: bool = True) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        self._ttl_end = time.monotonic() + ttl
        if wait:
            self._call({"op": "deadline", "ttl": float(ttl)}, timeout=5.0)
            return
        if self._closed or self._conn is None:
            raise SandboxDead(self._lost_reason or f"sandbox {self.id} is closed")
        try:
            self._conn.send_nowait({"op": "deadline", "ttl": float(ttl)})
        except SandboxDead as e:
            raise self._lost(e) from None

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        conn = self._conn
        if conn is not None and conn.broken is None and conn.lock.acquire(timeout=0.5):
            try:  # polite first: the agent kills its processes and exits
                conn._send({"op": "close"}, b"")
                for _ in range(conn.pending + 1):
                    conn.recv(timeout=1.0)
            except Exception:
                pass
            finally:
                conn.broken = "sandbox closed"
                conn.lock.release()
        elif conn is not None:
            conn.broken = "sandbox closed"
        try:
            self._teardown()
        finally:
            self._run_close_callbacks()

    def _teardown(self) -> None:
        """Backend-specific: make sure nothing of the sandbox is left."""
