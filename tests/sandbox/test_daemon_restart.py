"""The Docker daemon restarted under live sandboxes: SIGTERM to dockerd, then .ci/start-docker.sh.

Without live-restore the daemon stops every container on its way down, so a sandbox's container
dies with it. Held here: a call on such a sandbox (mid-exec, while the daemon is down, after it is
back) fails within seconds with SandboxDead and one line saying the container is gone and why; the
pool hands out fresh sandboxes, never the dead warm ones; closing leaves no container or state dir.

These tests stop the machine's dockerd, so they run only as root against a daemon that
.ci/start-docker.sh started (its exact command line), and always leave it answering again;
elsewhere they skip, saying why.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import sandbox
from sandbox import SandboxDead, SandboxPool
from sandbox.docker_backend import gc_docker_sandboxes, sandbox_containers
from sandbox.owner import STATE_ROOT
from sandbox_testutil import RUN, wait_for

pytestmark = pytest.mark.timeout(180)  # a hang fails the test instead of the session

START = Path(__file__).resolve().parents[2] / ".ci" / "start-docker.sh"
CMDLINE = b"dockerd\0--storage-driver=overlay2\0"  # what start-docker.sh runs
SOCK = "unix:///var/run/docker.sock"
PROMPT = 10.0  # seconds a call on a dead sandbox, or a close, may take (the daemon is asked at most 5 s)


def _answering() -> bool:
    """Whether the daemon answers now (docker_available() caches its answer for 10 s)."""
    import docker

    try:
        c = docker.DockerClient(base_url=SOCK, timeout=2)
        try:
            return bool(c.ping())
        finally:
            c.close()
    except Exception:
        return False


class Dockerd:
    @property
    def pid(self) -> int | None:
        out = subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, text=True).stdout.split()
        return int(out[0]) if out else None

    def stop(self) -> None:
        """SIGTERM, then until the process is gone (it stops every container first)."""
        pid = self.pid
        assert pid is not None, "no dockerd to stop"
        os.kill(pid, signal.SIGTERM)
        assert wait_for(lambda: not Path(f"/proc/{pid}").exists(), 60), "dockerd did not exit within 60 s of SIGTERM"

    def start(self) -> None:
        subprocess.run(["bash", str(START)], capture_output=True, timeout=120)
        assert wait_for(_answering, 30), "dockerd did not answer again (see /var/log/dockerd.log)"

    def ensure_answering(self) -> None:
        pid = self.pid
        if pid is not None:
            os.kill(pid, signal.SIGCONT)  # a test that held it stopped and failed
            if wait_for(_answering, 10):
                return
            self.stop()
        self.start()


@pytest.fixture(scope="module")
def dockerd(docker_image: str) -> Iterator[Dockerd]:
    if os.geteuid() != 0:
        pytest.skip("restarting dockerd needs root")
    if os.environ.get("DOCKER_HOST", SOCK) != SOCK:
        pytest.skip(f"DOCKER_HOST names another daemon than the local {SOCK}")
    d = Dockerd()
    pid = d.pid
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if pid else b""
    except OSError:
        cmdline = b""
    if cmdline != CMDLINE:
        pytest.skip("these tests restart dockerd with .ci/start-docker.sh: they only touch a daemon it started")
    try:
        yield d
    finally:
        d.ensure_answering()  # the Docker tests after these need it


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    hung: bool = False


class Call:
    """fn() on a thread: a call that hangs is reported, never waited for."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.out = Outcome()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.out.value = fn()
        except BaseException as e:  # noqa: BLE001
            self.out.error = e
        self.out.seconds = time.monotonic() - self._t0

    def outcome(self, limit: float = 20.0) -> Outcome:
        self._thread.join(limit)
        self.out.hung = self._thread.is_alive()
        return self.out


def _timed(fn: Callable[[], Any], limit: float = 20.0) -> Outcome:
    return Call(fn).outcome(limit)


@pytest.fixture(scope="module")
def restart(dockerd: Dockerd) -> Iterator[dict[str, Any]]:
    """Live sandboxes holding state, one of them mid-exec, and a warm pool; dockerd restarted under
    them. What each call did, and what was left after closing everything, for the tests to judge."""
    run = f"{RUN}-dockerd"
    seen: dict[str, Any] = {"run": run}
    # no health checks: acquire alone must notice the dead warm sandboxes
    pool = SandboxPool("docker", warm=2, max_live=4, episode_deadline=30.0, grading_time=10.0, health_interval=3600,
                       labels={"run": run})
    opened: list[sandbox.Sandbox] = []
    try:
        mid, down, closed_down = (sandbox.open_sandbox("docker", labels={"run": run, "episode": e})
                                  for e in ("mid", "down", "closed-down"))
        held = pool.acquire(timeout=60, labels={"episode": "held"})
        opened += [mid, down, closed_down, held]
        for sb in opened:
            sb.write_file("state.txt", sb.id)
        assert pool.wait_ready(2, timeout=60)
        mid_exec = Call(lambda: mid.exec("sleep 120", timeout=150))
        time.sleep(0.5)  # the exec is under way
        dockerd.stop()
        seen["mid"] = mid_exec.outcome()
        seen["down"] = _timed(lambda: down.read_file("state.txt"))
        seen["close_down"] = _timed(closed_down.close)
        dockerd.start()
        seen["after"] = _timed(lambda: held.exec("cat state.txt"))
        seen["again"] = _timed(lambda: held.exec("true"))
        got = _timed(lambda: pool.acquire(timeout=60), limit=90)
        seen["acquire"] = got
        if got.value is not None:
            fresh = got.value
            opened.append(fresh)
            seen["fresh_exec"] = _timed(lambda: fresh.exec("echo fresh"))
            seen["fresh_state"] = _timed(lambda: fresh.read_file("state.txt"))
        seen["dead_replaced"] = pool.status()["dead_replaced"]
        for sb in opened:
            sb.close()
        pool.close()
        wait_for(lambda: not sandbox_containers(f"rl.run={run}"), 15)
        seen["containers_left"] = [c["Names"] for c in sandbox_containers(f"rl.run={run}")]
        seen["state_dirs_left"] = [sb.id for sb in opened if (STATE_ROOT / "docker" / sb.id).exists()]
        yield seen
    finally:
        dockerd.ensure_answering()
        pool.close()
        for sb in opened:
            sb.close()
        gc_docker_sandboxes(run=run)


def _gone_in_one_line(o: Outcome) -> str:
    """The call failed within seconds with SandboxDead and one line saying the container is gone."""
    assert not o.hung, "the call hung"
    assert isinstance(o.error, SandboxDead), f"expected SandboxDead, got {o.error!r}"
    msg = str(o.error)
    assert "\n" not in msg and "container is gone" in msg and "Docker daemon" in msg, msg
    assert o.seconds < PROMPT, f"took {o.seconds:.1f}s"
    return msg


def test_a_call_mid_exec_fails_at_once_in_one_line(restart: dict[str, Any]):
    _gone_in_one_line(restart["mid"])


def test_a_call_while_the_daemon_is_down_fails_in_one_line(restart: dict[str, Any]):
    _gone_in_one_line(restart["down"])


def test_a_call_after_the_restart_says_the_container_is_gone(restart: dict[str, Any]):
    msg = _gone_in_one_line(restart["after"])
    assert "restarted" in msg, msg
    again = restart["again"]
    assert isinstance(again.error, SandboxDead) and str(again.error) == msg  # every later call says why


def test_the_pool_replaces_dead_sandboxes_on_acquire(restart: dict[str, Any]):
    got = restart["acquire"]
    assert not got.hung and got.error is None, repr(got.error)
    assert restart["dead_replaced"] >= 2  # both warm sandboxes were found dead, neither handed out
    assert restart["fresh_exec"].value.stdout == "fresh\n"
    assert isinstance(restart["fresh_state"].error, FileNotFoundError)  # a fresh sandbox, not a survivor


def test_nothing_is_left_after_close(restart: dict[str, Any]):
    closing = restart["close_down"]
    assert not closing.hung and closing.error is None, f"close() while the daemon was down: {closing.error!r}"
    assert restart["containers_left"] == []
    assert restart["state_dirs_left"] == []


def test_a_daemon_that_does_not_answer_never_hangs_a_sandbox(dockerd: Dockerd):
    """A daemon that accepts connections but does not answer them, as one does while it restarts
    (held there by SIGSTOP): commands still run, close() returns within seconds, and the
    container and its state dir are gone once the daemon answers again."""
    run = f"{RUN}-dockerd-hung"
    sb = sandbox.open_sandbox("docker", labels={"run": run})
    pid = dockerd.pid
    assert pid is not None
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            ran = _timed(lambda: sb.exec("echo still here"))
            closing = _timed(sb.close, limit=PROMPT)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert ran.error is None and ran.value.stdout == "still here\n"  # commands never go through the daemon
        assert not closing.hung, "close() hung on a daemon that does not answer"
        assert closing.error is None, f"close(): {closing.error!r}"
        assert wait_for(lambda: not sandbox_containers(f"rl.run={run}"), 15)
        assert not (STATE_ROOT / "docker" / sb.id).exists()
    finally:
        sb.close()
        gc_docker_sandboxes(run=run)
