"""What the MoE row kernels (kimi_kernels/expert_rows.py) compile to for an H100 / H200 (sm90), on a
machine without a GPU: shared memory, barriers, and the widths of their global loads and stores.

For when no GPU is lent: a kernel that needs shared memory and barriers to reduce across warps, or
loads and stores in pieces narrower than 16 bytes, will not stream at the memory's rate, and this shows
it before any timing. Compiled as Triton's JIT would specialise them at the Kimi-Linear shape (bf16
rows, pointers and d divisible by 16). Needs a full Triton install with its bundled ptxas (not the
CPU-only path): the one `make .cache/triton-interp/.installed` puts under .cache/triton-interp.

    PYTHONPATH=.cache/triton-interp:. .venv/bin/python benchmarks/kernel_ptx_sm90.py [--json PATH]
"""
from __future__ import annotations

import argparse
import re

from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench_common import log, write_json
from kimi_kernels import expert_rows

SM90 = GPUTarget("cuda", 90, 32)
K = 8  # top-8


def kernels() -> dict[str, tuple]:
    """name -> (jit function, signature of its runtime arguments, constexprs, warps)."""
    sums_sig = {"rows_ptr": "*bf16", "w_ptr": "*fp32", "pair_ptr": "*i64", "y_ptr": "*bf16", "D": "i32"}
    bwd_sig = {"grad_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*fp32", "pair_ptr": "*i64",
               "grad_out_ptr": "*bf16", "grad_w_ptr": "*fp32", "D": "i32"}
    sums = {"K": K, "BLOCK_D": expert_rows._SUM_BLOCK_D}
    return {
        "weighted_token_sums": (expert_rows._token_sums_kernel, sums_sig, {**sums, "WEIGHTED": True},
                                expert_rows._SUM_WARPS),
        "token_sums": (expert_rows._token_sums_kernel, sums_sig, {**sums, "WEIGHTED": False}, expert_rows._SUM_WARPS),
        "weighted_token_sums_backward": (expert_rows._weighted_sums_backward_kernel, bwd_sig,
                                         {"K": K, "KP": K, "BLOCK_D": expert_rows._BLOCK_D}, 4),  # launched with Triton's default 4 warps
    }


def summary(fn, signature: dict[str, str], constexprs: dict[str, object], warps: int) -> dict[str, object]:
    params = list(fn.arg_names)
    sig = {name: signature.get(name, "constexpr") for name in params}
    # what the JIT sees at this shape: 16-byte aligned pointers, d a multiple of 16
    attrs = {(params.index(name),): [["tt.divisibility", 16]] for name in signature}
    source = ASTSource(fn=fn, signature=sig, constexprs={(params.index(n),): v for n, v in constexprs.items()},
                       attrs=attrs)
    ptx = triton_compile(source, target=SM90, options={"num_warps": warps}).asm["ptx"]
    return {
        "warps": warps,
        "shared_memory": len(re.findall(r"st\.shared", ptx)) > 0,
        "barriers": ptx.count("bar.sync"),
        "global_loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
        "global_stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx))),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    results = {}
    for name, (fn, signature, constexprs, warps) in kernels().items():
        results[name] = summary(fn, signature, constexprs, warps)
        r = results[name]
        log(f"{name} ({warps} warps): shared memory {'yes' if r['shared_memory'] else 'no'}, "
            f"{r['barriers']} barriers, loads {', '.join(r['global_loads'])}, stores {', '.join(r['global_stores'])}")
    write_json(results, args.json)


if __name__ == "__main__":
    main()
