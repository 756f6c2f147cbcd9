"""Rollout engines side by side, in one run, on the same model weights (CPU).

A Kimi-Linear-shaped toy (3 KDA + 1 MLA layer, MoE) is built with transformers'
`KimiLinearForCausalLM`, saved, and loaded into our policy (`policy.from_pretrained`: same weights,
logits equal to 1e-4, tests/policy/test_hf_parity.py). Then, at 1, 8, 32 and 128 concurrent
sequences (32-token prompts, greedy, a fixed number of new tokens each):

- native: rl.rollout.native_engine.NativeEngine (continuous batching, slot caches);
- native compiled: the same with `compile_decode=True` (rollout.compile_decode: the fixed-shape
  decode step through torch.compile; warmed up once at each size, its compile time not counted);
- native forked: the native engine given every sequence as one group (`start_group` with all ids:
  the prompt prefilled once and forked), the same work as the previous engine's best case;
- previous: the engine this one replaced (rl/rollout/engine.py at commit 94fe484, read from git,
  given every sequence as one group: its best case);
- transformers: `KimiLinearForCausalLM.generate` on the same batch (use_cache, greedy).

Reported: decode tokens/s and episodes/s (a sequence = an episode of one turn), and the ratio
native / transformers. Beside them, the matrix-product floor: the time of one decode step's matrix
products alone (every linear layer at that many rows, each MoE layer's experts at the rows top-k
routing gives them on average), timed here with torch.mm on the same threads. No engine decodes
faster than that floor; the attention, KDA recurrence and elementwise work come on top. Time it
with nothing else running (the machine has 2 cores).

    .venv/bin/python benchmarks/rollout_engines_cpu.py                       # all three, 1/8/32/128 sequences
    .venv/bin/python benchmarks/rollout_engines_cpu.py --seqs 1 32 --new 32 --json /tmp/rollout.json
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_common import log, write_json  # noqa: E402

PREVIOUS_ENGINE = "94fe484:rl/rollout/engine.py"


def kimi_linear(vocab: int, hidden: int, seed: int):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, num_local_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, linear_head_dim=32, linear_num_heads=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    return KimiLinearForCausalLM(cfg).eval()


def previous_engine_class():
    """The engine before this one, from git history (no copy of it lives in the tree)."""
    source = subprocess.run(["git", "-C", str(REPO), "show", PREVIOUS_ENGINE], check=True, capture_output=True,
                            text=True).stdout
    path = Path(tempfile.mkdtemp()) / "previous_engine.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("previous_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["previous_engine"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.TorchEngine


def run_native(model, prompts: list[list[int]], new: int, compile_decode: bool = False, forked: bool = False) -> float:
    from rl.rollout.engine_api import SamplingParams
    from rl.rollout.native_engine import NativeEngine

    engine = NativeEngine(model, max_slots=max(len(prompts), 1), cache_tokens=len(prompts) * (len(prompts[0]) + new + 32),
                          max_batch_tokens=4096, record_routing=True, compile_decode=compile_decode)
    engine.version = 0
    params = SamplingParams(max_new_tokens=new, temperature=0.0, stop_ids=frozenset(), seed=0)

    async def one(i: int, prompt: list[int]) -> None:
        await engine.start_group([f"s{i}"], prompt)
        await engine.generate(f"s{i}", [], params)
        await engine.finish(f"s{i}")

    async def all_of_them() -> None:
        await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    async def one_group() -> None:  # every sequence shares prompts[0]: one prefill, forked
        ids = [f"s{i}" for i in range(len(prompts))]
        await engine.start_group(ids, prompts[0])
        await asyncio.gather(*[engine.generate(i, [], params) for i in ids])
        for i in ids:
            await engine.finish(i)

    started = time.perf_counter()
    asyncio.run(one_group() if forked else all_of_them())
    return time.perf_counter() - started


def run_previous(engine_cls, model, prompts: list[list[int]], new: int) -> float:
    engine = engine_cls(model, record_routing=True, seed=0)
    started = time.perf_counter()
    engine.start(prompts[0], len(prompts))  # every sequence as rows of one group (its best case)
    engine.generate_turn(list(range(len(prompts))), new, stop_ids=set(), temperature=0.0, top_p=1.0)
    return time.perf_counter() - started


def run_transformers(hf_model, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts)
    started = time.perf_counter()
    with torch.no_grad():
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, use_cache=True, pad_token_id=0)
    return time.perf_counter() - started


def _mm_seconds(rows: int, inner: int, outer: int, cache: dict, repeats: int = 30) -> float:
    """Median time of one [rows, inner] x [inner, outer] float32 product."""
    key = (rows, inner, outer)
    if key not in cache:
        a, b = torch.randn(rows, inner), torch.randn(inner, outer)
        times = []
        for _ in range(repeats + 3):
            t = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t)
        cache[key] = sorted(times[3:])[repeats // 2]
    return cache[key]


def matmul_floor_s(model, rows: int) -> float:
    """Seconds of one decode step's matrix products at `rows` sequences (see the module docstring)."""
    cfg, cache = model.config, {}
    total = 0.0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            total += _mm_seconds(rows, m.in_features, m.out_features, cache)
        elif name.endswith(".experts") and hasattr(m, "w1"):  # stacked experts [E, hidden, dim]
            n_exp, hidden, dim = m.w1.shape
            per_expert = -(-rows * cfg.num_experts_per_token // n_exp)
            used = min(n_exp, rows * cfg.num_experts_per_token)
            total += used * (2 * _mm_seconds(per_expert, dim, hidden, cache) + _mm_seconds(per_expert, hidden, dim, cache))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    # one thread, as the pipeline's rollout actors run (OMP_NUM_THREADS=1): with more, the native engine's
    # worker thread brings a second OpenMP team beside the main thread's and both slow down (2 cores)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip", nargs="*", default=[], choices=["previous", "transformers"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import policy

    hf_model = kimi_linear(args.vocab, args.hidden, seed=0)
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        ours = policy.from_pretrained(d)
    previous = previous_engine_class() if "previous" not in args.skip else None
    results: dict = {"args": vars(args), "rows": []}
    gen = torch.Generator().manual_seed(1)
    for n in args.seqs:
        prompts = [torch.randint(10, args.vocab, (args.prompt,), generator=gen).tolist() for _ in range(n)]
        if n > 1:  # the previous engine forks one prompt; give everyone the same prompt for a fair comparison
            prompts = [prompts[0]] * n
        row = {"sequences": n, "new_tokens": n * args.new}
        timings = {"native": lambda: run_native(ours, prompts, args.new),
                   "native_compiled": lambda: run_native(ours, prompts, args.new, compile_decode=True),
                   "native_forked": lambda: run_native(ours, prompts, args.new, forked=True)}
        if previous is not None:
            timings["previous"] = lambda: run_previous(previous, ours, prompts, args.new)
        if "transformers" not in args.skip:
            timings["transformers"] = lambda: run_transformers(hf_model, prompts, args.new)
        for name, fn in timings.items():
            if n <= 8 or name == "native_compiled":  # warm-up on small sizes (big ones are long enough); compiling
                log(f"{n} sequences, {name}: warm-up {fn():.2f} s")
            seconds = fn()
            row[f"{name}_tok_s"] = n * args.new / seconds
            row[f"{name}_episodes_s"] = n / seconds
            log(f"{n} sequences, {name}: {seconds:.2f} s, {n * args.new / seconds:.0f} tok/s")
        row["matmul_floor_tok_s"] = n / matmul_floor_s(ours, n)
        log(f"{n} sequences: matrix-product floor {row['matmul_floor_tok_s']:.0f} tok/s")
        if "transformers_tok_s" in row:
            row["native_vs_transformers"] = row["native_tok_s"] / row["transformers_tok_s"]
            row["floor_vs_transformers"] = row["matmul_floor_tok_s"] / row["transformers_tok_s"]
            row["compiled_vs_transformers"] = row["native_compiled_tok_s"] / row["transformers_tok_s"]
        if "previous_tok_s" in row:
            row["native_vs_previous"] = row["native_tok_s"] / row["previous_tok_s"]
            row["forked_vs_previous"] = row["native_forked_tok_s"] / row["previous_tok_s"]
        results["rows"].append(row)
        write_json(results, args.json)
    print("\n| sequences | native tok/s | native compiled tok/s | native forked tok/s | previous tok/s | transformers "
          "tok/s | matmul floor tok/s | native / previous | forked / previous | native / transformers | compiled / "
          "transformers | floor / transformers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        cells = [f"{r.get(k, float('nan')):.0f}" for k in ("native_tok_s", "native_compiled_tok_s", "native_forked_tok_s",
                                                          "previous_tok_s", "transformers_tok_s", "matmul_floor_tok_s")]
        ratios = [f"{r[k]:.1f}x" if k in r else "-" for k in ("native_vs_previous", "forked_vs_previous",
                                                              "native_vs_transformers", "compiled_vs_transformers",
                                                              "floor_vs_transformers")]
        print(f"| {r['sequences']} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
