"""The learner on a Hugging Face policy against plain transformers, per token, on the same rows: a GRPO
batch shaped like configs/vllm_cpu.yaml's (groups of samples sharing their prompt; SmolLM2's chat
template around small sums; completions of the config's lengths), trained by

- plain: transformers' forward on the right-padded batch, log_softmax of the logits, the token-mean
  policy-gradient loss, backward and torch's AdamW (what TRL's GRPOTrainer does per step);
- learner: our Learner (DeepSpeed, packed rows, HFPolicy's blockwise logprobs) in this process.

each in the precisions asked for: float32, and bfloat16 (plain: the whole forward under CPU autocast, as
accelerate's bf16 mixed precision runs TRL; learner: train.cpu_matmul_dtype=bfloat16, the head in
float32). Seconds per step are medians over `--iters` steps after one warm-up step, interleaved (every
side sees the same background load: this CPU is shared); tokens/s counts the real (unpadded) tokens.

    python benchmarks/learner_hf_cpu.py [--groups 8 --group-size 8 --threads 2 --iters 3]
                                        [--precisions float32 bfloat16]"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # the repository's packages, not benchmarks/'s files of the same names (sandbox.py)

from benchmarks.bench_common import log  # noqa: E402


def batch_samples(model_dir: str, groups: int, group_size: int, max_new: int, seed: int = 0):
    """Samples like a vllm_cpu step's: each group's prompt a small sum in SmolLM2's chat template,
    each member's completion 4..max_new tokens of the model's vocabulary (the learner's cost does not
    depend on which tokens), ending with <|im_end|>."""
    from policy.hf_tokenizer import HFChatTokenizer
    from rl.types import Sample

    tok = HFChatTokenizer.load(model_dir)
    rng = random.Random(seed)
    end = tok.encode("<|im_end|>")[-1]
    samples = []
    for g in range(groups):
        question = f"What is {rng.randint(0, 12)} + {rng.randint(0, 12)}?"
        prompt = tok.apply_chat_template([{"role": "system", "content": "Solve the problem."},
                                          {"role": "user", "content": question}], effort=rng.choice(["low", "medium"]))
        for m in range(group_size):
            completion = [rng.randrange(200, 40000) for _ in range(rng.randint(3, max_new - 1))] + [end]
            n = len(completion)
            samples.append(Sample(
                uid=f"g{g}/{m}", group_uid=f"g{g}", env="math", domain="math", task_id=str(g), effort="low",
                tokens=prompt + completion, loss_mask=[0] * len(prompt) + [1] * n,
                behavior_logprobs=[0.0] * len(prompt) + [-rng.uniform(0.5, 3.0) for _ in range(n)],
                token_versions=[-1] * len(prompt) + [0] * n, reward=float(rng.random() < 0.5)))
    return samples


def plain_step(model, optimizer, samples, pad_id: int, autocast: bool = False) -> None:
    """One transformers training step on the batch, right-padded; `autocast`: forward in bf16 autocast."""
    T = max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(samples), T, dtype=torch.long)
    mask = torch.zeros(len(samples), T)
    adv = torch.tensor([s.reward - 0.5 for s in samples])
    for i, s in enumerate(samples):
        ids[i, :len(s.tokens)] = torch.tensor(s.tokens)
        attn[i, :len(s.tokens)] = 1
        mask[i, :len(s.tokens)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:]
    loss = -(adv[:, None] * torch.exp(logp - logp.detach()) * m).sum() / m.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def plain_runner(model_dir: str, samples, pad_id: int, autocast: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, betas=(0.9, 0.99))
    return lambda: plain_step(model, opt, samples, pad_id, autocast)


def learner_runner(learner, samples):
    from rl.types import RolloutBatch

    step = iter(range(10**6))
    return lambda: learner.train_step(RolloutBatch(next(step), samples))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--only", choices=["plain", "learner"], default=None)
    ap.add_argument("--precisions", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from policy.smollm2 import import_smollm2
    from rl.config import TrainConfig
    from rl.learner.learner import Learner, free_port

    model_dir = str(import_smollm2())
    samples = batch_samples(model_dir, args.groups, args.group_size, args.max_new)
    tokens = sum(len(s.tokens) for s in samples)
    pad_id = 0
    results: dict = {"rows": len(samples), "tokens": tokens, "threads": args.threads,
                     "prompt_tokens": len(samples[0].tokens) - sum(samples[0].loss_mask)}
    log(f"{len(samples)} rows, {tokens} tokens, {args.threads} threads, load {os.getloadavg()[0]:.2f}")
    runs = {}
    for precision in args.precisions:
        if args.only in (None, "plain"):
            runs[f"plain/{precision}"] = plain_runner(model_dir, samples, pad_id, precision == "bfloat16")
        if args.only in (None, "learner"):
            cfg = TrainConfig(lr=5e-6, threads=args.threads, cpu_matmul_dtype=precision)
            learner = Learner({"hf_path": model_dir}, cfg, 24, 1.0, pad_id, 0)
            learner.start("127.0.0.1", free_port())
            runs[f"learner/{precision}"] = learner_runner(learner, samples)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.iters + 1):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            if i:  # the first step of each warms up
                times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        med = statistics.median(t)
        results[name] = {"step_s": t, "median_s": med, "tokens_per_s": tokens / med}
        log(f"{name}: {med:.2f} s a step (min {min(t):.2f}, max {max(t):.2f}), {tokens / med:.0f} tokens/s")
    results["load_after"] = os.getloadavg()[0]
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
