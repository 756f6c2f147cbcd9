"""Process backend: a sandbox made of namespaces on this host, no daemon needed.

bubblewrap when present: new user/pid/net/ipc/uts/cgroup namespaces, a read-only view
of /usr (or of an image rootfs dir), a size-limited tmpfs work dir and /tmp, nothing
else of the host's filesystem. Without bubblewrap: `unshare` (pid/net/ipc/uts/mount
namespaces) and a chroot built from the same allowlist, rlimits, and an unprivileged uid.
Either way a per-sandbox cgroup (when writable) limits memory, pids and CPU, and the
pid namespace guarantees nothing survives close(): its init dies with the agent.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from . import _cgroup
from ._client import AGENT_SOURCE, WORKDIR, AgentConnection, AgentSandbox, base_env
from .base import ExecResult, SandboxError, SandboxLimits
from .owner import STATE_ROOT, check_state_root, owner_alive, start_time

PROCESS_STATE = STATE_ROOT / "process"  # one dir per live sandbox: meta.json, agent.py, etc/
SANDBOX_UID = 1000
START_TIMEOUT = 30.0


def bwrap_path() -> str | None:
    """bubblewrap, unless RL_SANDBOX_NO_BWRAP=1 forces the unshare fallback (tests use it)."""
    if os.environ.get("RL_SANDBOX_NO_BWRAP") == "1":
        return None
    return shutil.which("bwrap")


@functools.lru_cache(maxsize=None)
def bwrap_disables_userns(bwrap: str) -> bool:
    """Whether this bubblewrap (0.8 and later) can forbid user namespaces inside the sandbox."""
    try:
        return "--disable-userns" in subprocess.run([bwrap, "--help"], capture_output=True, text=True,
                                                    timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


def _etc_files(state: Path) -> Path:
    etc = state / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "passwd").write_text(f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::{WORKDIR}:/bin/sh\n"
                                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    (etc / "group").write_text(f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n")
    (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    return etc


def _python_for(root: Path) -> str:
    for cand in ("usr/bin/python3", "usr/local/bin/python3"):
        if (root / cand).exists():
            return "/" + cand
    raise SandboxError(f"no python3 under {root}/usr: the process backend's agent needs one")


def _host_view(root: Path, state: Path, network: bool) -> list[tuple[str, str, str]]:
    """What of `root` a sandbox sees, as (kind, source, target): an allowlist, so a checkout
    or home directory anywhere on the host stays invisible. kind is "ro" or "symlink"."""
    view = [("ro", str(root / "usr"), "/usr")]
    for top in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        p = root / top
        if p.is_symlink():
            view.append(("symlink", os.readlink(p), "/" + top))
        elif p.is_dir():
            view.append(("ro", str(p), "/" + top))
    # only harmless, non-secret parts of /etc; identity files are generated
    # /etc/ssl without its private/: a root owner's bubblewrap maps the sandbox user onto root
    for name in ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "ssl/certs",
                 "ssl/openssl.cnf", "ca-certificates", "mime.types", "nsswitch.conf", "python3", "python3.11"):
        if (root / "etc" / name).exists():
            view.append(("ro", str(root / "etc" / name), "/etc/" + name))
    if network and (root / "etc/resolv.conf").exists():
        view.append(("ro", str(root / "etc/resolv.conf"), "/etc/resolv.conf"))
    etc = _etc_files(state)
    view += [("ro", str(etc / name), "/etc/" + name) for name in ("passwd", "group", "hosts")]
    return view


def _bwrap_argv(root: Path, state: Path, limits: SandboxLimits, info_fd: int) -> list[str]:
    # --as-pid-1: the agent is the namespace's init, so its exit (owner gone, close, TTL)
    # kills every process of the sandbox; bwrap's own init would wait for them instead
    argv = [bwrap_path() or "bwrap", "--unshare-all", "--as-pid-1", "--new-session", "--cap-drop", "ALL",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
    if limits.network:
        argv.append("--share-net")
    if bwrap_disables_userns(argv[0]):  # a nested user namespace is root over new kernel surface
        argv += ["--unshare-user", "--disable-userns"]
    for kind, src, dst in _host_view(root, state, limits.network):
        argv += ["--symlink", src, dst] if kind == "symlink" else ["--ro-bind", src, dst]
    # bwrap's /dev is an unbounded tmpfs the sandbox user owns: /dev/shm gets a size-limited tmpfs
    # of its own (as /tmp, and docker's shm_size) and the rest of /dev is made read-only
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(limits.tmp_mb << 20), "--perms", "1777", "--tmpfs", "/dev/shm",
             "--size", str(limits.disk_mb << 20), "--perms", "0755", "--tmpfs", WORKDIR,
             "--size", str(limits.tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp",
             "--ro-bind", str(state / "agent.py"), "/.rl/agent.py",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR, "--info-fd", str(info_fd)]
    return argv


# Fallback without bubblewrap: runs as root inside fresh namespaces, builds a new root on a
# tmpfs from the same allowlist bubblewrap gets (read-only binds, a few device nodes, proc,
# the work dir and /tmp), chroots into it, drops to an unprivileged uid with rlimits, then
# becomes the agent.
_UNSHARE_BOOT = r"""
import json, os, resource, subprocess, sys
spec = json.loads(sys.argv[1])
def mount(*a): subprocess.run(["mount", *a], check=True)
def bind_ro(src, dst):
    if os.path.isdir(src): os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True); open(dst, "a").close()
    mount("--rbind", src, dst); mount("-o", "remount,bind,ro,nosuid,nodev", dst)
new = spec["root"]
mount("--make-rprivate", "/")
mount("-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", new)
for kind, src, dst in spec["view"]:
    if kind == "symlink": os.symlink(src, new + dst)
    else: bind_ro(src, new + dst)
for dev in ("null", "zero", "full", "random", "urandom", "tty"):
    os.makedirs(new + "/dev", exist_ok=True); open(new + "/dev/" + dev, "a").close()
    mount("--bind", "/dev/" + dev, new + "/dev/" + dev)
for d, size, mode, owner in (("/dev/shm", spec["tmp"], "1777", 0), ("/tmp", spec["tmp"], "1777", 0),
                             (spec["workdir"], spec["disk"], "0755", spec["uid"])):
    os.makedirs(new + d, exist_ok=True)
    mount("-t", "tmpfs", "-o", "size=%d,mode=%s,uid=%d,gid=%d,nosuid,nodev" % (size, mode, owner, owner), "tmpfs",
          new + d)
os.makedirs(new + "/proc", exist_ok=True)
mount("-t", "proc", "proc", new + "/proc")
mount("-o", "remount,ro", new)
os.chroot(new); os.chdir(spec["workdir"])
resource.setrlimit(resource.RLIMIT_AS, (spec["mem"], spec["mem"]))
if spec["nproc"] > 0:  # only without a pids cgroup: NPROC counts the uid's processes host-wide
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
uid = spec["uid"]
os.setgroups([]); os.setgid(uid); os.setuid(uid)
import ctypes
# PR_SET_NO_NEW_PRIVS: no user namespace here, so a setuid-root binary would run as the host's root
if ctypes.CDLL(None).prctl(38, 1, 0, 0, 0) != 0:
    sys.exit("sandbox boot: prctl(PR_SET_NO_NEW_PRIVS) failed")
child = os.fork()
if child == 0:
    os.execv(spec["python"], [spec["python"], "-I", "-S", "-c", sys.argv[2], sys.argv[3]])
# we are pid 1 of the namespace: reap orphans until the agent exits, then leave (the
# kernel kills whatever is left in the namespace when its init exits)
os.closerange(0, 3)
while True:
    try:
        pid, _ = os.wait()
    except ChildProcessError:
        break
    if pid == child:
        break
"""


class ProcessSandbox(AgentSandbox):
    """One sandbox = one namespace tree on this host, driven through its agent."""

    backend = "process"

    def __init__(self, image: str | None = None, limits: SandboxLimits | None = None,
                 labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None) -> None:
        super().__init__(image, limits or SandboxLimits(), labels, env)
        self._root = Path(image) if image else Path("/")
        if not (self._root / "usr").is_dir():
            raise SandboxError(f"process backend image must be a rootfs directory with usr/, got {image!r}")
        self._state = PROCESS_STATE / self.id
        self._proc: subprocess.Popen[bytes] | None = None
        self._ns_init: int | None = None
        self._cg: _cgroup.Cgroup | None = None
        _sweep_once()
        try:
            self._start()
        except BaseException:
            self._closed = True
            self._teardown()
            raise

    def _start(self) -> None:
        lim = self.limits
        check_state_root()
        self._state.mkdir(parents=True, exist_ok=False)
        self._write_meta()  # before anything else exists, so gc never takes it for debris
        self._cg = _cgroup.Cgroup.create(self.id, lim.memory_mb, lim.pids, lim.cpus)
        py = _python_for(self._root)
        cfg = self._agent_config()
        mem_bytes = lim.memory_mb << 20
        log = open(self._state / "agent.log", "wb")
        info_r = info_w = -1
        try:
            if bwrap_path():
                info_r, info_w = os.pipe()
                (self._state / "agent.py").write_text(AGENT_SOURCE)
                argv = _bwrap_argv(self._root, self._state, lim, info_w) + [py, "-I", "-S", "/.rl/agent.py", cfg]
                pass_fds: Sequence[int] = (info_w,)
            else:
                # looked up on the owner's PATH: the launcher runs with the sandbox's
                unshare = [shutil.which("unshare") or "unshare", "--mount", "--pid", "--fork", "--kill-child",
                           "--mount-proc", "--ipc", "--uts"]
                if not lim.network:
                    unshare.append("--net")
                (self._state / "root").mkdir()
                spec = {"root": str(self._state / "root"), "view": _host_view(self._root, self._state, lim.network),
                        "workdir": WORKDIR, "disk": lim.disk_mb << 20, "tmp": lim.tmp_mb << 20, "mem": mem_bytes,
                        "nproc": 0 if self._cg else lim.pids, "uid": SANDBOX_UID, "python": py}
                argv = unshare + [py, "-I", "-S", "-c", _UNSHARE_BOOT, json.dumps(spec), AGENT_SOURCE, cfg]
                pass_fds = ()
            # not the owner's environment (its tokens and keys): the sandbox reads its agent's
            # through /proc/1/environ
            self._proc = subprocess.Popen(_confined(self._cg, mem_bytes) + argv, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log, pass_fds=pass_fds, close_fds=True,
                                          env=base_env(WORKDIR))
        finally:
            log.close()
            if info_w >= 0:
                os.close(info_w)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._conn = AgentConnection(self._proc.stdout.fileno(), self._proc.stdin.fileno())
        if info_r >= 0:
            try:
                info = _read_all(info_r, START_TIMEOUT)
                self._ns_init = int(json.loads(info)["child-pid"]) if info.strip() else None
            finally:
                os.close(info_r)
        self._write_meta()
        try:
            hello, _ = self._conn.recv(START_TIMEOUT)
        except Exception as e:
            detail = (self._state / "agent.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise SandboxError(f"process sandbox failed to start: {e}; {' | '.join(detail)}") from None
        if not hello.get("ready"):
            raise SandboxError(f"process sandbox agent said {hello}")

    def _write_meta(self) -> None:
        meta = {"id": self.id, "backend": self.backend, "owner_pid": os.getpid(), "owner_start": start_time(os.getpid()),
                "pid": self._proc.pid if self._proc else None, "ns_init": self._ns_init, "labels": self.labels,
                "created": self.created, "image": self.image}
        _write_atomic(self._state / "meta.json", json.dumps(meta))

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exec(self, cmd: Sequence[str] | str, env: Mapping[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | str | None = None, timeout: float | None = None) -> ExecResult:
        before = self._cg.oom_kills() if self._cg else 0
        r = super().exec(cmd, env=env, cwd=cwd, stdin=stdin, timeout=timeout)
        if self._cg and r.exit_code == 137 and self._cg.oom_kills() > before:
            r = _replace_error(r, f"killed: out of memory (limit {self.limits.memory_mb} MiB)")
        return r

    def _spawn_like(self, labels: Mapping[str, str]) -> "ProcessSandbox":
        return ProcessSandbox(self.image, self.limits, labels, self._env)

    def _teardown(self) -> None:
        proc = self._proc
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                try:
                    if f:
                        f.close()
                except OSError:
                    pass
            # killing the namespace's init kills every process in the namespace
            for pid in (self._ns_init, proc.pid):
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._cg is not None:
            self._cg.remove()
        shutil.rmtree(self._state, ignore_errors=True)


# The sandbox's first process is a shell that enters the limits and then becomes bwrap (or
# unshare), so that nothing the sandbox runs can fork outside them. Done in Python between fork
# and exec (a preexec_fn), it kept subprocess from using vfork: every start copied the owner's
# address space, a large threaded Ray actor's in a run.
_JOIN_CGROUP = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_CAP_MEMORY = 'ulimit -v "$1" || exit 125; shift; exec "$@"'


def _confined(cg: "_cgroup.Cgroup | None", mem_bytes: int) -> list[str]:
    """The argv prefix that puts the process in `cg`, or, with no writable cgroup here, caps its
    address space at mem_bytes (a per-process fallback), before it execs the rest."""
    if cg is not None:
        return ["/bin/sh", "-c", _JOIN_CGROUP, "sh", *cg.procs_files(), "--"]
    return ["/bin/sh", "-c", _CAP_MEMORY, "sh", str(mem_bytes >> 10)]


def _write_atomic(path: Path, text: str) -> None:
    """Readers (gc in other processes) never see a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _replace_error(r: ExecResult, error: str) -> ExecResult:
    from dataclasses import replace

    return replace(r, error=error)


def _read_all(fd: int, timeout: float) -> bytes:
    import select

    out = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not r:
            break
        b = os.read(fd, 4096)
        if not b:
            break
        out += b
        if out.rstrip().endswith(b"}"):
            break
    return out


def list_process_sandboxes() -> list[dict]:
    check_state_root()  # gc kills the pids it lists
    out = []
    try:
        entries = list(PROCESS_STATE.iterdir())
    except OSError:
        return out
    for d in entries:
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, ValueError):
            try:
                if time.time() - d.stat().st_mtime < 60:
                    continue  # being created or removed right now
            except OSError:
                continue
            meta = {"id": d.name, "owner_pid": None}
        meta["owner_alive"] = owner_alive(meta.get("owner_pid"), meta.get("owner_start"))
        meta["state_dir"] = str(d)
        out.append(meta)
    return out


def gc_process_sandboxes(all_: bool = False) -> list[str]:
    """Kill and remove process sandboxes whose owner died (or all)."""
    removed = []
    live_ids = set()
    for meta in list_process_sandboxes():
        # the agent enforces the TTL itself (and the pool moves it): only dead owners here
        stale = all_ or not meta["owner_alive"]
        if not stale:
            live_ids.add(meta["id"])
            continue
        for pid in (meta.get("ns_init"), meta.get("pid")):
            if pid and start_time(int(pid)) is not None:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        shutil.rmtree(meta["state_dir"], ignore_errors=True)
        removed.append(meta["id"])
    # cgroup dirs left by owners that died (the processes in them died with the agent)
    for d in _cgroup.find_stale(live_ids):
        cg = _cgroup.Cgroup(d.name, [d], _cgroup._is_v2())
        young = time.time() - d.stat().st_mtime < 60 if d.exists() else False  # may be starting right now
        if d.name[len(_cgroup.PREFIX):] in removed or all_ or (not young and not cg.pids()):
            cg.remove()
    return removed


_SWEPT = threading.Event()


def _sweep_once() -> None:
    """Reap leftovers of dead owners the first time this process opens a sandbox."""
    if not _SWEPT.is_set():
        _SWEPT.set()
        try:
            gc_process_sandboxes()
        except Exception as e:  # never block opening a sandbox on cleanup
            print(f"sandbox: sweep of stale process sandboxes failed: {e}", file=sys.stderr)
