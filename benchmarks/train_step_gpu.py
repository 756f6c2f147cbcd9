"""GPU benchmark (one H200): the `small` preset's training step (forward + backward), fast paths
against the reference paths in one run, with model FLOP utilisation and a kernel-time profile.

    python benchmarks/train_step_gpu.py --seq 8192 --batch 1 4 [--json $OUT/gpu_model.json]
    python benchmarks/train_step_gpu.py --seq 8192 --packed agentic --loss logprobs   # the learner's packed rows

Configurations, each timed on the same weights and tokens:
  fast       fla chunk_kda, SDPA attention (flash / memory-efficient), grouped-GEMM MoE, fused
             (torch.compile'd) fp32 elementwise chains: norms, gates, SiTU-GLU, AttnRes
  unfused    fast without the fused elementwise chains
  reference  torch KDA, fp32 reference attention, per-expert MoE loop (the CPU paths)
plus, before timing, GPU agreement checks of each fast path against its reference (bf16).
`--packed LENGTHS`: each row of `seq` tokens packs sequences end to end (cu_seqlens, as the learner's
packed micro-batches): `agentic` 256-4096 tokens log-uniform (multi-turn episodes), `longtail`
32-4096. MFU = 6 * active parameters * tokens/s / 989 TFLOP/s (H200 dense bf16); attention and KDA FLOPs
are not counted, so it understates the work done. fla pays Triton autotuning (minutes) on the
first step of a new shape: keep TRITON_CACHE_DIR between calls.
"""
from __future__ import annotations

import argparse
import json
import math
from contextlib import ExitStack
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bench_common import cuda_time_ms, log, rel_err, write_json

H200_BF16_PEAK = 989e12
RESULTS: dict[str, Any] = {}


def paths(name: str) -> ExitStack:
    """Enter the kernel choices of one configuration: "fast", "unfused", "reference", or one
    fast path alone on top of the reference ("kda", "attention", "moe", "fusion")."""
    from kimi_kernels.attention import attention_backend
    from kimi_kernels.fusion import set_fusion
    from kimi_kernels.kda import kda_backend
    from policy.layers import moe

    stack = ExitStack()
    fast = name in ("fast", "unfused")
    on = {part: fast or name == part for part in ("kda", "attention", "moe", "fusion")}
    on["fusion"] = name in ("fast", "fusion")
    prev_fusion = set_fusion(on["fusion"])
    stack.callback(lambda: set_fusion(prev_fusion))
    stack.enter_context(kda_backend("auto" if on["kda"] else "torch"))
    stack.enter_context(attention_backend("auto" if on["attention"] else "torch"))
    prev = moe._GROUPED_MM
    moe._GROUPED_MM = on["moe"]
    stack.callback(lambda: setattr(moe, "_GROUPED_MM", prev))
    return stack


def check_fast_paths() -> None:
    """bf16 agreement of each fast path with its reference, forward and gradients."""
    from kimi_kernels.attention import attention
    from kimi_kernels.ops import topk_mask
    from policy import get_config
    from policy.layers import moe

    torch.manual_seed(0)
    out: dict[str, Any] = {}
    # attention: plain causal (flash, padded head dims) and DSA-style top-k mask (memory-efficient)
    B, T, H, Dk, Dv = 1, 2048, 4, 96, 128
    q, k, v = (torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16) for d in (Dk, Dk, Dv))
    sel = topk_mask(torch.rand(B, T, T, device="cuda"), 512)
    for label, kw in (("causal", {}), ("topk", {"mask": sel})):
        res = []
        for backend in ("torch", "sdpa"):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            o = attention(*leaves, scale=Dk ** -0.5, key_mask=torch.ones(B, T, dtype=torch.bool, device="cuda"),
                          backend=backend, **kw)
            o.float().pow(2).sum().backward()
            res.append([o.detach()] + [t.grad for t in leaves])
        out[f"attention_{label}"] = {n: round(rel_err(a, b), 5) for n, a, b in zip(("o", "dq", "dk", "dv"), res[1], res[0])}
    # MoE experts: grouped GEMM vs the per-expert loop
    cfg = get_config("small")
    ex = moe.StackedExperts(cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg)
    ex = ex.cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.05)
    z = torch.randn(4096, cfg.routed_expert_hidden_size, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(4096, cfg.num_experts, device="cuda").topk(cfg.num_experts_per_token, -1).indices
    w = torch.rand(4096, cfg.num_experts_per_token, device="cuda")
    res = []
    for grouped in (False, True):
        moe._GROUPED_MM = grouped
        ex.zero_grad(set_to_none=True)
        zz = z.clone().requires_grad_(True)
        y = ex(zz, w, idx)
        y.pow(2).sum().backward()
        res.append([y.detach(), zz.grad, ex.w1.grad, ex.w2.grad])
    moe._GROUPED_MM = True
    out["moe_grouped"] = {n: round(rel_err(a, b), 5) for n, a, b in zip(("y", "dz", "dw1", "dw2"), res[1], res[0])}
    # the whole model, bf16: each fast path alone and all together against the reference paths, with
    # the reference's expert choices replayed (a near-tie in a router flips an expert and would
    # swamp the comparison); the fp32 model on the reference paths is the yardstick for bf16 noise
    from policy import build_model

    model = build_model("small", device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (1, 2048), device="cuda")
    with paths("reference"), torch.no_grad():
        ref = model(ids, return_routing=True)
        ref32 = build_model("small", device="cuda", dtype=torch.float32)
        ref32.load_state_dict(model.state_dict())
        exact = ref32(ids, routing=ref.routing).logits
        del ref32
    errs = {"bf16_reference_vs_fp32": round(rel_err(ref.logits, exact), 5)}
    for name in ("kda", "attention", "moe", "fusion", "fast"):
        with paths(name), torch.no_grad():
            errs[name] = round(rel_err(model(ids, routing=ref.routing).logits, ref.logits), 5)
    out["model_logits_vs_reference"] = errs
    del model
    RESULTS["checks"] = out
    log(f"fast-path agreement (relative error vs reference, bf16): {json.dumps(out)}")


PACKED_LENGTHS = {"agentic": (256, 4096), "longtail": (32, 4096)}


def packed_boundaries(seq: int, lengths: str, seed: int = 0) -> list[int]:
    """cu_seqlens of one packed row of `seq` tokens: log-uniform lengths in PACKED_LENGTHS[lengths],
    the last one cut to fill the row."""
    lo, hi = PACKED_LENGTHS[lengths]
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    while cu[-1] < seq:
        n = int(math.exp(float(torch.empty(1).uniform_(math.log(lo), math.log(hi), generator=gen))))
        cu.append(min(seq, cu[-1] + n))
    return cu


def model_step(cfg: Any, seq: int, batch: int, configs: list[str], warmup: int, iters: int, profile: bool,
               loss: str = "logits", packed: str | None = None) -> None:
    from policy import build_model
    from policy.params import count_parameters

    torch.manual_seed(0)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    counts = count_parameters(model)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq + 1), device="cuda")
    x, y = ids[:, :-1], ids[:, 1:]
    rows = [torch.tensor(packed_boundaries(seq, packed, seed=b), device="cuda") for b in range(batch)] if packed else []

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if packed:  # the learner's packed micro-batches: one row at a time, gradients accumulated
            for b, cu in enumerate(rows):
                out = model(x[b:b + 1], return_token_logprobs=True, cu_seqlens=cu)
                (-out.token_logprobs.sum() / x.numel()).backward()
            return
        if loss == "logprobs":  # the learner's path: token logprobs from the hidden states, no logits
            (-model(x, return_token_logprobs=True).token_logprobs[:, 1:].mean()).backward()
            return
        logits = model(x).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()

    tokens = batch * seq
    res: dict[str, Any] = {"params": counts, "batch": batch, "seq": seq, "loss": "logprobs" if packed else loss}
    if packed:
        res["packed"] = {"lengths": packed, "sequences_per_row": [len(cu) - 1 for cu in rows]}
    for name in configs:
        with paths(name):
            log(f"B={batch} T={seq} [{name}]: warm-up")
            torch.cuda.reset_peak_memory_stats()
            try:
                ms = cuda_time_ms(step, warmup, iters if name == "fast" else max(2, iters // 3))
            except Exception as e:  # keep the other configurations' figures
                res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                log(f"B={batch} T={seq} [{name}] FAILED: {res[name]['error']}")
                continue
            tps = tokens / (ms / 1e3)
            mfu = 6 * counts["active"] * tps / H200_BF16_PEAK
            res[name] = {"fwd_bwd_ms": round(ms, 2), "tokens_per_s": round(tps), "mfu_6N_pct": round(100 * mfu, 2),
                         "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
            log(f"B={batch} T={seq} [{name}]: {ms:.1f} ms/step, {tps:,.0f} tok/s, MFU(6N) {100 * mfu:.2f}%, "
                f"peak {res[name]['peak_mem_gib']} GiB")
            if profile and name == "fast":
                res["profile_top"] = kernel_profile(step)
                res["host"] = host_profile(step)
    timed = {n: r["fwd_bwd_ms"] for n, r in res.items() if isinstance(r, dict) and "fwd_bwd_ms" in r}
    if "fast" in timed:
        res["speedup_fast_vs"] = {n: round(ms / timed["fast"], 2) for n, ms in timed.items() if n != "fast"}
    RESULTS[f"{cfg.name}_B{batch}_T{seq}" + (f"_packed_{packed}" if packed else "")] = res


def host_profile(step: Callable[[], None], top: int = 15) -> dict[str, Any]:
    """Where the host holds the GPU up: the milliseconds until one step's Python returns (the GPU
    idles where that reaches the step's time) and the calls that wait for the GPU (a synchronizing
    op drains the queue: every launch after it is exposed), by the line that made them."""
    import time
    import warnings
    from collections import Counter

    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    gpu_done_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = Counter(f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught
                    if "synchroniz" in str(w.message))
    log(f"host: {host_ms:.1f} ms to enqueue a step that finished after {gpu_done_ms:.1f} ms; "
        f"{sum(syncs.values())} synchronizing calls: {syncs.most_common(top)}")
    return {"host_ms": round(host_ms, 2), "done_ms": round(gpu_done_ms, 2), "syncs": sum(syncs.values()),
            "sync_sites": syncs.most_common(top)}


def kernel_profile(step: Callable[[], None], top: int = 25) -> dict[str, Any]:
    """GPU time over one step, largest first: per kernel, and per PyTorch op with its input
    shapes (which call launched the copies and elementwise kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    # "## Call CompiledFxGraph ##" ranges wrap compiled kernels that are listed on their own
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("## ")]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in kernels) or 1.0
    launches = sum(e.count for e in kernels)
    log(f"kernel time over one step: {total / 1e3:.1f} ms in all, {launches} launches")
    out: dict[str, Any] = {"kernel_ms": round(total / 1e3, 2), "launches": launches, "kernels": [], "ops": []}
    for e in kernels[:top]:
        out["kernels"].append({"kernel": e.key[:90], "calls": e.count, "ms": round(e.device_time_total / 1e3, 2),
                               "pct": round(100 * e.device_time_total / total, 1)})
        r = out["kernels"][-1]
        log(f"  {r['pct']:5.1f}%  {r['ms']:8.2f} ms  x{r['calls']:<5} {r['kernel']}")
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0
           and not e.key.startswith("## ")]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    log("by op and input shapes (self GPU time):")
    for e in ops[:top]:
        out["ops"].append({"op": e.key, "shapes": str(e.input_shapes)[:120], "calls": e.count,
                           "ms": round(e.self_device_time_total / 1e3, 2)})
        r = out["ops"][-1]
        log(f"  {r['ms']:8.2f} ms  x{r['calls']:<5} {r['op']} {r['shapes']}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="the model timed (the agreement checks always use small)")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=JSON",
                   help='config overrides, e.g. num_hidden_layers=4 \'layer_types=["kda","mla"]\'')
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--loss", choices=["logits", "logprobs"], default="logits",
                   help="logits: fp32 logits + cross-entropy; logprobs: the learner's blockwise token logprobs")
    p.add_argument("--packed", choices=sorted(PACKED_LENGTHS), default=None,
                   help="pack each row with sequences of these lengths (the learner's path: token logprobs)")
    p.add_argument("--configs", nargs="+", default=["fast", "unfused", "reference"], choices=["fast", "unfused", "reference"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-checks", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import triton

    from policy import get_config

    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in a.set)}
    cfg = get_config(a.preset, **overrides)
    if overrides:
        cfg = cfg.replace(name=f"{cfg.name}+{'+'.join(f'{k}={v}' for k, v in overrides.items() if k != 'layer_types')}")

    from kimi_kernels.kda import fla_available

    RESULTS["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                      "fla": fla_available()}
    log(f"env {RESULTS['env']}")

    if not a.no_checks:
        check_fast_paths()
        write_json(RESULTS, a.json)
    for i, b in enumerate(a.batch):
        model_step(cfg, a.seq, b, a.configs, a.warmup, a.iters, profile=not a.no_profile and i == 0, loss=a.loss,
                   packed=a.packed)
        torch.cuda.empty_cache()
        write_json(RESULTS, a.json)


if __name__ == "__main__":
    main()
