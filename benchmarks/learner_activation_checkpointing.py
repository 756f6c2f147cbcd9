"""Activation checkpointing in a learner step: what a training forward keeps for backward, the
peak memory of forward + backward (CUDA), and the time, with and without
`set_activation_checkpointing(True)`, on one model in one process.

    python benchmarks/learner_activation_checkpointing.py [--preset small] [--batch 4] [--seq 1024] [--device cuda]
"""
from __future__ import annotations

import argparse
import json

import torch

from bench_common import log, median_wall_s
from policy import build_model
from policy.dtypes import device_precision, params_to


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes the forward keeps for backward outside checkpointed layers."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, return_token_logprobs=True)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = params_to(build_model(args.preset, vocab_size=32768).to(dev), device_precision(dev)).train()
    ids = torch.randint(0, 32768, (args.batch, args.seq), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step() -> None:
        model(ids, return_token_logprobs=True).token_logprobs.sum().backward()

    results = {"preset": args.preset, "batch": args.batch, "seq": args.seq, "device": args.device}
    for on in (False, True):
        model.set_activation_checkpointing(on)
        name = "checkpointed" if on else "stored"
        row = {"saved_for_backward_mib": saved_bytes(model, ids) / 2**20}
        model.zero_grad(set_to_none=False)  # gradients allocated before the peak is measured
        step()
        if dev.type == "cuda":
            sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            sync()
            row["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["step_s"] = median_wall_s(step, args.iters, sync)
        results[name] = row
        log(f"{name}: {row}")
    for key in ("saved_for_backward_mib", "peak_extra_mib", "step_s"):
        if key in results["stored"]:
            results[f"{key}_ratio"] = results["checkpointed"][key] / results["stored"][key]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
