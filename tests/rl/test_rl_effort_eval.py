"""`rl eval --efforts`: a checkpoint evaluated at the levels asked for, with accuracy against tokens
used per level written beside the summary (JSON and PNG) and printed; bad levels refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from typer.testing import CliRunner

from rl.cli import app

CONFIG = {
    "name": "eval-efforts",
    "model": {"preset": "toy", "vocab_size": 320},
    "envs": [{"name": "multihop", "kwargs": {"max_hops": 2, "n_train": 8, "n_heldout": 4}}],
    "effort": {"budgets": {"low": 24, "medium": 40, "max": 64}, "weights": {"low": 1, "medium": 1, "high": 0, "max": 1},
               "answer_reserve": 6},
    "rollout": {"num_workers": 1, "groups_per_step": 1, "group_size": 2, "max_context": 256},
    "eval": {"tasks_per_env": 2, "samples_per_task": 2, "efforts": ["medium"]},
    "logging": {"wandb_mode": "disabled", "progress": False},
}


def saved_toy(tmp_path: Path) -> Path:
    """A random toy policy saved as `rl eval` reads it, with a tokenizer trained on the domain's text."""
    import envs
    from policy import Tokenizer, build_model, save_pretrained
    from rl.rollout.layout import episode_texts

    env = envs.make("multihop", max_hops=2, n_train=8, n_heldout=4)
    texts = []
    for task_id in env.dataset("train")["task_id"]:
        messages, _ = env.reset(seed=0, options={"task_id": task_id, "effort": "max"})
        turns = [{"action": a, "observation": None} for a in env.reference_actions(task_id)]
        texts += list(episode_texts({"messages": messages, "turns": turns, "tools": env.tools}))
    tok = Tokenizer.train(texts * 4, vocab_size=320)
    torch.manual_seed(0)
    folder = tmp_path / "policy"
    save_pretrained(build_model("toy", vocab_size=tok.vocab_size), folder)
    tok.save(folder / "tokenizer")
    return folder


def test_rl_eval_writes_the_effort_pareto_for_the_levels_asked(tmp_path, ray_session):
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "runs")}))
    out = tmp_path / "toy_eval.json"
    result = CliRunner().invoke(app, ["eval", str(config), "--checkpoint", str(saved_toy(tmp_path)),
                                      "--efforts", "low,medium,max", "-o", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert set(summary["all"]) == {"low", "medium", "max", "all"}
    pareto = json.loads((tmp_path / "toy_eval_pareto.json").read_text())
    curve = next(iter(pareto.values()))["all"]
    assert [p["effort"] for p in curve["points"]] == ["low", "medium", "max"]
    for point, budget in zip(curve["points"], (24, 40, 64)):
        assert point["budget"] == budget and 0 < point["tokens"] <= budget and point["n"] == 4
        assert {"accuracy", "reasoning_tokens", "within_budget"} <= set(point)
    assert isinstance(curve["tokens_increasing"], bool)
    assert (tmp_path / "toy_eval_pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "Reward and tokens used per effort level" in result.output and "within" in result.output


def test_rl_eval_refuses_unknown_or_unbudgeted_levels_in_one_line(tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "runs")}))
    for levels, message in (("low,huge", "--efforts: unknown level 'huge'"),
                            ("low,high", "--efforts: level 'high' has no budget")):
        result = CliRunner().invoke(app, ["eval", str(config), "--checkpoint", str(tmp_path), "--efforts", levels])
        assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) <= 2
    result = CliRunner().invoke(app, ["eval", str(config)])  # no checkpoint, and no pretrained model to fall back on
    assert result.exit_code == 2 and "--checkpoint is needed" in result.output
