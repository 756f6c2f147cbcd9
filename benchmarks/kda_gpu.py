"""GPU benchmark (one H200): fla-core chunk_kda alone vs our kimi_kernels.kda dispatch, and torch path
agreement. The whole model's step is in benchmarks/train_step_gpu.py.

Run on the device machine (fla-core installed, e.g. from a carried wheel):

    python benchmarks/kda_gpu.py --seq 8192 [--json $OUT/gpu_kda.json] [--only decode]

Timings: CUDA events, median of --iters after --warmup calls (the first call also pays
Triton compilation/autotuning). fwd+bwd = forward, then backward from fixed random
output/state gradients.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bench_common import cuda_time_ms, log, rel_err, write_json

RESULTS: dict[str, Any] = {}


def kda_inputs(B: int, T: int, H: int, D: int, seed: int = 0) -> list[torch.Tensor]:
    """bf16 q/k/v/beta (q, k l2-normalised as the layer does), fp32 lower-bound gates and state."""
    from kimi_kernels.kda import kda_gate

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q = F.normalize(r(B, T, H, D), dim=-1).bfloat16()
    k = F.normalize(r(B, T, H, D), dim=-1).bfloat16()
    v = r(B, T, H, D).bfloat16()
    A_log = torch.empty(H, device="cuda").uniform_(1, 16, generator=gen).log()
    g = kda_gate(r(B, T, H, D), A_log, r(H * D), lower_bound=-5.0)
    beta = torch.sigmoid(r(B, T, H)).bfloat16()
    h0 = r(B, H, D, D) * 0.1
    return [q, k, v, g, beta, h0]


def fwd_bwd(impl: Callable, base: list[torch.Tensor], grads: tuple[torch.Tensor, torch.Tensor]) -> list:
    args = [x.detach().requires_grad_(True) for x in base]
    o, s = impl(*args[:5], initial_state=args[5], output_final_state=True)
    torch.autograd.backward([o, s], [grads[0].to(o.dtype), grads[1]])
    return [o.detach(), s.detach()] + [a.grad for a in args]


def kda_section(name: str, B: int, T: int, H: int, D: int, warmup: int, iters: int, torch_iters: int) -> None:
    from fla.ops.kda import chunk_kda

    from kimi_kernels.kda import kda, kda_chunk

    base = kda_inputs(B, T, H, D)
    gen = torch.Generator(device="cuda").manual_seed(1)
    grads = (torch.randn(B, T, H, D, device="cuda", generator=gen), torch.randn(B, H, D, D, device="cuda", generator=gen))
    res: dict[str, Any] = {"shape": dict(B=B, T=T, H=H, HV=H, K=D, V=D), "dtype": "bf16 q/k/v/beta, fp32 g/state"}

    log(f"{name}: first fla call (compiles / autotunes)")
    t0 = time.time()
    out_fla = fwd_bwd(chunk_kda, base, grads)
    torch.cuda.synchronize()
    res["fla_first_call_s"] = round(time.time() - t0, 1)
    log(f"{name}: first call {res['fla_first_call_s']}s; torch path for agreement")
    out_torch = fwd_bwd(lambda *a, **kw: kda_chunk(*a, **kw), base, grads)
    labels = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    res["rms_rel_err_torch_vs_fla"] = {lab: rel_err(a, b) for lab, a, b in zip(labels, out_torch, out_fla)}
    log(f"{name}: rms rel err torch vs fla {res['rms_rel_err_torch_vs_fla']}")
    del out_fla, out_torch

    impls = {
        "fla_chunk_kda": chunk_kda,
        "ours_kda_dispatch": kda,
        "ours_torch_kda_chunk": lambda *a, **kw: kda_chunk(*a, **kw),
    }
    for label, impl in impls.items():
        n = torch_iters if "torch" in label else iters
        with torch.no_grad():
            fwd = cuda_time_ms(lambda: impl(*base[:5], initial_state=base[5], output_final_state=True), warmup, n)
        fb = cuda_time_ms(lambda: fwd_bwd(impl, base, grads), warmup, n)
        res[label] = {"fwd_ms": round(fwd, 3), "fwd_bwd_ms": round(fb, 3),
                      "fwd_bwd_tokens_per_s": round(B * T / (fb / 1e3))}
        log(f"{name}: {label}: fwd {fwd:.3f} ms, fwd+bwd {fb:.3f} ms, {B * T / (fb / 1e3):,.0f} tok/s")
    res["dispatch_overhead_fwd_bwd_pct"] = round(
        100 * (res["ours_kda_dispatch"]["fwd_bwd_ms"] / res["fla_chunk_kda"]["fwd_bwd_ms"] - 1), 2)
    res["fla_speedup_over_torch_fwd_bwd"] = round(
        res["ours_torch_kda_chunk"]["fwd_bwd_ms"] / res["fla_chunk_kda"]["fwd_bwd_ms"], 2)
    RESULTS[name] = res


def decode_section() -> None:
    """One-token step: fla fused_recurrent_kda (via kda dispatch, no grad) vs our recurrent oracle."""
    from kimi_kernels.kda import kda, kda_recurrent

    base = kda_inputs(8, 1, 16, 128, seed=3)
    with torch.no_grad():
        o_f, s_f = kda(*base[:5], initial_state=base[5], output_final_state=True)
        o_t, s_t = kda_recurrent(*base[:5], initial_state=base[5], output_final_state=True)
    RESULTS["decode_step_rms_rel_err"] = {"o": rel_err(o_t, o_f), "state": rel_err(s_t, s_f)}
    log(f"decode step rms rel err (recurrent vs fla fused_recurrent): {RESULTS['decode_step_rms_rel_err']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--torch-iters", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None,
                   help="run only these sections: kda_kimi_linear_layer kda_small_layer decode "
                        "(each new KDA shape pays fla's Triton autotuning, ~220 s on an H200)")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    a = p.parse_args()
    import fla
    import triton

    RESULTS["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "fla": getattr(fla, "__version__", "?")}
    log(f"env {RESULTS['env']}")
    sections: list[tuple[str, Callable[[], None]]] = [
        ("kda_kimi_linear_layer", lambda: kda_section("kda_kimi_linear_layer", 1, a.seq, 32, 128,
                                                      a.warmup, a.iters, a.torch_iters)),
        ("kda_small_layer", lambda: kda_section("kda_small_layer", 1, a.seq, 4, 128, a.warmup, a.iters,
                                                a.torch_iters)),
        ("decode", decode_section),
    ]
    for name, fn in sections:
        if a.only is not None and name not in a.only:
            continue
        try:
            fn()
        except Exception as e:  # keep the other sections' figures
            RESULTS[f"{name}_error"] = f"{type(e).__name__}: {e}"
            log(f"{name} FAILED: {e}")
            traceback.print_exc()
        torch.cuda.empty_cache()
        write_json(RESULTS, a.json)
    print(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
