"""`rl sandbox ...` through typer's CliRunner, and env images built FROM the base offline."""
from __future__ import annotations

import uuid
from pathlib import Path

from typer.testing import CliRunner

import sandbox
from sandbox.cli import sandbox_app

runner = CliRunner()


def test_run_prints_output_and_exits_with_the_code(backend_name: str):
    res = runner.invoke(sandbox_app, ["run", "--backend", backend_name, "--", "sh", "-c", "echo out; echo err >&2; exit 3"])
    assert res.exit_code == 3, res.output
    assert "out\n" in res.output and "err\n" in res.output
    res = runner.invoke(sandbox_app, ["run", "-b", backend_name, "--", "echo piped | tr a-z A-Z"])
    assert res.exit_code == 0 and res.output == "PIPED\n"


def test_run_timeout_exits_124(backend_name: str):
    res = runner.invoke(sandbox_app, ["run", "-b", backend_name, "--timeout", "0.5", "--", "sleep", "30"])
    assert res.exit_code == 124 and "timed out" in res.output


def test_run_memory_and_network_flags(backend_name: str):
    hog = ["python3", "-c", "x = bytearray(300 << 20)"]
    res = runner.invoke(sandbox_app, ["run", "-b", backend_name, "--memory", "64", "--", *hog])
    assert res.exit_code != 0
    assert runner.invoke(sandbox_app, ["run", "-b", backend_name, "--memory", "512", "--", *hog]).exit_code == 0
    probe = ["python3", "-c", "import socket; print(len(socket.if_nameindex()))"]
    off = runner.invoke(sandbox_app, ["run", "-b", backend_name, "--", *probe])
    on = runner.invoke(sandbox_app, ["run", "-b", backend_name, "--network", "--", *probe])
    assert off.exit_code == 0 and on.exit_code == 0
    assert int(off.output) == 1 and int(on.output) > 1  # loopback only, unless --network


def test_run_reports_setup_errors_in_one_line():
    res = runner.invoke(sandbox_app, ["run", "-b", "process", "--image", "/no/such/rootfs", "--", "true"])
    assert res.exit_code == 125 and res.output.startswith("sandbox: ") and res.output.count("\n") == 1


def test_ls_and_gc_run():
    res = runner.invoke(sandbox_app, ["ls"])
    assert res.exit_code == 0
    res = runner.invoke(sandbox_app, ["gc"])
    assert res.exit_code == 0 and res.output.startswith("removed ")


def test_env_image_from_dockerfile_builds_offline(docker_image: str, tmp_path: Path):
    from sandbox.docker_backend import docker_client

    token = uuid.uuid4().hex[:6]
    tag = f"rl-env-test-{token}:latest"
    # unique content: a build that shares cached layers with another session's identical build
    # fails when that session removes its image (and the layers) meanwhile
    (tmp_path / "tool.py").write_text(f"print('tool {token} ready')\n")
    (tmp_path / "Dockerfile").write_text(f"FROM {docker_image}\nCOPY tool.py /opt/env/tool.py\n"
                                         "USER 0\nRUN chmod 0644 /opt/env/tool.py\nUSER 1000:1000\n")
    try:
        res = runner.invoke(sandbox_app, ["build-image", "--dockerfile", str(tmp_path / "Dockerfile"), "--name", tag])
        assert res.exit_code == 0, res.output
        with sandbox.open_sandbox("docker", image=tag) as sb:
            assert sb.exec(["python3", "/opt/env/tool.py"]).stdout == f"tool {token} ready\n"
        res = runner.invoke(sandbox_app, ["build-image"])
        assert res.exit_code == 0 and "already present" in res.output
    finally:
        try:
            docker_client().images.remove(tag, force=True)
        except Exception:
            pass
