"""TRL's side of benchmarks/grpo_vs_trl.py: GRPOTrainer on the task the driver hands over, run by the
TRL virtualenv's interpreter (it imports nothing of this repository, which needs another environment).

    .cache/trl-venv/bin/python benchmarks/_trl_grpo_side.py SPEC.json

SPEC.json (written by the driver): the model directory, the prompts in stream order (the chat template
already rendered, so that TRL reads exactly our prompt tokens; question, gold answer), the hyperparameters, the grader's address and key, and where to write the
results: the seconds of each optimizer step (generation, rewards and training: TRL does all three
inside a step) and the trained model (save_pretrained)."""
from __future__ import annotations

import json
import sys
import time
from multiprocessing.connection import Client


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    grader = Client(tuple(spec["grader"]["address"]), authkey=bytes.fromhex(spec["grader"]["key"]))

    def reward(prompts, completions, question, answer, **_):
        # the driver grades with the repository's own grader (envs.domains.math, the config's style)
        grader.send([(c[-1]["content"] if isinstance(c, list) else c, q, a)
                     for c, q, a in zip(completions, question, answer)])
        return grader.recv()

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.started = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self.started)
            print(json.dumps({"step": state.global_step, "s": round(self.seconds[-1], 2)}), flush=True)

    h = spec["hyper"]
    config = GRPOConfig(
        output_dir=spec["out_dir"], max_steps=h["steps"], per_device_train_batch_size=h["groups"] * h["group_size"],
        num_generations=h["group_size"], max_completion_length=h["max_new_tokens"], temperature=h["temperature"],
        top_p=1.0, top_k=0, learning_rate=h["lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=h["betas"][0], adam_beta2=h["betas"][1], adam_epsilon=h["adam_eps"], weight_decay=h["weight_decay"],
        max_grad_norm=h["grad_clip"], beta=0.0, loss_type="dapo", scale_rewards="none", epsilon=h["eps_low"],
        epsilon_high=h["eps_high"], num_iterations=1, shuffle_dataset=False, use_vllm=False, use_cpu=True,
        bf16=h.get("precision") == "bfloat16", fp16=False, logging_steps=1, save_strategy="no", report_to="none", seed=spec["seed"],
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False, gradient_checkpointing=False)
    rows = [{"prompt": p["prompt"], "question": p["question"], "answer": p["answer"]} for p in spec["prompts"]]
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[clock])
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    trainer.model.save_pretrained(spec["model_out"])
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    with open(spec["result"], "w") as f:
        json.dump({"step_s": clock.seconds, "wall_s": wall, "train_reward": rewards,
                   "torch": torch.__version__, "threads": torch.get_num_threads()}, f)
    grader.close()


main()  # a script of the TRL virtualenv, never imported
