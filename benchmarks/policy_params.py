"""Policy presets: layer pattern and parameter counts (meta device), plus CPU throughput of `toy`.

    .venv/bin/python benchmarks/policy_params.py [--threads 1] [--skip-cpu]

CPU figures: one AdamW training step on B x T tokens (forward + backward + after_optimizer_step),
and batched decode with the cache (B rows forked from one prompt), median of a few repeats.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench_common import median_wall_s
from policy import PRESETS, build_model
from policy.cli import model_info


def cpu_toy(batch: int, seq: int, decode_rows: int, decode_steps: int, repeats: int) -> None:
    torch.manual_seed(0)
    model = build_model("toy", vocab_size=512).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 512, (batch, seq + 1))

    def train_step() -> None:
        logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, 512), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.after_optimizer_step()

    s = median_wall_s(train_step, repeats)
    print(f"toy train   B={batch} T={seq}: {s * 1e3:.0f} ms/step, {batch * seq / s:,.0f} tok/s")
    model.eval()
    prompt = torch.randint(3, 512, (1, 64))

    @torch.no_grad()
    def decode() -> None:
        cache = model(prompt, use_cache=True).cache.select([0] * decode_rows)
        tok = torch.randint(3, 512, (decode_rows, 1))
        for _ in range(decode_steps):
            out = model(tok, cache=cache, use_cache=True)
            cache, tok = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)

    s = median_wall_s(decode, repeats)
    print(f"toy decode  {decode_rows} rows x {decode_steps} steps after a 64-token prompt: "
          f"{decode_rows * decode_steps / s:,.0f} tok/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-cpu", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"{'preset':16} {'layers':>6} {'total':>18} {'active/token':>16}  pattern")
    for name in PRESETS:
        d = model_info(name)
        pat = d["layer_pattern"] if len(d["layer_pattern"]) <= 32 else d["layer_pattern"][:29] + "..."
        print(f"{name:16} {d['layers']:>6} {d['total_params']:>18,} {d['active_params']:>16,}  {pat}")
    if not a.skip_cpu:
        cpu_toy(batch=8, seq=128, decode_rows=8, decode_steps=64, repeats=3)


if __name__ == "__main__":
    main()
