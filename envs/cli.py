"""`rl env ...` commands: list, check, register, unregister (mounted by rl/cli.py as env_app)."""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator, Optional

import typer

env_app = typer.Typer(help="Environments: list, check, register, unregister.", no_args_is_help=True)


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


@contextmanager
def _registry_errors() -> Iterator[None]:
    """A registry that cannot be read (a corrupt registry.json) is one line and exit code 2."""
    from envs.registry import EnvRegistryError

    try:
        yield
    except EnvRegistryError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@env_app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Show every registered environment: name, domain, tools, dataset sizes, last check."""
    from dataclasses import asdict

    from envs.registry import list_envs

    with _registry_errors():
        specs = list_envs()
    if as_json:
        typer.echo(json.dumps([asdict(s) for s in specs], indent=1, default=str))
        return
    typer.echo(f"{'name':<16} {'domain':<14} {'tools':<10} {'train':>6} {'heldout':>7} {'domains':>7}  "
               f"last check (this class version)")
    for s in specs:
        sizes = s.dataset_sizes or {}
        if s.last_check is None:
            check = "never" + (f" (the class changed since its last check)" if s.older_checks else "")
        else:
            check = "ok" if s.last_check.get("ok") else "FAILED: " + "; ".join(s.last_check.get("reasons", []))[:80]
        if s.error:
            check = f"ERROR: {s.error[:80]}"
        typer.echo(f"{s.name:<16} {s.domain:<14} {','.join(s.tools) or '-':<10} {sizes.get('train', '-'):>6} "
                   f"{sizes.get('heldout', '-'):>7} {s.domains or '-':>7}  {check}")


@env_app.command("domains")
def domains_cmd(
    pattern: str = typer.Argument(..., help="a family or a pattern over its domains: math, 'math:add-*', '*:*'"),
    kwarg: Optional[list[str]] = typer.Option(None, "--kwarg", "-k", help="the entry's kwargs (data_files=...)"),
) -> None:
    """List the domains a family declares (what a run config's `name: FAMILY:PATTERN` expands to)."""
    from envs.families import SEP, match
    from envs.registry import family_domains

    kwargs = _parse_kwargs(kwarg or [])
    with _registry_errors():
        for domain in match(pattern if SEP in pattern else f"{pattern}{SEP}*", kwargs):
            family, _, member = domain.partition(SEP)
            made_by = family_domains(family, kwargs)[member]
            typer.echo(f"{domain:<32} {', '.join(f'{k}={v!r}' for k, v in made_by.items())}")


@env_app.command("check")
def check_cmd(
    name: str = typer.Argument(..., help="a registered environment name"),
    as_json: bool = typer.Option(False, "--json", help="print the full report as JSON"),
    max_tasks: Optional[int] = typer.Option(None, "--max-tasks", min=1, help="tasks checked per split (default: all)"),
    split: Optional[list[str]] = typer.Option(None, "--split", help="check only this split (repeatable; default: all)"),
    replays: int = typer.Option(3, "--replays", min=1, help="reference replays per task (flakiness)"),
    kwarg: Optional[list[str]] = typer.Option(None, "--kwarg", "-k", help="env constructor argument key=value"),
) -> None:
    """Run the quality gate on every split; exit code 1 when the environment fails it."""
    from envs.data import SPLITS
    from envs.quality import check_env

    bad = sorted(set(split or []) - set(SPLITS))
    if bad:
        raise typer.BadParameter(f"unknown split {bad[0]!r}; expected one of {', '.join(SPLITS)}", param_hint="--split")
    with _registry_errors():
        report = check_env(name, _parse_kwargs(kwarg or []), max_tasks=max_tasks, replays=replays,
                           splits=tuple(split) if split else SPLITS)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=1))
    else:
        _print_report(name, report)
    if not report["ok"]:
        raise typer.Exit(1)


def _print_report(name: str, report: dict) -> None:
    verdict = "ok" if report["ok"] else "FAILED"
    splits = ", ".join(f"{n} {s}" for s, n in report.get("splits", {}).items())
    typer.echo(f"{name}: {verdict} ({report['tasks']} tasks: {splits})" if splits else f"{name}: {verdict} (0 tasks)")
    for key in ("oracle_pass_rate", "null_pass_rate", "adversarial_pass_rate", "deterministic", "flaky_rate", "per_task_s"):
        if key in report:
            typer.echo(f"  {key}: {report[key]}")
    typer.echo(f"  leaks: {len(report.get('leaks', []))}")
    typer.echo(f"  adversaries: {', '.join(report.get('adversaries', []))}")
    for stage, t in report.get("timings", {}).items():
        typer.echo(f"  {stage}: mean {t['mean_s'] * 1000:.1f} ms, max {t['max_s'] * 1000:.1f} ms (n={t['n']})")
    for line in report.get("reported", []):
        typer.echo(f"  reported: {line}")
    for reason in report["reasons"]:
        typer.echo(f"  reason: {reason}")
    for f in report.get("findings", [])[:3]:
        typer.echo(f"  transcript of '{f['adversary']}' on {f['task_id']} ({f['split']}):")
        for m in f["transcript"][1:]:
            text = m["content"] if len(m["content"]) < 300 else m["content"][:300] + "..."
            typer.echo(f"    {m['role']}: {text}")


@env_app.command("register")
def register_cmd(
    spec: str = typer.Argument(..., help="path/to/file.py:ClassName"),
    name: Optional[str] = typer.Option(None, "--name", help="register under this name instead of the class's"),
    replace: bool = typer.Option(False, "--replace", help="replace the class registered under this name"),
) -> None:
    """Register an environment class from a local file (remembered across runs)."""
    from envs.registry import register_file, registry_dir

    try:
        env_name = register_file(spec, name=name, replace=replace)
    except (ValueError, FileNotFoundError, AttributeError, TypeError, ImportError, SyntaxError) as exc:
        typer.echo(f"error: cannot register {spec}: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"registered {env_name} -> {spec} (in {registry_dir() / 'registry.json'})")


@env_app.command("unregister")
def unregister_cmd(name: str = typer.Argument(..., help="a registered environment name")) -> None:
    """Forget an environment registered from a file (and its recorded checks)."""
    from envs.registry import unregister

    with _registry_errors():
        target = unregister(name)
    typer.echo(f"unregistered {name} (was {target})")
