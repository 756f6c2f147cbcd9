"""GPU smoke + timing for the policy (one H200): the `small` preset in bf16 on CUDA.

    python benchmarks/policy_smoke_gpu.py [--seq 4096]

Checks that every path runs on CUDA (train step with routing record + replay, DSA, AttnRes,
prefill + decode with the cache, after_optimizer_step) and prints fwd+bwd time per step and
decode tokens/s. KDA uses fla-core when importable, else the torch path (printed).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kimi_kernels.kda import fla_available
from policy import build_model


def timed(fn, iters: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    a = p.parse_args()
    torch.manual_seed(0)
    model = build_model("small", device="cuda", dtype=torch.bfloat16).train()
    cfg = model.config
    print(f"fla available: {fla_available()}; device {torch.cuda.get_device_name()}")
    ids = torch.randint(3, cfg.vocab_size, (1, a.seq + 1), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        out = model(ids[:, :-1], return_routing=True)
        loss = F.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.after_optimizer_step()

    s = timed(step)
    print(f"small train step T={a.seq}: {s * 1e3:.0f} ms, {a.seq / s:,.0f} tok/s, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    with torch.no_grad():
        out = model(ids[:, :512], return_routing=True)
        again = model(ids[:, :512], routing=out.routing)
        print("replay exact:", torch.equal(out.logits, again.logits))
        model.eval()
        for label, m in (("bf16", model), ("fp32", build_model("small", device="cuda").eval())):
            if m is not model:
                m.load_state_dict(model.state_dict())
            ref = m(ids[:, :300], return_routing=True)
            full, r = ref.logits, ref.routing
            for replay in (False, True):  # replaying the full pass's experts removes routing flips
                pre = m(ids[:, :256], use_cache=True, routing=r[:, :256] if replay else None)
                cache, logs = pre.cache, [pre.logits]
                for t in range(256, 300):
                    o = m(ids[:, t:t + 1], cache=cache, use_cache=True, routing=r[:, t:t + 1] if replay else None)
                    cache = o.cache
                    logs.append(o.logits)
                err = (torch.cat(logs, 1) - full).abs().max().item()
                print(f"decode vs full max abs err ({label}, replay={replay}): {err:.3g} "
                      f"(logit scale {full.abs().max().item():.3g})")
        cache = model(ids[:, :1024], use_cache=True).cache.select([0] * 32)
        tok = ids[:, :1].expand(32, 1).contiguous()

        def decode() -> None:
            c = cache
            for _ in range(32):
                c = model(tok, cache=c, use_cache=True).cache

        s = timed(decode, 2)
        print(f"decode 32 rows x 32 steps after 1024 tokens: {32 * 32 / s:,.0f} tok/s")


if __name__ == "__main__":
    main()
