"""benchmarks/grpo_vs_trl.py's pieces, without TRL: the prompts TRL is handed are our scheduler's groups
in stream order and tokenize to exactly our prompt ids, TRL's rewards come from our grader, and the
figures leave out each run's first step and spread over runs."""
from __future__ import annotations

import sys
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchmarks.grpo_vs_trl as bench  # noqa: E402
from tiny_hf_models import save_tiny_chat_model  # noqa: E402


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bench")
    model = save_tiny_chat_model(d / "model", ["Solve the problem.", "Reasoning effort: medium.", "What is 3 + 4?",
                                               "0 1 2 3 4 5 6 7 8 9 10 + - = ?"] * 20)
    tree = yaml.safe_load((REPO / "configs" / "vllm_cpu.yaml").read_text())
    tree["model"]["hf_path"] = str(model)
    path = d / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_trl_reads_our_stream_of_prompts_token_for_token(config):
    from policy.hf_tokenizer import HFChatTokenizer
    from rl.config import load_config
    from rl.rollout.scheduler import SamplingPlan

    overrides = [*bench.SAME, "train.steps=3"]
    prompts = bench.task_prompts(config, overrides, steps=3)
    cfg = load_config(str(config), overrides)
    assert len(prompts) == 3 * cfg.rollout.groups_per_step
    assert {p["effort"] for p in prompts} == {bench.EFFORT} and {p["max_new_tokens"] for p in prompts} == {24}
    import envs
    from rl.cluster import env_kwargs

    env = envs.make("math", **env_kwargs(cfg, "math"))
    train = env.dataset("train")
    plan = SamplingPlan({"math": 1.0}, cfg.effort.weights, cfg.effort.budgets, cfg.rollout.group_size,
                        cfg.rollout.temperature, cfg.rollout.top_p, cfg.seed)
    tok = HFChatTokenizer.load(cfg.model.hf_path)
    for index in (0, 5, len(prompts) - 1):  # the scheduler's group `index`, as the rollout worker prompts it
        item = plan.item(index, {"math": list(train["task_id"])})
        task = next(dict(row) for row in train if row["task_id"] == item.task_id)
        assert prompts[index]["question"] == task["question"] and prompts[index]["answer"] == str(task["answer"])
        ids = tok.apply_chat_template([{"role": "system", "content": env.system_prompt},
                                       {"role": "user", "content": task["question"]}], effort=item.effort,
                                      add_generation_prompt=True)
        assert tok.decode(ids, keep_special=True) == prompts[index]["text"]
    assert len({p["question"] for p in prompts}) > 1


def test_trl_is_graded_by_our_grader():
    from envs.domains.math import MathGrader

    server = bench.GraderServer("last_number")
    conn = Client(tuple(server.address["address"]), authkey=bytes.fromhex(server.address["key"]))
    batch = [("3 + 4 = 7", "What is 3 + 4?", "7"), ("It is 8.", "What is 3 + 4?", "7"), ("What is 3 + 4?", "What is 3 + 4?", "4")]
    conn.send(batch)
    rewards = conn.recv()
    grader = MathGrader(answer_style="last_number")
    assert rewards == [grader.score({"response": r, "question": q, "gold": g}).reward for r, q, g in batch] == [1.0, 0.0, 0.0]
    conn.close()


def test_figures_leave_out_the_first_step_and_spread_over_runs():
    figures = bench.step_figures([100.0, 10.0, 12.0, 11.0], samples_per_step=64)
    assert figures["s_per_step"] == 11.0 and figures["samples_per_s"] == pytest.approx(64 / 11)
    runs = {"trl": [{"s_per_step": 40.0, "samples_per_s": 1.6, "heldout_reward": 0.5},
                    {"s_per_step": 32.0, "samples_per_s": 2.0, "heldout_reward": 0.6}],
            "ours-sync": [{"s_per_step": 10.0, "samples_per_s": 6.4, "heldout_reward": 0.7}]}
    summary = bench.summarise({"runs": runs})
    assert summary["trl"]["samples_per_s"] == {"mean": pytest.approx(1.8), "min": 1.6, "max": 2.0, "n": 2}
    assert summary["ours-sync"]["speedup_vs_trl"] == pytest.approx(6.4 / 1.8)
    text = bench.table(summary, steps=24)
    assert "| ours-sync | 10.0 (10.0-10.0) | 6.40 (6.40-6.40) | 0.700 (0.700-0.700) | 3.56x |" in text


def test_the_precision_reaches_both_sides(config):
    hyper = bench.hyperparameters(config, [*bench.SAME, "train.cpu_matmul_dtype=bfloat16"], steps=3)
    assert hyper["precision"] == "bfloat16"  # TRL's side: bf16=True
    assert bench.hyperparameters(config, bench.SAME, steps=3)["precision"] == "float32"
    side = (REPO / "benchmarks" / "_trl_grpo_side.py").read_text()
    assert 'bf16=h.get("precision") == "bfloat16"' in side
