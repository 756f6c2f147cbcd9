"""The native rollout engine's decode throughput on one GPU, beside its memory-bandwidth bound.

    python3 benchmarks/rollout_gpu.py --preset small --seqs 64 256
    python3 benchmarks/rollout_gpu.py --preset kimi-linear-4l --seqs 64 --json $OUT/rollout_gpu.json

`kimi-linear-4l`: Kimi-Linear-48B layer shapes cut to 4 layers (3 KDA + 1 MLA) and 64 experts.
Weights in bf16, random; greedy decoding of `--new` tokens after a `--prompt`-token prompt per
sequence (every sequence its own prompt, all in flight at once). Decode tokens/s counts the new
tokens over the time after the last prefill. The bound: every decode step reads all weights once
(at 64+ sequences nearly every expert is routed to) plus each sequence's KDA state and MLA keys,
at the H200's 4.3 TB/s copy bandwidth (KINDS.md)."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import log, write_json  # noqa: E402

BANDWIDTH = 4.3e12


def build(preset: str):
    from policy import build_model
    from policy.dtypes import params_to

    with torch.device("cuda"):
        if preset == "kimi-linear-4l":
            model = build_model("kimi-linear-48b", num_hidden_layers=4, num_experts=64)
        else:
            model = build_model(preset)
    return params_to(model, torch.bfloat16).eval()


def bound_tok_s(model, seqs: int, context: int) -> float:
    from policy.slot_cache import SlotCache

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg, dtype = model.config, model.lm_head.weight.dtype
    state = seqs * (SlotCache.bytes_per_slot(cfg, dtype) + context * SlotCache.bytes_per_token(cfg, dtype))
    return seqs * BANDWIDTH / (weights + state)


def decode(model, seqs: int, prompt: int, new: int, vocab: int) -> dict:
    from rl.rollout.engine_api import SamplingParams
    from rl.rollout.native_engine import NativeEngine

    engine = NativeEngine(model, max_slots=seqs, cache_tokens=seqs * (prompt + new + 64), max_batch_tokens=8192,
                          record_routing=False)
    engine.version = 0
    params = SamplingParams(max_new_tokens=new, temperature=0.0, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (prompt,), generator=gen).tolist() for _ in range(seqs)]
    marks: dict[str, float] = {}

    async def one(i: int) -> None:
        await engine.start_group([f"s{i}"], prompts[i])
        out = await engine.generate(f"s{i}", [], params)
        marks.setdefault("first_done", time.perf_counter())
        assert len(out.tokens) == new
        await engine.finish(f"s{i}")

    async def run() -> None:
        await asyncio.gather(*[one(i) for i in range(seqs)])

    torch.cuda.synchronize()
    started = time.perf_counter()
    asyncio.run(run())
    torch.cuda.synchronize()
    total = time.perf_counter() - started
    steps = engine.stats().steps
    prefill_steps = -(-seqs * prompt // 8192)
    decode_s = total * (steps - prefill_steps) / max(steps, 1)  # the prefill forwards' share left out
    return {"sequences": seqs, "total_s": total, "steps": steps, "decode_tok_s": seqs * new / decode_s,
            "overall_tok_s": seqs * new / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = build(args.preset)
    vocab = model.config.vocab_size
    log(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, bf16")
    decode(model, 4, 16, 8, vocab)  # warm-up: first launches, allocator
    results = {"args": vars(args), "rows": []}
    for n in args.seqs:
        row = decode(model, n, args.prompt, args.new, vocab)
        row["bound_tok_s"] = bound_tok_s(model, n, args.prompt + args.new // 2)
        row["fraction_of_bound"] = row["decode_tok_s"] / row["bound_tok_s"]
        results["rows"].append(row)
        log(f"{n} sequences: decode {row['decode_tok_s']:.0f} tok/s (overall {row['overall_tok_s']:.0f}), "
            f"bound {row['bound_tok_s']:.0f} tok/s, {row['fraction_of_bound']:.1%} of it; {row['steps']} steps")
        write_json(results, args.json)


if __name__ == "__main__":
    main()
