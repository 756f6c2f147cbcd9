"""MLA's absorbed decode attention on a paged cache: keys read in place beside keys gathered first.

    python3 benchmarks/mla_paged_decode.py --contexts 1024 8192 32768 131072 --rows 64

One run, at the Kimi-Linear shape (32 query heads, latent 512, rope 64, bf16): `--rows` rows of
`--context` keys each, kept as policy/slot_cache.py keeps them (blocks of 16 keys, shuffled over one
pool). "gathered" is what the decode step did before kimi_kernels.mla_decode_paged: each row's keys
copied into [rows, context] tensors (past, then the new token appended), then the kernel;
"paged" is the kernel reading the pool through the per-row index. Both are timed in CUDA graphs
(as the engine replays its decode step), beside the bound: the keys' bytes read once at the GPU's
copy rate (`--bandwidth`, the H200's 4.3 TB/s by default).

`--launch BLOCK_T,WARPS,STAGES,PROGRAMS ...` also times the paged kernel under other launch constants
(keys per step, warps, pipeline stages, target programs; kimi_kernels/mla_decode.py's defaults are
64,8,2,528), each checked against the default's output: how those defaults are chosen on a new GPU."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import log, write_json  # noqa: E402
from kimi_kernels.mla_decode import mla_decode, mla_decode_paged  # noqa: E402

HEADS, LATENT, ROPE, BLOCK = 32, 512, 64, 16
KERNEL = importlib.import_module("kimi_kernels.mla_decode")  # the module: the package exports a function of its name
LAUNCH_NAMES = ("BLOCK_T", "NUM_WARPS", "NUM_STAGES", "_TARGET_PROGRAMS")


def graph_ms(fn, replays: int = 20) -> float:
    """Milliseconds per replay of `fn` captured in a CUDA graph (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def with_launch(launch: tuple[int, ...], fn):
    """`fn()` with the kernel's launch constants set to `launch` (LAUNCH_NAMES order), restored after."""
    previous = tuple(getattr(KERNEL, name) for name in LAUNCH_NAMES)
    for name, value in zip(LAUNCH_NAMES, launch):
        setattr(KERNEL, name, value)
    try:
        return fn()
    finally:
        for name, value in zip(LAUNCH_NAMES, previous):
            setattr(KERNEL, name, value)


def one_context(rows: int, context: int, bandwidth: float, launches: list[tuple[int, ...]]) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = rows * -(-context // BLOCK)
    dtype = torch.bfloat16
    pool_latent = torch.randn(blocks * BLOCK, LATENT, device="cuda", dtype=dtype, generator=gen)
    pool_rope = torch.randn(blocks * BLOCK, ROPE, device="cuda", dtype=dtype, generator=gen)
    tables = torch.randperm(blocks, device="cuda", generator=gen).view(rows, -1)  # rows' blocks, scattered
    pos = torch.arange(context, device="cuda")
    index = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK  # [rows, context]: the past keys, then the new one
    past_index, new_index = index[:, :-1].contiguous(), index[:, -1:].contiguous()
    valid = torch.ones(rows, context, dtype=torch.bool, device="cuda")
    q = torch.randn(rows, HEADS, LATENT + ROPE, device="cuda", dtype=dtype, generator=gen)
    new_latent, new_rope = pool_latent[new_index], pool_rope[new_index]
    scale = (LATENT + ROPE) ** -0.5

    def gathered() -> torch.Tensor:
        latent = torch.cat([pool_latent[past_index], new_latent], 1)
        rope = torch.cat([pool_rope[past_index], new_rope], 1)
        return mla_decode(q, latent, rope, valid, scale)

    def paged() -> torch.Tensor:
        return mla_decode_paged(q, pool_latent, pool_rope, index, valid, scale)

    if not torch.equal(gathered(), paged()):
        raise SystemExit(f"paged and gathered keys differ at {rows} rows x {context}")
    times = {"gathered": graph_ms(gathered), "paged": graph_ms(paged)}
    key_bytes = rows * context * (LATENT + ROPE) * pool_latent.element_size()
    bound_ms = key_bytes / bandwidth * 1e3
    log(f"{rows} rows x {context:>6} keys: gathered {times['gathered']:8.3f} ms, paged {times['paged']:8.3f} ms "
        f"({times['gathered'] / times['paged']:.2f}x); reading the keys once at {bandwidth / 1e12:.1f} TB/s: "
        f"{bound_ms:.3f} ms (paged at {bound_ms / times['paged']:.0%} of it)")
    reference = paged()
    for launch in launches:
        out = with_launch(launch, paged)
        err = (out.float() - reference.float()).abs().max().item()
        if err > 0.05:
            raise SystemExit(f"launch {launch} differs from the default by {err:.3g} at {rows} rows x {context}")
        ms = with_launch(launch, lambda: graph_ms(paged))
        times["paged " + ",".join(map(str, launch))] = ms
        log(f"    launch {','.join(map(str, launch)):>14}: {ms:8.3f} ms ({bound_ms / ms:.0%} of the bound; "
            f"{times['paged'] / ms:.2f}x the default)")
    return {"rows": rows, "context": context, **{f"{k}_ms": v for k, v in times.items()}, "bound_ms": bound_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--bandwidth", type=float, default=4.3e12)
    parser.add_argument("--launch", nargs="*", default=[], metavar="BLOCK_T,WARPS,STAGES,PROGRAMS")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mla_paged_decode.py: needs a CUDA GPU (the kernel runs on one; CPU runs never reach it)")
    launches = [tuple(int(v) for v in text.split(",")) for text in args.launch]
    if any(len(launch) != len(LAUNCH_NAMES) for launch in launches):
        raise SystemExit(f"--launch: each is BLOCK_T,WARPS,STAGES,PROGRAMS (four integers), got {args.launch}")
    results = [one_context(args.rows, c, args.bandwidth, launches) for c in args.contexts]
    if args.json:
        write_json({"results": results}, args.json)


if __name__ == "__main__":
    main()
