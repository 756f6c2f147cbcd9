"""`rl env ...` commands: list, check, register (mounted by rl/cli.py as env_app)."""
from __future__ import annotations

import json
from typing import Optional

import typer

env_app = typer.Typer(help="Environments: list, check, register.", no_args_is_help=True)


def _parse_kwargs(pairs: list[str]) -> dict:
    """key=value pairs; values are parsed as JSON when they can be (numbers, booleans, lists)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected key=value, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@env_app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Show every registered environment: name, domain, tools, dataset sizes, last check."""
    from dataclasses import asdict

    from envs.registry import list_envs

    specs = list_envs()
    if as_json:
        typer.echo(json.dumps([asdict(s) for s in specs], indent=1, default=str))
        return
    typer.echo(f"{'name':<16} {'domain':<14} {'tools':<10} {'train':>6} {'heldout':>7}  last check")
    for s in specs:
        sizes = s.dataset_sizes or {}
        if s.last_check is None:
            check = "never"
        else:
            check = "ok" if s.last_check.get("ok") else "FAILED: " + "; ".join(s.last_check.get("reasons", []))[:80]
        if s.error:
            check = f"ERROR: {s.error[:80]}"
        typer.echo(f"{s.name:<16} {s.domain:<14} {','.join(s.tools) or '-':<10} {sizes.get('train', '-'):>6} "
                   f"{sizes.get('heldout', '-'):>7}  {check}")


@env_app.command("check")
def check_cmd(
    name: str = typer.Argument(..., help="a registered environment name"),
    as_json: bool = typer.Option(False, "--json", help="print the full report as JSON"),
    max_tasks: int = typer.Option(16, "--max-tasks", min=1, help="how many train tasks to check"),
    replays: int = typer.Option(3, "--replays", min=1, help="reference replays per task (flakiness)"),
    kwarg: Optional[list[str]] = typer.Option(None, "--kwarg", "-k", help="env constructor argument key=value"),
) -> None:
    """Run the quality gate; exit code 1 when the environment fails it."""
    from envs.quality import check_env

    report = check_env(name, _parse_kwargs(kwarg or []), max_tasks=max_tasks, replays=replays)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=1))
    else:
        verdict = "ok" if report["ok"] else "FAILED"
        typer.echo(f"{name}: {verdict} ({report['tasks']} tasks)")
        for key in ("oracle_pass_rate", "null_pass_rate", "adversarial_pass_rate", "deterministic", "flaky_rate"):
            if key in report:
                typer.echo(f"  {key}: {report[key]}")
        typer.echo(f"  leaks: {len(report.get('leaks', []))}")
        for stage, t in report.get("timings", {}).items():
            typer.echo(f"  {stage}: mean {t['mean_s'] * 1000:.1f} ms, max {t['max_s'] * 1000:.1f} ms (n={t['n']})")
        for reason in report["reasons"]:
            typer.echo(f"  reason: {reason}")
    if not report["ok"]:
        raise typer.Exit(1)


@env_app.command("register")
def register_cmd(
    spec: str = typer.Argument(..., help="path/to/file.py:ClassName"),
    name: Optional[str] = typer.Option(None, "--name", help="register under this name instead of the class's"),
) -> None:
    """Register an environment class from a local file (remembered across runs)."""
    from envs.registry import register_file, registry_dir

    try:
        env_name = register_file(spec, name=name)
    except (ValueError, FileNotFoundError, AttributeError, TypeError, ImportError, SyntaxError) as exc:
        typer.echo(f"error: cannot register {spec}: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"registered {env_name} -> {spec} (in {registry_dir() / 'registry.json'})")
