"""`rl eval CONFIG --checkpoint DIR`: held-out reward of a saved policy, per domain and effort."""
from __future__ import annotations

import json
from pathlib import Path

import ray

from rl.cluster import start_env_side, start_policy_side, start_ray
from rl.config import load_config
from rl.evaluation import eval_table, summarise_eval
from rl.errors import RunRefused


def resolve_checkpoint(path: str) -> Path:
    """Accept a save_pretrained folder or a training checkpoint folder (which holds one in hf/)."""
    root = Path(path)
    for candidate in (root, root / "hf"):
        if (candidate / "config.json").exists():
            if not (candidate / "tokenizer").exists():
                raise RunRefused(f"--checkpoint: {candidate} has no tokenizer/ folder")
            return candidate
    raise RunRefused(f"--checkpoint: no config.json in {root} or {root / 'hf'}")


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
