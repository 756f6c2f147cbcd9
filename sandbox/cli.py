"""`rl sandbox ...`: run one command in a fresh sandbox, list, clean up, build images."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

sandbox_app = typer.Typer(help="Isolated sandboxes (Docker or process backend).", no_args_is_help=True)


@sandbox_app.command("run", context_settings={"ignore_unknown_options": True})
def run_cmd(
    cmd: List[str] = typer.Argument(..., help="Command after `--`; a single argument runs through /bin/sh -c."),
    backend: str = typer.Option("auto", "--backend", "-b", help="docker | process | auto"),
    image: Optional[str] = typer.Option(None, "--image", help="Docker image, or a rootfs dir for process."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds before the command is killed (exit 124)."),
    memory: int = typer.Option(1024, "--memory", help="Memory limit in MiB."),
    network: bool = typer.Option(False, "--network/--no-network", help="Allow network access (off by default)."),
) -> None:
    """Run CMD in a fresh sandbox, print its output, exit with its exit code (124 on timeout)."""
    from . import SandboxError, SandboxLimits, open_sandbox

    try:
        # the work dir and /tmp live in the sandbox's memory: give them a share of it
        limits = SandboxLimits(memory_mb=memory, disk_mb=max(1, memory // 2), tmp_mb=max(1, memory // 8),
                               network=network, exec_timeout=timeout, ttl=timeout + 60)
        command: list[str] | str = cmd[0] if len(cmd) == 1 else list(cmd)
        with open_sandbox(backend, image=image, limits=limits, labels={"run": "cli", "episode": "cli-run"}) as sb:
            r = sb.exec(command, timeout=timeout)
    except (SandboxError, ValueError) as e:
        typer.echo(f"sandbox: {e}", err=True)
        raise typer.Exit(125)
    sys.stdout.write(r.stdout)
    sys.stdout.flush()
    sys.stderr.write(r.stderr)
    if r.stdout_truncated or r.stderr_truncated:
        typer.echo("sandbox: output truncated", err=True)
    if r.error:
        typer.echo(f"sandbox: {r.error}", err=True)
    raise typer.Exit(r.exit_code)


def _all_sandboxes() -> list[dict]:
    from .docker_backend import docker_available, list_docker_sandboxes
    from .process_backend import list_process_sandboxes

    rows = list_process_sandboxes()
    for r in rows:
        r.setdefault("backend", "process")
        r["status"] = "running" if r.get("owner_alive") else "orphaned"
    if docker_available():
        rows += list_docker_sandboxes()
    return rows


@sandbox_app.command("ls")
def ls_cmd(as_json: bool = typer.Option(False, "--json", help="One JSON object per line.")) -> None:
    """List the sandboxes this project started on this node (both backends)."""
    rows = _all_sandboxes()
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r, default=str))
        return
    if not rows:
        typer.echo("no sandboxes")
        return
    now = time.time()
    typer.echo(f"{'ID':<14}{'BACKEND':<9}{'STATUS':<10}{'OWNER':<14}{'AGE':>8}  LABELS")
    for r in rows:
        owner = f"{r.get('owner_pid')}{'' if r.get('owner_alive') else ' (dead)'}"
        age = f"{(now - r['created']):.0f}s" if r.get("created") else "-"
        labels = ",".join(f"{k}={v}" for k, v in (r.get("labels") or {}).items())
        typer.echo(f"{r['id']:<14}{r['backend']:<9}{r.get('status', '?'):<10}{owner:<14}{age:>8}  {labels}")


@sandbox_app.command("gc")
def gc_cmd(
    all_: bool = typer.Option(False, "--all", help="Remove every sandbox, even ones with a live owner."),
    run: Optional[str] = typer.Option(None, "--run", help="Remove the sandboxes of this run only."),
) -> None:
    """Remove sandboxes whose owner died or that stopped (or --all / --run). TTLs are
    enforced inside each sandbox."""
    from .docker_backend import docker_available, gc_docker_sandboxes
    from .process_backend import gc_process_sandboxes

    removed = [] if run else gc_process_sandboxes(all_=all_)
    if docker_available():
        removed += gc_docker_sandboxes(all_=all_, run=run)
    typer.echo(f"removed {len(removed)} sandbox(es)" + (": " + " ".join(removed) if removed else ""))


@sandbox_app.command("build-image")
def build_image_cmd(
    name: Optional[str] = typer.Option(None, "--name", help="Image name (default: the base image)."),
    dockerfile: Optional[Path] = typer.Option(None, "--dockerfile", "-f", help="Build an env image from this "
                                              "Dockerfile (FROM the base), context = its directory."),
    force: bool = typer.Option(False, "--force", help="Rebuild the base image even if present."),
    network: bool = typer.Option(False, "--network", help="Allow network during an env image build."),
) -> None:
    """Build the Python base image (debootstrap + docker import), or an env image on top of it."""
    from . import SandboxError
    from .docker_backend import docker_available
    from .images import BASE_IMAGE, build_base_image, build_env_image

    if not docker_available():
        typer.echo("sandbox: no docker daemon answers (run .ci/start-docker.sh)", err=True)
        raise typer.Exit(1)
    try:
        if dockerfile is not None:
            if not dockerfile.is_file():
                raise SandboxError(f"no such Dockerfile: {dockerfile}")
            build_base_image(BASE_IMAGE, log=typer.echo)
            tag = build_env_image(name or f"rl-env-{dockerfile.resolve().parent.name}:latest",
                                  context=dockerfile.parent, dockerfile_name=dockerfile.name, network=network,
                                  log=typer.echo)
        else:
            tag = build_base_image(name or BASE_IMAGE, force=force, log=typer.echo)
    except SandboxError as e:
        typer.echo(f"sandbox: {e}", err=True)
        raise typer.Exit(1)
    typer.echo(tag)
