"""Learner token logprobs: blockwise from the hidden states (`kimi_kernels.logprobs`, what the learner
uses) against the full logits + log_softmax (what it replaced), side by side in one run, forward
and backward, at K3's vocabulary. Each variant runs in its own process so its peak memory is its
own: peak RSS growth on CPU, peak allocated on CUDA.

    python benchmarks/learner_token_logprobs.py [--tokens 1024] [--hidden 2304] [--vocab 163840] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

from bench_common import median_wall_s


def run_variant(name: str, tokens: int, hidden: int, vocab: int, device: str, iters: int) -> dict[str, float]:
    from kimi_kernels.logprobs import linear_token_logprobs

    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # filled in place: no temporaries, so the peak before the step is what the inputs hold
    h = torch.empty(tokens, hidden, device=device, dtype=dtype).normal_(generator=g).requires_grad_(True)
    w = torch.empty(vocab, hidden, device=device, dtype=dtype).normal_(0, 0.02, generator=g).requires_grad_(True)
    t = torch.randint(0, vocab, (tokens,), device=device, generator=g)

    def step() -> float:
        if name == "blockwise":
            logp, ent = linear_token_logprobs(h, w, t)
        else:
            logp_all = torch.log_softmax((h @ w.t()).float(), dim=-1)
            logp = logp_all.gather(1, t[:, None]).squeeze(1)
            with torch.no_grad():
                ent = -(logp_all.exp() * logp_all).sum(-1)
        logp.sum().backward()
        return float(logp.sum()) + float(ent.sum())

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    checksum = step()  # also the warm-up

    def again() -> None:
        h.grad = w.grad = None
        step()

    seconds = median_wall_s(again, iters, sync, warmup=0)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB -> MiB
    return {"ms": 1e3 * seconds, "peak_extra_mib": peak, "checksum": checksum}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2304)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # the child process
    a = p.parse_args()
    if a.variant:
        print(json.dumps(run_variant(a.variant, a.tokens, a.hidden, a.vocab, a.device, a.iters)))
        return
    res = {}
    for name in ("full_logits", "blockwise"):
        out = subprocess.run([sys.executable, __file__, "--variant", name, "--tokens", str(a.tokens), "--hidden",
                              str(a.hidden), "--vocab", str(a.vocab), "--device", a.device, "--iters", str(a.iters)],
                             capture_output=True, text=True, check=True)
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:12s} fwd+bwd {res[name]['ms']:8.1f} ms   peak extra memory {res[name]['peak_extra_mib']:8.0f} MiB",
              flush=True)
    same = abs(res["full_logits"]["checksum"] - res["blockwise"]["checksum"]) <= 1e-3 * abs(res["full_logits"]["checksum"])
    print(f"{a.tokens} tokens, hidden {a.hidden}, vocab {a.vocab}, {a.device}: same logprob+entropy sums: {same}; "
          f"memory {res['full_logits']['peak_extra_mib'] / max(res['blockwise']['peak_extra_mib'], 1):.1f}x less, "
          f"time ratio full/blockwise {res['full_logits']['ms'] / res['blockwise']['ms']:.2f}")


if __name__ == "__main__":
    main()
