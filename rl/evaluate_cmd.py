"""`rl eval CONFIG [--checkpoint DIR] [--efforts low,medium,high,max]`: held-out reward of a saved
policy (or of the config's pretrained model, before RL), per domain and effort level, and the
effort Pareto: accuracy against tokens used per level (table, JSON, PNG)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import ray

from kimi_vocab.effort import EFFORT_LEVELS
from rl.cluster import env_kwargs, start_env_side, start_policy_side, start_ray
from rl.config import load_config
from rl.evaluation import effort_table, eval_table, summarise_eval, write_pareto
from rl.errors import RunRefused
from rl.integrity import verify_manifest
from rl.rollout.layout import tool_fallback_warnings
from rl.run_folder import CHECKPOINT_HF, TOKENIZER, is_checkpoint_dir
from rl.trainer import _check_environments


def resolve_checkpoint(path: str) -> Path:
    """Accept a save_pretrained folder or a training checkpoint folder (which holds one in hf/),
    if it is whole: see check_whole."""
    root = Path(path)
    for candidate in (root, root / CHECKPOINT_HF):
        if (candidate / "config.json").exists():
            if not (candidate / TOKENIZER).exists():
                raise RunRefused(f"--checkpoint: {candidate} has no {TOKENIZER}/ folder")
            check_whole(candidate)
            return candidate
    raise RunRefused(f"--checkpoint: no config.json in {root} or {root / CHECKPOINT_HF}")


def check_whole(model_dir: Path) -> None:
    """Refuse, in one line, a policy folder whose weights are torn: a training checkpoint (the folder
    is its hf/) must match its manifest, and every safetensors file must be whole."""
    from policy.checkpoint import check_safetensors

    checkpoint = model_dir.resolve().parent
    if model_dir.name == CHECKPOINT_HF and is_checkpoint_dir(checkpoint):
        problem = verify_manifest(checkpoint)
        if problem is not None:
            raise RunRefused(f"--checkpoint: {checkpoint} is torn: {problem}")
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise RunRefused(f"--checkpoint: no .safetensors files in {model_dir}")
    for f in weights:
        try:
            check_safetensors(f)
        except ValueError as exc:
            raise RunRefused(f"--checkpoint: {exc}") from None


def evaluate_checkpoint(config_path: str, checkpoint: str | None, overrides: list[str], console=None,
                        output: str | None = None, efforts: list[str] | None = None) -> dict:
    """Evaluate a checkpoint (None: the config's `model.hf_path`, the model before RL) on the config's
    environments at `efforts` (default: eval.efforts). The summary is written to `output` (default:
    eval.json beside the checkpoint's config.json, or in the working directory for the model before
    RL) and returned; the effort Pareto (accuracy against tokens used per level) beside it as
    <stem>_pareto.json and .png."""
    from policy import load_tokenizer

    cfg = load_config(config_path, overrides)
    _check_environments(cfg)  # as `rl train` does: a bad environment kwarg is one line, before Ray
    if efforts:
        unknown = [e for e in efforts if e not in EFFORT_LEVELS]
        if unknown:
            raise RunRefused(f"--efforts: unknown level {unknown[0]!r}; expected some of {','.join(EFFORT_LEVELS)}")
        missing = [e for e in efforts if e not in cfg.effort.budgets]
        if missing:
            raise RunRefused(f"--efforts: level {missing[0]!r} has no budget in the config's effort.budgets")
        cfg.eval.efforts = list(efforts)
    if checkpoint is None:
        if not cfg.model.hf_path:
            raise RunRefused("--checkpoint is needed: the config's model has no pretrained weights (model.hf_path) "
                             "to evaluate before RL")
        model_dir = Path(cfg.model.hf_path)
        if not (model_dir / "config.json").exists():
            raise RunRefused(f"model.hf_path: no config.json in {model_dir}")
        tok_dir = Path(tempfile.mkdtemp(prefix="rl-eval-tokenizer-"))
        tok = load_tokenizer(str(model_dir))
        tok.save(str(tok_dir))  # the tokenizer alone travels to the workers, not the model's folder
        label, run_id, default_out = f"{model_dir} (before RL)", f"eval-{model_dir.name}", Path("eval.json")
    else:
        if "://" in checkpoint:  # a checkpoint in object storage (checkpoint.dir): verified on this disk first
            from rl.checkpoint_store import fetch_checkpoint

            checkpoint = str(fetch_checkpoint(checkpoint, Path(tempfile.mkdtemp(prefix="rl-eval-"))))
        model_dir = resolve_checkpoint(checkpoint)
        tok_dir = model_dir / TOKENIZER
        tok = load_tokenizer(str(tok_dir))
        label, run_id = checkpoint, f"eval-{model_dir.parent.name}-{model_dir.name}"
        default_out = model_dir / "eval.json"
    if console is not None:
        for line in tool_fallback_warnings(tok, _env_tools(cfg)):
            console.print(line, highlight=False, soft_wrap=True)
    started = start_ray(cfg)
    actors = None
    try:
        env_workers = start_env_side(cfg, run_id)
        spec = {"path": str(model_dir)}
        actors = start_policy_side(cfg, run_id, spec, str(tok_dir), tok.pad_id, env_workers, with_learner=False)
        e = cfg.eval
        result = ray.get(actors.scheduler.evaluate.remote([x.name for x in cfg.envs], e.efforts, e.tasks_per_env,
                                                          e.samples_per_task, e.temperature, "eval"))
        samples = result.samples
        if result.failure_line() and console is not None:
            console.print(result.failure_line(), highlight=False, soft_wrap=True)
        if not samples:  # an empty table would read as a result
            raise RunRefused(f"evaluating {label} produced no episodes; there is nothing to report")
        summary = summarise_eval(samples)
        out = Path(output) if output else default_out
        out.write_text(json.dumps(summary, indent=1))
        files = write_pareto({label: summary}, out.with_name(f"{out.stem}_pareto.json"),
                             f"{label}: held-out, per effort level")
        if console is not None:
            console.print(eval_table(None, summary, title=f"Held-out reward of {label} (+- standard error)"))
            console.print(effort_table(None, summary))
            console.print(f"written: {out}, {', '.join(str(f) for f in files)}")
        return summary
    finally:
        if actors is not None:
            actors.shutdown()
        if started:
            ray.shutdown()


def _env_tools(cfg) -> dict[str, list[dict]]:
    """Each configured environment's tool schemas (built here: no episode, no sandbox)."""
    from envs.registry import resolve

    return {e.name: resolve(e.name, env_kwargs(cfg, e.name)).make().tools for e in cfg.envs}
