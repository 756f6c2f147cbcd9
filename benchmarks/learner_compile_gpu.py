"""What the fused ops (kimi_kernels/fusion.py) cost and save in a learner shaped like the GPU pipeline's.

    python3 benchmarks/learner_compile_gpu.py --steps 30          # run it twice: the second finds inductor's cache

`configs/gpu_small.yaml`'s learner trains the `small` preset on batches of 64 short rows (the
warm-up) and scores GRPO batches without gradient. Here the same model, bf16 on one GPU, takes
`--steps` steps of each kind on rows of random length, first with the fused ops on (the default:
every fused op compiles on its first calls, once per input rank and per gradient mode), then on a
fresh copy with them off. Per-step wall times show the compiling steps; the medians of the last
half, the steady gain. Inductor keeps what it generated on disk (TORCHINDUCTOR_CACHE_DIR, by default
under /tmp), so a second run in a fresh process shows what a restarted run pays."""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import log, write_json  # noqa: E402
from kimi_kernels.fusion import set_fusion  # noqa: E402
from policy import build_model  # noqa: E402


def batch(rows: int, shortest: int, longest: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Token ids [rows, longest-in-batch] right-padded, and the mask of real tokens."""
    lengths = torch.randint(shortest, longest + 1, (rows,), generator=gen)
    width = int(lengths.max())
    ids = torch.randint(1, vocab, (rows, width), generator=gen)
    real = torch.arange(width)[None, :] < lengths[:, None]
    return ids.where(real, 0).cuda(), real.cuda()


def steps(model: torch.nn.Module, n: int, rows: int, lengths: tuple[int, int], seed: int) -> dict[str, list[float]]:
    """Wall seconds of `n` training steps and `n` no-grad scoring passes, interleaved as a run does."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    times: dict[str, list[float]] = {"train": [], "score": []}
    for _ in range(n):
        ids, real = batch(rows, *lengths, vocab, gen)
        start = time.perf_counter()
        logp = model(ids, return_token_logprobs=True, token_mask=real).token_logprobs
        loss = -(logp * real).sum() / real.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())
        times["train"].append(time.perf_counter() - start)
        ids, real = batch(rows, *lengths, vocab, gen)
        start = time.perf_counter()
        with torch.no_grad():
            float(model(ids, return_token_logprobs=True, token_mask=real).token_logprobs.sum())
        times["score"].append(time.perf_counter() - start)
    return times


def summary(name: str, times: dict[str, list[float]]) -> dict[str, float]:
    out = {}
    for kind, ts in times.items():
        steady = statistics.median(ts[len(ts) // 2:])
        out |= {f"{kind}_first_s": ts[0], f"{kind}_total_s": sum(ts), f"{kind}_steady_s": steady}
        log(f"{name:>10} {kind:>5}: first {ts[0]:6.2f} s, all {sum(ts):6.1f} s, steady {steady * 1e3:6.1f} ms; "
            f"steps: {' '.join(f'{t:.2f}' for t in ts)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs=2, default=[20, 40], metavar=("SHORTEST", "LONGEST"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("learner_compile_gpu.py: needs a CUDA GPU (the fused ops compile only for CUDA inputs)")
    torch.manual_seed(0)
    base = build_model(args.preset, vocab_size=args.vocab).to("cuda", torch.bfloat16)
    results = {}
    for name, fused in (("fused on", True), ("fused off", False)):
        set_fusion(fused)
        started, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
        times = steps(copy.deepcopy(base), args.steps, args.rows, tuple(args.lengths), seed=1)
        results[name] = summary(name, times) | {"wall_s": time.perf_counter() - started,
                                                "graphs_compiled": counters["stats"]["unique_graphs"] - graphs}
        log(f"{name:>10}: {results[name]['graphs_compiled']} graphs compiled")
    on, off = results["fused on"], results["fused off"]
    log(f"fused on / off: {off['train_steady_s'] / on['train_steady_s']:.2f}x a steady training step, "
        f"{off['score_steady_s'] / on['score_steady_s']:.2f}x a steady scoring pass; "
        f"{on['wall_s'] - off['wall_s']:+.1f} s over the {args.steps} steps of each")
    if args.json:
        write_json(results, args.json)


if __name__ == "__main__":
    main()
