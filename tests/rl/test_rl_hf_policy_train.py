"""A transformers model as the policy, end to end: `model.hf_path` with its own tokenizer and chat
template, rollouts from transformers' generate (and from vLLM where it is installed), the same
learner, a checkpoint in transformers' format, and every sample saying which engine produced it."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from rl.config import ConfigError, validate
from rl.metrics import read_metrics
from tiny_hf_models import save_tiny_chat_model

MATH = {"name": "math", "kwargs": {"max_operand": 9, "n_train": 40, "n_heldout": 8, "answer_style": "last_number"}}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    texts = ["Solve the problem.", "Reasoning effort: low.", "What is 3 + 4?", "The answer is 7.",
             "Tool result:", "0 1 2 3 4 5 6 7 8 9 10 + - = ."] * 20
    return save_tiny_chat_model(tmp_path_factory.mktemp("chat"), texts)


def tiny_config(tmp_path: Path, model_dir: Path, engine: str) -> Path:
    tree = {"name": f"hf-{engine}", "output_dir": str(tmp_path / "runs"), "model": {"hf_path": str(model_dir)},
            "envs": [MATH], "effort": {"budgets": {"low": 6}, "weights": {"low": 1.0, "medium": 0, "high": 0, "max": 0}},
            "rollout": {"engine": engine, "record_routing": False, "num_workers": 1, "groups_per_step": 2,
                        "group_size": 2, "max_context": 128, "drop_uniform_groups": False,
                        "vllm": {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 8, "kv_cache_gib": 1}},
            "train": {"steps": 2, "lr": 1e-4, "micro_batches": 2}, "warmup": {"steps": 1, "batch_size": 4, "tasks_per_env": 4},
            "eval": {"tasks_per_env": 2, "efforts": ["low"]}, "checkpoint": {"every": 2},
            "logging": {"wandb_mode": "disabled", "progress": False}, "gate": {"enabled": False}}
    path = tmp_path / "hf.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def check_run(run_dir: Path, engine: str) -> None:
    warmup = [m for m in read_metrics(run_dir) if m["step"] < 0]
    assert warmup and warmup[0]["sft/loss"] > 0  # the learner stepped the transformers model
    assert len(warmup) == 1 and warmup[0]["sft/step_s"] > 0  # every warm-up step logged, with its time
    metrics = [m for m in read_metrics(run_dir) if m["step"] >= 0]
    assert [m["step"] for m in metrics] == [0, 1] and all(m["train/groups"] == 2 for m in metrics)
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert records and {r["engine"] for r in records} == {engine}
    assert records[0]["transcript"][0] == {"role": "system", "content": "Solve the problem."}  # the env's text
    saved = json.loads((run_dir / "checkpoints" / "step_1" / "hf" / "config.json").read_text())
    assert saved["model_type"] == "llama"  # transformers' own format
    assert (run_dir / "eval_after.json").exists()


def test_a_transformers_policy_trains_with_generate_rollouts(tmp_path, chat_model, ray_session):
    from rl.trainer import train

    result = train(str(tiny_config(tmp_path, chat_model, "transformers")), [])
    check_run(Path(result["run_dir"]), "transformers")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make setup-vllm)")
def test_a_transformers_policy_trains_with_vllm_rollouts(tmp_path, chat_model, ray_session):
    from rl.trainer import train

    result = train(str(tiny_config(tmp_path, chat_model, "vllm")), [])
    check_run(Path(result["run_dir"]), "vllm")


def test_engines_and_policies_that_do_not_fit_are_refused_in_one_line(chat_model):
    base = {"envs": [MATH]}
    with pytest.raises(ConfigError, match="needs rollout.engine: vllm or transformers"):
        validate({**base, "model": {"hf_path": str(chat_model)}, "rollout": {"record_routing": False}})
    with pytest.raises(ConfigError, match="our hybrid presets run on rollout.engine: native"):
        validate({**base, "rollout": {"engine": "vllm"}})
    with pytest.raises(ConfigError, match="routing replay needs our hybrid policy"):
        validate({**base, "model": {"hf_path": str(chat_model)}, "rollout": {"engine": "transformers"}})
    from rl.errors import RunRefused
    from rl.trainer import train

    path = tiny_config(chat_model.parent, Path("/nonexistent"), "transformers")
    with pytest.raises(RunRefused, match="no config.json in /nonexistent"):
        train(str(path), [])
