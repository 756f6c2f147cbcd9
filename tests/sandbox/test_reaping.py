"""A killed owner leaves nothing behind; labels and gc find what a run started."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import sandbox
from sandbox_testutil import RUN, host_pids, wait_for

REPO = Path(__file__).resolve().parents[2]

OWNER = """
import sys, time
sys.path.insert(0, {repo!r})
import sandbox
sb = sandbox.open_sandbox({backend!r}, labels={{"run": {run!r}, "episode": "owner-killed"}})
sb.exec("setsid sleep {marker} >/dev/null 2>&1 &")
sb.exec("sleep {marker}.5 >/dev/null 2>&1 &")
print(sb.id, flush=True)
sb.exec("sleep 600")  # killed while an exec is in flight
"""


def test_killed_owner_leaves_no_container_or_process(backend: str):
    marker = str(600000 + uuid.uuid4().int % 99999)
    code = OWNER.format(repo=str(REPO), backend=backend, run=RUN, marker=marker)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ))
    try:
        line = owner.stdout.readline().decode().strip()  # type: ignore[union-attr]
        assert line, owner.stderr.read().decode()  # type: ignore[union-attr]
        sb_id = line
        assert wait_for(lambda: len(host_pids(f"sleep\0{marker}")) >= 2, 5)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert wait_for(lambda: not host_pids(f"sleep\0{marker}"), 15), "sandboxed processes outlived their owner"
    if backend == "docker":
        from sandbox.docker_backend import sandbox_containers

        def gone() -> bool:
            return not sandbox_containers(f"rl.id={sb_id}")

        assert wait_for(gone, 15), "container outlived its owner"
        from sandbox.docker_backend import gc_docker_sandboxes
        from sandbox.owner import STATE_ROOT

        gc_docker_sandboxes()  # the host-side socket dir goes too
        assert not (STATE_ROOT / "docker" / sb_id).exists()
    else:
        from sandbox.process_backend import PROCESS_STATE, gc_process_sandboxes

        # processes are gone already; gc reaps the bookkeeping of a dead owner (another
        # process on this node may have swept it first: the outcome is what matters)
        from sandbox._cgroup import find_stale

        gc_process_sandboxes()
        assert not (PROCESS_STATE / sb_id).exists()
        assert not [d for d in find_stale(set()) if d.name == f"rl-sb-{sb_id}"]


def test_labels_listing_and_gc_by_run(make_sb, backend: str):
    from typer.testing import CliRunner

    from sandbox.cli import sandbox_app

    run = f"{RUN}-gc"
    sb = make_sb("listed", labels={"run": run})
    rows = CliRunner().invoke(sandbox_app, ["ls", "--json"])
    assert rows.exit_code == 0
    mine = [json.loads(x) for x in rows.output.splitlines() if sb.id in x]
    assert len(mine) == 1
    assert mine[0]["labels"]["run"] == run and mine[0]["labels"]["episode"] == "listed"
    assert mine[0]["owner_pid"] == os.getpid() and mine[0]["owner_alive"]
    # plain gc leaves a live owner's sandbox alone
    assert CliRunner().invoke(sandbox_app, ["gc"]).exit_code == 0
    assert sb.exec("echo still").stdout == "still\n"
    if backend == "docker":
        from sandbox.docker_backend import docker_client

        c = docker_client().containers.get(f"rl-sb-{sb.id}")
        assert c.labels["rl.run"] == run and c.labels["rl.owner_pid"] == str(os.getpid())
        hc = c.attrs["HostConfig"]
        assert hc["ReadonlyRootfs"] and hc["CapDrop"] == ["ALL"] and hc["NetworkMode"] == "none"
        assert "no-new-privileges" in hc["SecurityOpt"] and not hc["Privileged"]
        assert hc["PidsLimit"] == sb.limits.pids and hc["Memory"] == sb.limits.memory_mb << 20
        assert c.attrs["Config"]["User"] == "1000:1000"
        res = CliRunner().invoke(sandbox_app, ["gc", "--run", run])
        assert res.exit_code == 0 and sb.id in res.output
        with pytest.raises(sandbox.SandboxDead):
            for _ in range(100):
                sb.exec("true")
                time.sleep(0.05)


def test_listing_and_gc_tolerate_containers_removed_meanwhile(docker_image: str, monkeypatch: pytest.MonkeyPatch):
    """A container auto-removed between the daemon's list and a per-container inspect (its owner
    closed it) must not make `ls`/`gc` fail: every inspect answers NotFound here."""
    import docker.errors

    from sandbox.docker_backend import docker_client, gc_docker_sandboxes, list_docker_sandboxes

    def removed_meanwhile(*_a: object, **_k: object) -> None:
        raise docker.errors.NotFound("No such container")

    run = f"{RUN}-race"
    with sandbox.open_sandbox("docker", labels={"run": run, "episode": "race"}) as sb:
        with monkeypatch.context() as m:
            m.setattr(docker_client().api, "inspect_container", removed_meanwhile)
            m.setattr(docker_client().api, "remove_container", removed_meanwhile)  # gc finds it gone already
            assert sb.id in [s["id"] for s in list_docker_sandboxes()]
            assert gc_docker_sandboxes(run=run) == [sb.id]
