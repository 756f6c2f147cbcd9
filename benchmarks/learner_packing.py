"""The learner's GRPO step on packed micro-batches against right-padded ones, on the same batches in one
process: seconds per step, real tokens per second, the padding share of the token slots.

    python benchmarks/learner_packing.py --lengths demo --run runs/demo-...   # a run's sample lengths
    python benchmarks/learner_packing.py --lengths longtail                   # 32-4K tokens, log-uniform

`demo`: each step replays one logged step of the run folder (rollouts.jsonl's `sequence_tokens`, whole
groups, trained samples only), on the demo's policy and learner settings (train.micro_batches 2 when
padded). `longtail`: 64 samples a step whose lengths are log-uniform over 32..4096 (agentic episodes),
padded one row per micro-batch (two 4K rows padded together already need gigabytes for the attention).
Both sides: one learner rank (DeepSpeed, gloo, CPU) at the config's torch threads, the same batches in
the same order, the steps after the first timed (the first builds caches)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's packages, and benchmarks/ as the package `benchmarks`

from benchmarks.bench_common import log, write_json  # noqa: E402
from rl.config import TrainConfig, load_config  # noqa: E402
from rl.types import RolloutBatch, Sample  # noqa: E402


def demo_lengths(run_dir: Path) -> list[list[tuple[str, int]]]:
    """Per logged step: (group, sequence tokens) of the samples the learner trained on."""
    steps: dict[int, list[tuple[str, int]]] = {}
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["trained"] and "sequence_tokens" in r:
            steps.setdefault(r["step"], []).append((r["group"], r["sequence_tokens"]))
    if not steps:
        raise SystemExit(f"{run_dir}/rollouts.jsonl has no trained samples with sequence_tokens (a run of "
                         f"this code or later)")
    return [steps[s] for s in sorted(steps)]


def longtail_lengths(steps: int, seed: int) -> list[list[tuple[str, int]]]:
    rng = np.random.default_rng(seed)
    return [[(f"g{i // 8}", int(np.exp(rng.uniform(np.log(32), np.log(4096))))) for i in range(64)]
            for _ in range(steps)]


def batch(step: int, shape: list[tuple[str, int]], vocab: int, moe: tuple[int, int, int], seed: int) -> RolloutBatch:
    """Samples of the given lengths: a quarter prompt, the rest generated, rewards that differ within
    each group, the experts recorded for every token but the last (as the engines record them)."""
    rng = np.random.default_rng([seed, step])
    layers, top_k, experts = moe
    samples = []
    for i, (group, n) in enumerate(shape):
        prompt = max(1, n // 4)
        routing = None
        if layers:
            routing = np.argsort(rng.random((n, layers, experts)), -1)[..., :top_k].astype(np.int16)
            routing[-1] = -1
        samples.append(Sample(uid=f"{group}/{i}", group_uid=group, env="e", domain="d", task_id=group,
                              effort="medium", tokens=rng.integers(3, vocab, n).tolist(),
                              loss_mask=[0] * prompt + [1] * (n - prompt),
                              behavior_logprobs=[0.0] * prompt + rng.uniform(-4, -0.1, n - prompt).tolist(),
                              token_versions=[-1] * prompt + [step] * (n - prompt), reward=float(i % 2),
                              routing=routing))
    return RolloutBatch(step, samples)


def run_side(spec: dict, train: TrainConfig, batches: list, seq_norm: int) -> dict[str, float]:
    from rl.learner import LearnerGroup

    group = LearnerGroup(spec, train, seq_norm, 1.0, 0, 0, [{"num_cpus": 1}])
    try:
        steps = [group.train_step(ray.put(b)).metrics for b in batches]
    finally:
        group.shutdown()
    timed = steps[1:] or steps
    seconds = [m["time/learner_step_s"] for m in timed]
    tokens = sum(m["train/seq_tokens"] for m in timed)
    return {"step_s_median": statistics.median(seconds), "step_s": seconds,
            "tokens_per_s": tokens / sum(seconds), "padding_frac": statistics.mean(m["train/padding_frac"] for m in timed),
            "micro_batches": statistics.mean(m["train/micro_batches"] for m in timed)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", choices=["demo", "longtail"], default="demo")
    ap.add_argument("--run", type=Path, help="the demo run folder whose logged steps are replayed")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=None, help="packed budget (default: the config's)")
    ap.add_argument("--padded-micro-batches", type=int, default=None,
                    help="padded side's micro-batches (default: the config's; longtail: one 4K row each)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cfg = load_config(args.config)
    shapes = demo_lengths(args.run)[: args.steps] if args.lengths == "demo" else longtail_lengths(args.steps, 0)
    from policy import build_policy

    spec = {"preset": cfg.model.preset, "overrides": {**cfg.model.overrides, "vocab_size": cfg.model.vocab_size},
            "init_from": None}
    model = build_policy(spec)
    layers = len(getattr(model, "moe_layer_ids", []))
    moe = (layers, model.config.num_experts_per_token, model.config.num_experts) if layers else (0, 0, 0)
    batches = [batch(i, shape, cfg.model.vocab_size, moe, 0) for i, shape in enumerate(shapes)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    results: dict = {"lengths": args.lengths, "steps": len(batches),
                     "samples_per_step": statistics.mean(len(b.samples) for b in batches),
                     "tokens_per_step": statistics.mean(sum(len(s.tokens) for s in b.samples) for b in batches)}
    packed = {"packing": True}
    if args.max_tokens:
        packed["max_tokens_per_micro_batch"] = args.max_tokens
    micro = args.padded_micro_batches or (cfg.train.micro_batches if args.lengths == "demo" else 64)
    results["padded_micro_batches"] = micro
    for name, update in (("padded", {"packing": False, "micro_batches": micro}), ("packed", packed)):
        log(f"{name}: {len(batches)} steps of {results['samples_per_step']:.0f} samples, "
            f"{results['tokens_per_step']:.0f} tokens")
        results[name] = run_side(spec, cfg.train.model_copy(update=update), batches, cfg.rollout.max_context)
        log(f"{name}: {results[name]['step_s_median']:.2f} s a step, {results[name]['tokens_per_s']:.0f} tokens/s, "
            f"padding {results[name]['padding_frac']:.0%}, {results[name]['micro_batches']:.1f} micro-batches")
        write_json(results, args.json)
    results["speedup"] = results["padded"]["step_s_median"] / results["packed"]["step_s_median"]
    log(f"packed / padded: {results['speedup']:.2f}x faster a step")
    write_json(results, args.json)
    ray.shutdown()


if __name__ == "__main__":
    main()
