"""Tool-result turns with and without prefill graphs (`rollout.prefill_graph_tokens`), in one run.

An agentic turn starts by prefilling what the environment said (a tool result of tens of tokens)
into every sequence waiting on it. On a GPU that prefill is an eager forward of thousands of small
kernel launches (for `small`, about as long as the forward's GPU work); with `prefill_graph_tokens`
it is the fixed-shape step of rl/rollout/decode_graphs.py, padded to a token bucket and replayed as
a CUDA graph. Each engine here holds `--seqs` sequences (prompt `--prompt` tokens, every sequence
its own); each round feeds all of them a `--result`-token tool result and samples `--new` tokens
greedily. Reported per engine: the median round's time after `--warm` rounds (the graphs of each
shape captured in those), graphs captured and the time spent capturing, and whether the two engines
drew the same tokens.

    python3 benchmarks/prefill_graphs.py --preset small --seqs 16 64 --result 24
    python3 benchmarks/prefill_graphs.py --preset toy --device cpu --seqs 4 --rounds 3   # a CPU smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import log, write_json  # noqa: E402
from benchmarks.rollout_decode_gpu import build  # noqa: E402


def play(engine, prompts: list[list[int]], results: list[list[int]], new: int, rounds: int) -> tuple[list[float], list]:
    """Seconds of each round (every sequence fed a tool result, then `new` greedy tokens) and the tokens."""
    from rl.rollout.engine_api import SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0.0, stop_ids=frozenset(), seed=0)
    ids = [f"s{i}" for i in range(len(prompts))]
    times, tokens = [], []

    async def run() -> None:
        for i, prompt in zip(ids, prompts):
            await engine.start_group([i], prompt)
        await asyncio.gather(*[engine.generate(i, [], params) for i in ids])  # the prompts: not timed
        for r in range(rounds):
            started = time.perf_counter()
            outs = await asyncio.gather(*[engine.generate(i, results[(r + b) % len(results)], params)
                                          for b, i in enumerate(ids)])
            times.append(time.perf_counter() - started)
            tokens.append([o.tokens for o in outs])
        for i in ids:
            await engine.finish(i)

    asyncio.run(run())
    return times, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--result", type=int, default=24)
    parser.add_argument("--new", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--graph-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from rl.rollout.native_engine import NativeEngine

    model = build(args.preset, args.device, getattr(torch, args.dtype))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in args.seqs:
        prompts = [torch.randint(10, vocab, (args.prompt,), generator=gen).tolist() for _ in range(n)]
        # results of result/2 .. result tokens, as a tool's outputs vary
        results = [torch.randint(10, vocab, (args.result // 2 + k % (args.result // 2 + 1),), generator=gen).tolist()
                   for k in range(n)]
        row = {"sequences": n}
        drawn = {}
        for name, tokens in (("eager prefill", 0), ("prefill graphs", args.graph_tokens)):
            per_sequence = args.prompt + args.rounds * (args.result + args.new) + 64
            engine = NativeEngine(model, max_slots=n, cache_tokens=n * per_sequence, decode_graphs=True,
                                  prefill_graph_tokens=tokens)
            engine.version = 0
            times, drawn[name] = play(engine, prompts, results, args.new, args.rounds)
            stats = engine.stats().extra
            median = statistics.median(times[args.warm:])
            row[name] = {"round_s": median, "first_rounds_s": times[:args.warm],
                         "graphs": stats.get("graphs_captured", 0), "capture_s": stats.get("graph_capture_s", 0.0)}
            log(f"{n} sequences, {name}: median round {median * 1e3:.1f} ms (first {args.warm}: "
                f"{', '.join(f'{t * 1e3:.0f}' for t in times[:args.warm])} ms), {row[name]['graphs']:.0f} graphs "
                f"captured in {row[name]['capture_s']:.1f} s")
            if engine.graph_capture_error is not None:
                row[name]["capture_error"] = engine.graph_capture_error
                log(f"capture FAILED: {engine.graph_capture_error}")
            engine.shutdown()
        row["speedup"] = row["eager prefill"]["round_s"] / row["prefill graphs"]["round_s"]
        same = [a == b for a, b in zip(drawn["eager prefill"], drawn["prefill graphs"])]
        row["same_tokens_rounds"] = sum(same)
        log(f"{n} sequences: prefill graphs {row['speedup']:.2f}x eager prefill a round; "
            f"same greedy tokens in {sum(same)} of {len(same)} rounds")
        rows.append(row)
        write_json({"args": vars(args), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
