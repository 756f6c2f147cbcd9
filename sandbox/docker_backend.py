"""Docker backend: one locked-down container per episode, kept alive across turns.

The container's main process is the sandbox agent (under docker's init); it connects
to a unix socket the owner listens on, in a host dir mounted read-only. Commands then cost a fork+exec inside the
container instead of a docker exec round trip, and the container dies with its owner:
when the owner's socket closes (close(), crash, SIGKILL) the agent exits, the init
stops the container and auto-remove deletes it. Labels let `gc` reap whatever a dead
owner, a finished run or an expired TTL left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import _cgroup
from ._client import AGENT_SOURCE, WORKDIR, AgentConnection, AgentSandbox
from .base import ExecResult, SandboxError, SandboxLimits
from .owner import STATE_ROOT, check_state_root, owner_alive, start_time

DEFAULT_IMAGE = os.environ.get("RL_SANDBOX_IMAGE", "rl-sandbox-base:latest")
LABEL = "rl.sandbox"
SANDBOX_USER = "1000:1000"
START_TIMEOUT = 60.0
# what close() and a post-mortem wait on the daemon: one that restarts accepts connections before it
# answers them, and a close must not wait the main client's 120 s on it
PROBE_TIMEOUT = 5.0
HOST = socket.gethostname()
LOG_MAX = "1m"  # of a container's log on the host

_client_lock = threading.Lock()
_client: Any = None
_quick: Any = None
_avail: tuple[float, bool] = (0.0, False)


def _base_url() -> str:
    return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def docker_client() -> Any:
    """A process-wide docker client with a connection pool big enough for many episodes."""
    global _client
    with _client_lock:
        if _client is None:
            import docker

            _client = docker.DockerClient(base_url=_base_url(), timeout=120, max_pool_size=128)
        return _client


def _quick_api() -> Any:
    """A low-level client whose calls give up after PROBE_TIMEOUT (raises where no daemon answers)."""
    global _quick
    if _quick is None:
        import docker

        api = docker.APIClient(base_url=_base_url(), version=docker_client().api.api_version,
                               timeout=PROBE_TIMEOUT, max_pool_size=128)
        with _client_lock:
            _quick = _quick or api
    return _quick


def docker_available(timeout: float = 2.0) -> bool:
    """True when a docker daemon answers (cached for 10 s; never raises)."""
    global _avail
    now = time.monotonic()
    if now - _avail[0] < 10.0:
        return _avail[1]
    ok = False
    try:
        import docker

        c = docker.DockerClient(base_url=_base_url(), timeout=timeout)
        try:
            ok = bool(c.ping())
        finally:
            c.close()
    except Exception:
        ok = False
    _avail = (now, ok)
    return ok


_images_seen: dict[str, float] = {}


def image_exists(name: str) -> bool:
    """Whether the daemon has the image (a hit is cached for 10 s: 'auto' asks on every open)."""
    import docker.errors

    if time.monotonic() - _images_seen.get(name, -1e9) < 10.0:
        return True
    try:
        docker_client().api.inspect_image(name)
    except docker.errors.ImageNotFound:
        return False
    _images_seen[name] = time.monotonic()
    return True


def _cgroup_dir(container_id: str) -> _cgroup.Cgroup | None:
    """The container's memory cgroup on this host, to tell OOM kills apart."""
    for cand in (f"/sys/fs/cgroup/memory/docker/{container_id}", f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope",
                 f"/sys/fs/cgroup/docker/{container_id}"):
        if Path(cand).is_dir():
            return _cgroup.Cgroup(container_id, [Path(cand)], not cand.startswith("/sys/fs/cgroup/memory"))
    return None


def _create_and_start(image: str, command: list[str], name: str, labels: dict[str, str], lim: SandboxLimits,
                      state: Path) -> str:
    """Create and start a locked-down container; returns its id. The low-level API skips
    the inspect round trip that containers.run() makes."""
    import docker

    api = docker_client().api
    host_config = api.create_host_config(
        auto_remove=True, init=True, network_mode="bridge" if lim.network else "none",
        mem_limit=f"{lim.memory_mb}m", memswap_limit=f"{lim.memory_mb}m", nano_cpus=int(lim.cpus * 1e9),
        pids_limit=lim.pids, read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges"],
        shm_size=f"{lim.tmp_mb}m",  # not the daemon's default: /dev/shm is bounded as /tmp is
        tmpfs={WORKDIR: f"size={lim.disk_mb}m,mode=0755,uid=1000,gid=1000,exec",
               "/tmp": f"size={lim.tmp_mb}m,mode=1777,exec"},
        binds={str(state): {"bind": "/run/rl", "mode": "ro"}},
        ulimits=[docker.types.Ulimit(name="nofile", soft=4096, hard=4096)],
        # sandboxed code can write to docker's init's stdout, which the daemon logs on the host's disk
        log_config=docker.types.LogConfig(type="json-file", config={"max-size": LOG_MAX, "max-file": "1"}))
    resp = api.create_container(image, command, name=name, labels=labels, hostname="sandbox", user=SANDBOX_USER,
                                working_dir=WORKDIR, host_config=host_config)
    api.start(resp["Id"])
    return str(resp["Id"])


class DockerSandbox(AgentSandbox):
    backend = "docker"

    def __init__(self, image: str | None = None, limits: SandboxLimits | None = None,
                 labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None) -> None:
        super().__init__(image or DEFAULT_IMAGE, limits or SandboxLimits(), labels, env)
        self._state = STATE_ROOT / "docker" / self.id
        self._sock: socket.socket | None = None
        self._name: str | None = None  # set just before the container is created
        self.container_id: str | None = None
        self._cg: _cgroup.Cgroup | None = None
        _sweep_once()
        try:
            self._start()
        except BaseException:
            self._closed = True
            self._teardown()
            raise

    def docker_labels(self) -> dict[str, str]:
        labels = {f"rl.{k}": v for k, v in self.labels.items()}
        labels.update({LABEL: "1", "rl.id": self.id, "rl.owner_pid": str(os.getpid()),
                       "rl.owner_start": str(start_time(os.getpid()) or ""), "rl.owner_host": HOST,
                       "rl.created": f"{self.created:.0f}"})
        return labels

    def _start(self) -> None:
        import docker.errors

        lim = self.limits
        # The host listens and the container connects: the state dir is mounted read-only,
        # so the sandbox cannot write to the host's disk through it.
        check_state_root()
        self._state.mkdir(parents=True, mode=0o755)
        (self._state / "owner.json").write_text(json.dumps({"owner_pid": os.getpid(),
                                                             "owner_start": start_time(os.getpid())}))
        (self._state / "agent.py").write_text(AGENT_SOURCE)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            srv.bind(str(self._state / "agent.sock"))
            os.chmod(self._state / "agent.sock", 0o666)  # the non-root user inside must connect
            srv.listen(1)
            cfg = self._agent_config(connect="/run/rl/agent.sock")
            self._name = f"rl-sb-{self.id}"
            try:
                self.container_id = _create_and_start(self.image, ["python3", "-I", "-S", "/run/rl/agent.py", cfg],
                                                      self._name, self.docker_labels(), lim, self._state)
            except docker.errors.ImageNotFound:
                raise SandboxError(f"docker image {self.image!r} not found: build it with `rl sandbox build-image`") from None
            except docker.errors.APIError as e:
                raise SandboxError(f"docker could not start a sandbox: {e.explanation or e}") from None
            except Exception as e:  # connection refused, socket missing, ...
                raise SandboxError(f"docker daemon not reachable ({type(e).__name__}); start it with "
                                   ".ci/start-docker.sh or use backend='process'") from None
            end = time.monotonic() + START_TIMEOUT
            srv.settimeout(0.5)
            while True:
                try:
                    s, _ = srv.accept()
                    break
                except socket.timeout:
                    if time.monotonic() > end:
                        raise SandboxError(f"docker sandbox agent did not connect within {START_TIMEOUT:.0f}s") from None
                    if not self._container_running():
                        raise SandboxError(f"docker sandbox exited during start: {self._logs()}") from None
        finally:
            srv.close()
        s.setblocking(True)
        self._sock = s
        self._conn = AgentConnection(s.fileno(), s.fileno())
        try:
            hello, _ = self._conn.recv(START_TIMEOUT)
        except Exception as e:
            raise SandboxError(f"docker sandbox agent did not answer: {e}; {self._logs()}") from None
        if not hello.get("ready"):
            raise SandboxError(f"docker sandbox agent said {hello}")
        self._cg = _cgroup_dir(self.container_id)

    @property
    def container(self) -> Any:
        """The docker SDK's Container object (looked up on demand)."""
        return docker_client().containers.get(self.container_id)

    def _container_running(self) -> bool:
        try:
            state = docker_client().api.inspect_container(self.container_id)["State"]
            return state["Status"] in ("created", "running")
        except Exception:
            return False

    def _logs(self) -> str:
        try:
            logs = docker_client().api.logs(self.container_id, tail=5)
            return logs.decode(errors="replace").strip().replace("\n", " | ")
        except Exception:
            return "(no logs: container gone)"

    def exec(self, cmd: Sequence[str] | str, env: Mapping[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | str | None = None, timeout: float | None = None) -> ExecResult:
        before = self._cg.oom_kills() if self._cg else 0
        r = super().exec(cmd, env=env, cwd=cwd, stdin=stdin, timeout=timeout)
        if self._cg and r.exit_code == 137 and self._cg.oom_kills() > before:
            from dataclasses import replace

            r = replace(r, error=f"killed: out of memory (limit {self.limits.memory_mb} MiB)")
        return r

    def _spawn_like(self, labels: Mapping[str, str]) -> "DockerSandbox":
        return DockerSandbox(self.image, self.limits, labels, self._env)

    def _why_lost(self) -> str | None:
        """The agent's connection dropped: ask the daemon what became of the container."""
        import docker.errors

        if self._name is None or time.monotonic() >= self._ttl_end:
            return None  # its lifetime ran out: the agent exited on its own
        what = f"docker sandbox {self.id} lost"
        try:
            state = _quick_api().inspect_container(self._name)["State"]
        except docker.errors.NotFound:
            return f"{what}: its container is gone (the Docker daemon restarted, or the container was removed)"
        except Exception:  # refused, no socket, timed out
            return f"{what}: the Docker daemon is not answering (it stopped or is restarting) and its container is gone"
        if state.get("Status") == "running":
            return None  # the container runs: the agent itself failed
        return (f"{what}: its container is gone ({state.get('Status')}, exit code {state.get('ExitCode')}; "
                "the Docker daemon restarted, or the container was stopped)")

    def _teardown(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()  # the agent exits on EOF; auto-remove deletes the container
            except OSError:
                pass
        # by name: a start the daemon cut short may have created the container without telling us its id
        if self._name is not None and not _remove(self._name):
            _remove_later(self._name)  # the daemon is down or restarting: remove it once it answers
        shutil.rmtree(self._state, ignore_errors=True)


def _remove(name: str) -> bool:
    """Force-remove a container; True once it is gone, False where the daemon did not answer in time."""
    import docker.errors

    try:
        _quick_api().remove_container(name, force=True)
    except docker.errors.NotFound:
        pass  # already auto-removed
    except docker.errors.APIError:  # auto-remove is removing it: closed means gone, so wait
        return _wait_removed(name)
    except Exception:  # refused, no socket, timed out: the daemon is down or restarting
        return False
    return True


def _wait_removed(name: str, timeout: float = 10.0) -> bool:
    """Until Docker has finished removing the container (a removal already in progress), at most
    `timeout` seconds: whoever closed the sandbox may remove its image next."""
    import docker.errors

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _quick_api().inspect_container(name)
        except docker.errors.NotFound:
            return True
        except Exception:
            return False
        time.sleep(0.05)
    return False


_orphans: set[str] = set()  # containers closed while the daemon was not answering
_orphans_lock = threading.Lock()
_reaper: threading.Thread | None = None


def _remove_later(name: str) -> None:
    """Remove a container once the daemon answers again (its owner lives on, so `gc` would not)."""
    global _reaper
    with _orphans_lock:
        _orphans.add(name)
        if _reaper is None:
            _reaper = threading.Thread(target=_reap_orphans, name="sandbox-docker-reaper", daemon=True)
            _reaper.start()


def _reap_orphans() -> None:
    global _reaper
    while True:
        time.sleep(1.0)
        with _orphans_lock:
            names = list(_orphans)
        for name in names:
            if not _remove(name):
                break  # still not answering: try them all again in a second
            with _orphans_lock:
                _orphans.discard(name)
        with _orphans_lock:
            if not _orphans:
                _reaper = None
                return


def sandbox_containers(label: str = f"{LABEL}=1") -> list[dict[str, Any]]:
    """The daemon's summary of every container (running or not) with `label`, in one call.

    Never the SDK's containers.list(): it lists, then inspects each container, and a container
    removed in between (auto-remove after its owner closed it) raises NotFound from the listing."""
    return list(docker_client().api.containers(all=True, filters={"label": label}))


def list_docker_sandboxes() -> list[dict[str, Any]]:
    out = []
    for c in sandbox_containers():
        lab = c.get("Labels") or {}
        pid = int(lab.get("rl.owner_pid") or 0)
        start = int(lab["rl.owner_start"]) if lab.get("rl.owner_start") else None
        local = lab.get("rl.owner_host") == HOST
        names = c.get("Names") or ["/" + c["Id"][:12]]
        out.append({"id": lab.get("rl.id", c["Id"][:12]), "backend": "docker", "container": names[0].lstrip("/"),
                    "status": c.get("State", "?"), "image": c.get("Image", "?"),
                    "owner_pid": pid, "owner_host": lab.get("rl.owner_host"),
                    # owners on other hosts cannot be checked from here: treat as alive
                    "owner_alive": owner_alive(pid, start) if local else True,
                    "created": float(lab.get("rl.created") or 0) or None,
                    "labels": {k[3:]: v for k, v in lab.items() if k.startswith("rl.") and k[3:] not in
                               ("sandbox", "id", "owner_pid", "owner_start", "owner_host", "created")}})
    return out


def gc_docker_sandboxes(all_: bool = False, run: str | None = None) -> list[str]:
    """Remove sandbox containers of dead owners, stopped ones, a run's, or all."""
    import docker.errors

    removed = []
    for s in list_docker_sandboxes():
        # no TTL test here: the agent enforces it (and a pool moves it at acquire)
        if run is not None:
            stale = s["labels"].get("run") == run
        else:
            stale = all_ or not s["owner_alive"] or s["status"] not in ("created", "running")
        if not stale:
            continue
        try:
            docker_client().api.remove_container(s["container"], force=True)
        except docker.errors.APIError:
            pass  # already gone (auto-removed) or being removed
        shutil.rmtree(STATE_ROOT / "docker" / s["id"], ignore_errors=True)
        removed.append(s["id"])
    sweep_state_dirs()
    return removed


def sweep_state_dirs() -> list[str]:
    """Remove the host-side dirs (agent socket, agent.py) of docker sandboxes whose owner
    died: the container itself went with its owner, this bookkeeping did not."""
    check_state_root()
    removed = []
    try:
        entries = list((STATE_ROOT / "docker").iterdir())
    except OSError:
        return removed
    for d in entries:
        try:
            meta = json.loads((d / "owner.json").read_text())
        except (OSError, ValueError):
            try:
                if time.time() - d.stat().st_mtime < 60:
                    continue  # being created right now
            except OSError:
                continue
            meta = {}
        if not owner_alive(meta.get("owner_pid"), meta.get("owner_start")):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


_SWEPT = threading.Event()


def _sweep_once() -> None:
    if not _SWEPT.is_set():
        _SWEPT.set()
        sweep_state_dirs()


def raw_docker_run_kwargs(limits: SandboxLimits) -> dict[str, Any]:
    """The same isolation settings for a plain container (benchmarks compare against it)."""
    return dict(detach=True, init=True, user=SANDBOX_USER, working_dir=WORKDIR, network_mode="none",
                mem_limit=f"{limits.memory_mb}m", memswap_limit=f"{limits.memory_mb}m",
                nano_cpus=int(limits.cpus * 1e9), pids_limit=limits.pids, read_only=True, cap_drop=["ALL"],
                security_opt=["no-new-privileges"], shm_size=f"{limits.tmp_mb}m",
                tmpfs={WORKDIR: f"size={limits.disk_mb}m,mode=0755,uid=1000,gid=1000,exec",
                       "/tmp": f"size={limits.tmp_mb}m,mode=1777,exec"},
                labels={LABEL: "1", "rl.id": "raw-bench", "rl.owner_pid": str(os.getpid()),
                        "rl.owner_start": str(start_time(os.getpid()) or ""), "rl.owner_host": HOST})

