"""`rl eval CONFIG --checkpoint DIR`: held-out reward of a saved policy, per domain and effort."""
from __future__ import annotations

import json
from pathlib import Path

import ray

from rl.cluster import start_env_side, start_policy_side, start_ray
from rl.config import load_config
from rl.evaluation import eval_table, summarise_eval
from rl.errors import RunRefused
from rl.integrity import verify_manifest
from rl.run_folder import is_checkpoint_dir


def resolve_checkpoint(path: str) -> Path:
    """Accept a save_pretrained folder or a training checkpoint folder (which holds one in hf/),
    if it is whole: see check_whole."""
    root = Path(path)
    for candidate in (root, root / "hf"):
        if (candidate / "config.json").exists():
            if not (candidate / "tokenizer").exists():
                raise RunRefused(f"--checkpoint: {candidate} has no tokenizer/ folder")
            check_whole(candidate)
            return candidate
    raise RunRefused(f"--checkpoint: no config.json in {root} or {root / 'hf'}")


def check_whole(model_dir: Path) -> None:
    """Refuse, in one line, a policy folder whose weights are torn: a training checkpoint (the folder
    is its hf/) must match its manifest, and every safetensors file must be whole."""
    from policy.checkpoint import check_safetensors

    checkpoint = model_dir.resolve().parent
    if model_dir.name == "hf" and is_checkpoint_dir(checkpoint):
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


def evaluate_checkpoint(config_path: str, checkpoint: str, overrides: list[str], console=None,
                        output: str | None = None) -> dict:
    """Evaluate a checkpoint on the config's environments; the summary is written to `output`
    (default: eval.json beside the checkpoint's config.json) and returned."""
    from policy import load_tokenizer

    cfg = load_config(config_path, overrides)
    model_dir = resolve_checkpoint(checkpoint)
    tok = load_tokenizer(str(model_dir / "tokenizer"))
    started = start_ray(cfg)
    actors = None
    run_id = f"eval-{model_dir.parent.name}-{model_dir.name}"
    try:
        env_workers = start_env_side(cfg, run_id)
        spec = {"path": str(model_dir)}
        actors = start_policy_side(cfg, run_id, spec, str(model_dir / "tokenizer"), tok.pad_id, env_workers,
                                   with_learner=False)
        e = cfg.eval
        samples = ray.get(actors.scheduler.evaluate.remote([x.name for x in cfg.envs], e.efforts, e.tasks_per_env,
                                                           e.samples_per_task, e.temperature, "eval"))
        if not samples:  # an empty table would read as a result
            raise RunRefused(f"--checkpoint: evaluating {checkpoint} produced no episodes; there is nothing to report")
        summary = summarise_eval(samples)
        out = Path(output) if output else model_dir / "eval.json"
        out.write_text(json.dumps(summary, indent=1))
        if console is not None:
            console.print(eval_table(None, summary, title=f"Held-out reward of {checkpoint} (+- standard error)"))
            console.print(f"written: {out}")
        return summary
    finally:
        if actors is not None:
            actors.shutdown()
        if started:
            ray.shutdown()
