"""Where a CPU decode step's time goes, and what that leaves for any engine: one run.

benchmarks/rollout_engines_cpu.py's model (a Kimi-Linear-shaped toy) decodes `--seqs` sequences in the native
engine (eager, or compiled with `--compiled`); its steps `--skip` to `--skip + --steps` (decode
forward and sampling, past the prompts' prefill) are profiled on the engine's own thread
(torch.profiler), and each op's
self time is summed per step: the matrix products (mm, addmm, bmm, baddbmm, as the step calls
them: cold weights, its own shapes) apart from the rest. transformers' `generate` on the same
weights and batch is timed beside it. The products alone bound the engine: `sequences / their
time per step` tokens/s, printed as a multiple of transformers' rate. (benchmarks/rollout_engines_cpu.py's
"floor" times each product alone, hot in cache: a looser bound.)

    .venv/bin/python benchmarks/rollout_profile_cpu.py --seqs 32 --compiled
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import log  # noqa: E402
from benchmarks.rollout_engines_cpu import kimi_linear, run_native, run_transformers  # noqa: E402

PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def profiled_steps(model, prompts: list[list[int]], new: int, compiled: bool, skip: int, steps: int):
    """Run the engine once, profiling its steps skip .. skip+steps on the engine's thread.
    Returns (wall seconds per step, {op: self seconds per step})."""
    from rl.rollout.native_engine import NativeEngine

    original = NativeEngine._launch
    state = {"n": 0, "wall": 0.0, "prof": None}

    def step(self, *args):  # wraps the step for this run only (restored below)
        state["n"] += 1
        if state["n"] == skip + 1:
            state["prof"] = profile(activities=[ProfilerActivity.CPU])
            state["prof"].__enter__()
        started = time.perf_counter()
        out = original(self, *args)
        if skip < state["n"] <= skip + steps:
            state["wall"] += time.perf_counter() - started
        if state["n"] == skip + steps:
            state["prof"].__exit__(None, None, None)
        return out

    NativeEngine._launch = step
    try:
        run_native(model, prompts, new, compile_decode=compiled)
    finally:
        NativeEngine._launch = original
    if state["n"] < skip + steps:
        raise SystemExit(f"only {state['n']} steps ran; lower --skip/--steps or raise --new")
    per_op: dict[str, float] = defaultdict(float)
    for event in state["prof"].key_averages():
        per_op[event.key] += event.self_cpu_time_total / 1e6 / steps
    return state["wall"] / steps, per_op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--skip", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as benchmarks/rollout_engines_cpu.py and the pipeline's rollout actors
    import policy

    hf_model = kimi_linear(2048, 256, seed=0)
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        ours = policy.from_pretrained(d)
    prompts = [torch.randint(10, 2048, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()] * args.seqs
    run_native(ours, prompts, args.new, compile_decode=args.compiled)  # warm-up (and compile)
    wall, per_op = profiled_steps(ours, prompts, args.new, args.compiled, args.skip, args.steps)
    products = sum(t for op, t in per_op.items() if op in PRODUCTS)
    run_transformers(hf_model, prompts, 4)  # warm-up
    hf_rate = args.seqs * args.new / run_transformers(hf_model, prompts, args.new)
    log(f"{args.seqs} sequences, {'compiled' if args.compiled else 'eager'} step: {wall * 1e3:.2f} ms, of which matrix "
        f"products {products * 1e3:.2f} ms ({products / wall:.0%})")
    for op, t in sorted(per_op.items(), key=lambda kv: -kv[1])[:8]:
        log(f"  {op[:60]:60s} {t * 1e3:7.3f} ms a step")
    step_rate, products_rate = args.seqs / wall, args.seqs / products
    log(f"transformers generate: {hf_rate:.0f} tok/s; this step {step_rate:.0f} tok/s = {step_rate / hf_rate:.1f}x; "
        f"its products alone would allow {products_rate:.0f} tok/s = {products_rate / hf_rate:.1f}x")


if __name__ == "__main__":
    main()
