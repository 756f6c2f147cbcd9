"""The native rollout engine's decode throughput on one GPU, beside its memory-bandwidth bound.

    python3 benchmarks/rollout_decode_gpu.py --preset small --seqs 64 256
    python3 benchmarks/rollout_decode_gpu.py --preset kimi-linear-4l --seqs 64 --json $OUT/rollout_gpu.json
    python3 benchmarks/rollout_decode_gpu.py --preset small --seqs 64 --long-context 131072

Each size runs in several modes in one process (`--modes` picks), eager decode beside the CUDA-graph
decode (rl/rollout/decode_graphs.py), the graphs with overlapped steps (each launched before the
last one's tokens are read back: the engine's default on a GPU), those with the captured step
compiled by torch.compile (`rollout.compile_decode`), and that with the routed experts on CUTLASS's
grouped GEMM instead of the small-M kernels (kimi_kernels/grouped_experts.py), and graphs + overlap with
MLA's absorbed decode attention on the fp32 reference instead of kimi_kernels/mla_decode.py, or on that
kernel with the keys gathered out of the cache's blocks first (as before it read them in place); the same
sequences and tokens. `--long-context N` then prefills one
N-token prompt (in chunks of --chunk tokens) and decodes from it: time, decode rate, peak memory.

`kimi-linear-4l`: Kimi-Linear-48B layer shapes cut to 4 layers (3 KDA + 1 MLA) and 64 experts.
Weights in bf16, random; greedy decoding of `--new` tokens after a `--prompt`-token prompt per
sequence (every sequence its own prompt, all in flight at once). Decode tokens/s counts the new
tokens over the time after the last prefill, less the time spent capturing CUDA graphs (once per
shape per engine, in the first decode steps here; printed beside it, with the rate including it).
The bound: every decode step reads all weights once
(at 64+ sequences nearly every expert is routed to) plus each sequence's KDA state and MLA keys,
at the GPU's device-to-device copy rate, measured at the start (the H200's: 4.3 TB/s, KINDS.md;
an H100's about 3.0; `--bandwidth` sets it)."""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import contextlib
import gc
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import log, write_json  # noqa: E402

BANDWIDTH = 4.3e12  # the H200's copy rate (KINDS.md): the bound's bandwidth where none is measured (CPU smoke runs)


class Mode(NamedTuple):
    """How a size is decoded: `decode`'s switches, in its argument order."""
    graphs: bool
    overlap: bool
    compile: bool
    small_m: bool  # decode batches' experts on the small-M kernels (else CUTLASS's grouped GEMM)
    mla_kernel: bool = True  # MLA's absorbed decode attention on kimi_kernels/mla_decode.py (else the fp32 reference)
    paged_keys: bool = True  # that kernel reads the paged cache's keys in place (else gathered into [B, S] first)


MODES = {"eager": Mode(False, False, False, True), "CUDA graphs": Mode(True, False, False, True),
         "graphs + overlap": Mode(True, True, False, True), "compiled": Mode(True, True, True, True),
         "compiled, grouped GEMM": Mode(True, True, True, False),
         "graphs + overlap, fp32 MLA attention": Mode(True, True, False, True, False),
         "graphs + overlap, gathered MLA keys": Mode(True, True, False, True, True, False)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(preset: str, device: str, dtype: torch.dtype):
    from policy import build_model
    from policy.dtypes import params_to

    with torch.device(device):
        if preset == "kimi-linear-4l":
            model = build_model("kimi-linear-48b", num_hidden_layers=4, num_experts=64)
        else:
            model = build_model(preset)
    return params_to(model, dtype).eval()


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """This GPU's device-to-device copy rate in bytes/s, counting bytes read and written (KINDS.md's
    measure: about 4.3e12 on an H200, 3.0e12 on an H100): the ceiling a memory-bound step can reach."""
    if device != "cuda":
        return BANDWIDTH
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)


def bound_tok_s(model, seqs: int, context: int, bandwidth: float = BANDWIDTH) -> float:
    from policy.slot_cache import SlotCache

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg, dtype = model.config, model.lm_head.weight.dtype
    state = seqs * (SlotCache.bytes_per_slot(cfg, dtype) + context * SlotCache.bytes_per_token(cfg, dtype))
    return seqs * bandwidth / (weights + state)


def prompts_for(seqs: int, prompt: int, vocab: int) -> list[list[int]]:
    """Every sequence's own random prompt, the same in every mode and engine."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (prompt,), generator=gen).tolist() for _ in range(seqs)]


def transformers_twin(model):
    """transformers' KimiLinearForCausalLM with `model`'s shapes, dtype and device (its own random
    weights: a decode rate does not depend on their values). Refuses a preset it cannot express (DSA,
    AttnRes, LatentMoE, SiTU-GLU: its parameter count would differ)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear

    from policy.checkpoint import text_config_dict

    # its prefill is left out of the rate, and fla's chunk kernel would autotune for minutes first:
    # prefill on transformers' own torch path (decode steps keep fla's recurrent kernel)
    chunk = modeling_kimi_linear.chunk_kimi_delta_attention
    modeling_kimi_linear.chunk_kimi_delta_attention = getattr(chunk, "__wrapped__", chunk)
    cfg = model.config
    beyond = [name for name, used in (("DSA", "dsa" in cfg.layer_types), ("AttnRes", cfg.attn_res),
                                      ("LatentMoE", cfg.routed_expert_hidden_size is not None),
                                      (cfg.hidden_act, cfg.hidden_act != "silu")) if used]
    if beyond:
        raise SystemExit(f"transformers' KimiLinear cannot express {cfg.name}: it has no {', '.join(beyond)}")
    weight = model.lm_head.weight
    with torch.device(weight.device):
        twin = KimiLinearForCausalLM(KimiLinearConfig(**text_config_dict(model.config))).to(weight.dtype).eval()
    ours, theirs = (sum(p.numel() for p in m.parameters()) for m in (model, twin))
    if ours != theirs:
        raise SystemExit(f"transformers' KimiLinear cannot express {model.config.name}: {theirs:,} parameters "
                         f"where ours has {ours:,}")
    return twin


def transformers_rows(model, sizes: list[int], prompt: int, new: int, vocab: int) -> dict[int, dict]:
    """`transformers_decode` at each size on `model`'s twin (a size that runs out of memory is said
    and left out); the twin's memory is given back afterwards."""
    twin = transformers_twin(model)
    rows = {}
    for n in sizes:
        try:
            rows[n] = transformers_decode(twin, n, prompt, new, vocab)
        except torch.OutOfMemoryError as exc:
            log(f"{n} sequences, transformers generate: out of memory ({str(exc).splitlines()[0]})")
            continue
        log(f"{n} sequences, transformers generate: decode {rows[n]['decode_tok_s']:.0f} tok/s, step "
            f"{rows[n]['step_ms']:.2f} ms, prefill {rows[n]['prefill_s']:.2f} s")
    del twin
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def transformers_decode(twin, seqs: int, prompt: int, new: int, vocab: int) -> dict:
    """`generate`'s decode rate: `new` more tokens per sequence over the time they add to a 1-token
    generate of the same prompts (greedy, every sequence `new` tokens: no stop)."""
    device = twin.lm_head.weight.device
    ids = torch.tensor(prompts_for(seqs, prompt, vocab), device=device)

    def timed(tokens: int) -> float:
        sync()
        started = time.perf_counter()
        with torch.no_grad():
            twin.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                          do_sample=False, use_cache=True, pad_token_id=0)
        sync()
        return time.perf_counter() - started

    timed(2)  # first launches at these shapes
    prefill_s = timed(1)
    decode_s = timed(new + 1) - prefill_s
    return {"sequences": seqs, "engine": "transformers", "decode_s": decode_s, "prefill_s": prefill_s,
            "decode_tok_s": seqs * new / decode_s, "step_ms": decode_s / new * 1e3}


def decode(model, seqs: int, prompt: int, new: int, vocab: int, graphs: bool, overlap: bool = False,
           compile: bool = False, small_m: bool = True, mla_kernel: bool = True, paged_keys: bool = True,
           chunk: int = 8192, around_decode=contextlib.nullcontext,
           host_profile: cProfile.Profile | None = None, after_step=None) -> dict:
    """`small_m`: a decode batch's routed experts on the small-M Triton kernels (else CUTLASS's grouped
    GEMM, as a prefill's); `mla_kernel`: MLA's absorbed decode attention on kimi_kernels/mla_decode.py
    (else the fp32 reference); `paged_keys`: that kernel reads the keys in the cache's blocks (else
    gathered into [B, S] first); `around_decode`: a context manager (factory) the decode phase runs in,
    after the prefills;
    `host_profile`: profiles the engine's steps (its own thread) during the decode phase;
    `after_step`: called after each of the engine's steps of the decode phase."""
    from rl.rollout.engine_api import SamplingParams
    from rl.rollout.native_engine import NativeEngine

    engine = NativeEngine(model, max_slots=seqs, cache_tokens=seqs * (prompt + new + 64), max_batch_tokens=chunk,
                          record_routing=False, decode_graphs=graphs, overlap=overlap, compile_decode=compile)
    engine.version = 0
    prompts = prompts_for(seqs, prompt, vocab)
    tokens: dict[int, list[int]] = {}

    async def first(i: int) -> None:  # the prompt, and one token: the decode phase starts after it
        await engine.start_group([f"s{i}"], prompts[i])
        await engine.generate(f"s{i}", [], SamplingParams(max_new_tokens=1, temperature=0.0, seed=0))

    async def rest(i: int) -> None:
        out = await engine.generate(f"s{i}", [], SamplingParams(max_new_tokens=new, temperature=0.0, seed=0))
        assert len(out.tokens) == new
        tokens[i] = out.tokens
        await engine.finish(f"s{i}")

    async def run() -> float:
        await asyncio.gather(*[first(i) for i in range(seqs)])
        sync()
        if host_profile is not None:
            step = engine._step

            def profiled_step() -> bool:
                host_profile.enable()
                try:
                    return step()
                finally:
                    host_profile.disable()

            engine._step = profiled_step
        if after_step is not None:
            inner = engine._step

            def hooked_step() -> bool:
                try:
                    return inner()
                finally:
                    after_step()

            engine._step = hooked_step
        with around_decode():
            phases.clear()
            started = time.perf_counter()
            await asyncio.gather(*[rest(i) for i in range(seqs)])
            sync()
        return time.perf_counter() - started

    from policy.layers import mla, moe

    small_m_before, mla_before = moe.set_small_m(small_m), mla.set_decode_kernel(mla_kernel)
    paged_before = mla.set_paged_keys(paged_keys)
    try:
        with host_phases(engine) as phases, gpu_timeline(engine) as timeline:
            wall_s = asyncio.run(run())
    finally:
        moe.set_small_m(small_m_before)
        mla.set_decode_kernel(mla_before)
        mla.set_paged_keys(paged_before)
    # graphs are captured once per shape per engine (here, in the decode phase's first steps; compiling
    # the step, when compiled, is part of it): the steady rate leaves that time out, which a run's
    # thousands of steps amortise
    capture_s = engine.stats().extra.get("graph_capture_s", 0.0)
    decode_s = wall_s - capture_s
    replay_ms = replay_alone_ms(engine) if graphs else None
    return {"sequences": seqs, "graphs": graphs, "overlap": overlap, "compiled": compile, "small_m": small_m,
            "decode_s": decode_s, "capture_s": capture_s, "decode_tok_s": seqs * new / decode_s,
            "step_ms": decode_s / new * 1e3, "replay_ms": replay_ms,
            "graphs_captured": engine.stats().extra.get("graphs_captured", 0.0),
            "host_ms": {k: v / new * 1e3 for k, v in phases.items()}, "gpu_ms": timeline,
            "wall_tok_s": seqs * new / wall_s,
            "capture_error": engine.graph_capture_error,
            "tokens": [tokens[i] for i in range(seqs)]}


@contextlib.contextmanager
def host_phases(engine):
    """Seconds the engine's thread spends in each part of its steps: launching, reading back (and
    of that, waiting on the GPU), and the rest of the wall time between steps (the event loop's
    hand-offs, requests). Summed from the last `phases.clear()` (the decode phase's start)."""
    phases = dict.fromkeys(("launch", "read_back", "gpu_wait", "between_steps"), 0.0)
    launch, resolve, step, feed, sample = engine._launch, engine._resolve, engine._step, engine._feed, engine._sample
    event_sync = torch.cuda.Event.synchronize if torch.cuda.is_available() else None
    last_end = [None]

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    def timed_step():
        t = time.perf_counter()
        if last_end[0] is not None and "launch" in phases:  # (not the first step after a clear)
            phases["between_steps"] = phases.get("between_steps", 0.0) + t - last_end[0]
        try:
            return step()
        finally:
            last_end[0] = time.perf_counter()
            phases["in_steps"] = phases.get("in_steps", 0.0) + last_end[0] - t

    engine._launch, engine._resolve, engine._step = timed("launch", launch), timed("read_back", resolve), timed_step
    engine._feed, engine._sample = timed("launch:feed", feed), timed("launch:sample", sample)
    graphs = engine._graphs
    if graphs is not None:
        fill, replay = graphs._fill, graphs._replay
        graphs._fill, graphs._replay = timed("feed:fill", fill), timed("feed:replay", replay)
    if event_sync is not None:
        torch.cuda.Event.synchronize = timed("gpu_wait", event_sync)
    try:
        yield phases
    finally:
        engine._launch, engine._resolve, engine._step, engine._feed, engine._sample = launch, resolve, step, feed, sample
        if graphs is not None:
            graphs._fill, graphs._replay = fill, replay
        if event_sync is not None:
            torch.cuda.Event.synchronize = event_sync


@contextlib.contextmanager
def gpu_timeline(engine):
    """Where the GPU's time goes between the engine's steps: CUDA events recorded as each step
    starts launching, around its graph replay, and after its last op. Yields a dict of mean ms per
    step once the block ends: `before_replay` (the step's inputs copied, and the GPU idle while the
    host gets to the replay), `replay` (the graph), `after_replay` (sampling, copies back) and
    `idle_between` (nothing queued between two steps)."""
    means: dict[str, float] = {}
    graphs = engine._graphs
    if not torch.cuda.is_available() or graphs is None or not graphs.use_graphs:
        yield means
        return
    marks: list[tuple[str, torch.cuda.Event]] = []
    launch, replay = engine._launch, graphs._replay

    def mark(name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, event))

    def marked_launch(*a, **kw):
        mark("start")
        try:
            return launch(*a, **kw)
        finally:
            mark("end")

    def marked_replay(*a, **kw):
        before = graphs.captured
        mark("replay")
        replay(*a, **kw)
        mark("replayed")
        if graphs.captured != before:  # a capture, not a decode step: left out of the spans
            marks[-2:] = [("capture", marks[-2][1]), ("captured", marks[-1][1])]

    engine._launch, graphs._replay = marked_launch, marked_replay
    try:
        yield means
    finally:
        engine._launch, graphs._replay = launch, replay
    torch.cuda.synchronize()
    spans = {"before_replay": [], "replay": [], "after_replay": [], "idle_between": []}
    after = {"start": "before_replay", "replay": "replay", "replayed": "after_replay", "end": "idle_between"}
    for (name, a), (next_name, b) in zip(marks, marks[1:]):
        if (name, next_name) in (("start", "replay"), ("replay", "replayed"), ("replayed", "end"), ("end", "start")):
            spans[after[name]].append(a.elapsed_time(b))
    means.update({k: sum(v) / len(v) for k, v in spans.items() if v})


_PROFILED_MODULES = ("KDAMixer", "MLAMixer", "LatentMoE", "StackedExperts", "Router", "GatedMLP", "AttnRes",
                     "RMSNorm", "LMHead")


def replay_alone_ms(engine, repeats: int = 20) -> dict | None:
    """The widest captured graph replayed on its own (after the run: it rewrites the last step's
    slots): `gpu` ms per replay back to back (the GPU's time for a decode step; the engine's step
    beyond it is the host's share), `host_call` ms the replay call itself takes on the host, and
    `single` ms from calling one replay on an idle GPU to its end (above `gpu` by how long the GPU
    waits for the launch)."""
    graphs = engine._graphs._graphs if engine._graphs is not None else {}
    if not graphs or not torch.cuda.is_available():
        return None
    graph = graphs[max(graphs)]  # (batch, width, keys): the largest decode batch (widths are 1 here)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        graph.replay()
        host += time.perf_counter() - t
    end.record()
    sync()
    singles = []
    for _ in range(5):
        t = time.perf_counter()
        graph.replay()
        sync()
        singles.append(time.perf_counter() - t)
    return {"gpu": start.elapsed_time(end) / repeats, "host_call": host / repeats * 1e3,
            "single": min(singles) * 1e3}


def trace_decode(model, seqs: int, prompt: int, new: int, vocab: int, path: str, compile: bool = False) -> str:
    """A few overlapped graph decode steps (`compile`: of the compiled step) under torch.profiler
    (every thread), written as a Chrome trace to `path`, and summed up: per cudaGraphLaunch, how long the host call took, how long after
    it started the graph's first kernel ran, and the graph's span on the GPU."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   experimental_config=_ExperimentalConfig(profile_all_threads=True))
    # started and stopped in the engine's thread, after the first steps (they capture the graphs,
    # a shape each) and before the last (a profiler stepped from that thread and left from the main
    # one failed on the H200: "Expected record to be set")
    first, last, steps = 6, new - 2, [0]

    def after_step() -> None:
        steps[0] += 1
        if steps[0] == first:
            prof.start()
        elif steps[0] == last:
            prof.stop()
            prof.export_chrome_trace(path)

    decode(model, seqs, prompt, new, vocab, graphs=True, overlap=True, compile=compile, after_step=after_step)
    events = json.load(open(path))["traceEvents"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {})}
    kernels: dict[int, list[dict]] = {}
    for e in events:
        if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launches:
            kernels.setdefault(e["args"]["correlation"], []).append(e)
    rows = []
    for corr, launch in sorted(launches.items(), key=lambda kv: kv[1]["ts"]):
        ks = kernels.get(corr)
        if not ks:
            continue
        first, last = min(k["ts"] for k in ks), max(k["ts"] + k["dur"] for k in ks)
        busy = sum(k["dur"] for k in ks)
        rows.append((launch["dur"], first - launch["ts"], last - first, busy, len(ks)))
    if not rows:
        return "no graph launches with kernels in the trace"
    n = len(rows)
    mean = [sum(r[i] for r in rows) / n / 1e3 for i in range(4)]
    by_name: dict[str, list[float]] = {}
    for ks in kernels.values():
        for k in ks:
            by_name.setdefault(k["name"][:90], []).append(k["dur"])
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    lines = [f"{sum(d) / n / 1e3:8.3f} ms/step {len(d) / n:6.1f}/step  {name}" for name, d in top]
    return (f"{n} graph launches, {rows[0][4]} kernels each: host call {mean[0]:.2f} ms, first kernel "
            f"{mean[1]:.2f} ms after the call began, GPU span {mean[2]:.2f} ms, kernels busy {mean[3]:.2f} ms\n"
            + "\n".join(lines))


def profile_decode(model, seqs: int, prompt: int, new: int, vocab: int, rows: int = 40) -> str:
    """Where an eager decode's GPU time goes: one decode of `new` tokens per sequence under
    torch.profiler (every thread: the engine runs the model in its own), the model's main modules
    marked as ranges (their CUDA total includes their kernels), then the ops by their own CUDA time.
    The graphs replay the same kernels without the launches."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile, record_function

    ranges: dict[int, record_function] = {}

    def enter(module, _args):
        ranges[id(module)] = record_function(f"## {type(module).__name__}")
        ranges[id(module)].__enter__()

    def leave(module, _args, _out):
        ranges.pop(id(module)).__exit__(None, None, None)

    hooks = [h for m in model.modules() if type(m).__name__ in _PROFILED_MODULES
             for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       experimental_config=_ExperimentalConfig(profile_all_threads=True))
        decode(model, seqs, prompt, new, vocab, graphs=False, around_decode=lambda: prof)
    finally:
        for h in hooks:
            h.remove()
    events = prof.key_averages()
    steps = new  # one decode step per new token: every sequence in each step's batch
    modules = sorted((e for e in events if e.key.startswith("## ")), key=lambda e: -e.device_time_total)
    lines = [f"{'module':<24} {'CUDA ms/step':>12} {'CPU ms/step':>11} {'calls/step':>10}"]
    lines += [f"{e.key[3:]:<24} {e.device_time_total / 1e3 / steps:>12.3f} {e.cpu_time_total / 1e3 / steps:>11.3f} "
              f"{e.count / steps:>10.1f}" for e in modules]
    total = sum(e.self_device_time_total for e in events) / 1e3 / steps
    lines.append(f"all kernels: {total:.3f} CUDA ms per decode step ({steps} steps)")
    return "\n".join(lines) + "\n" + events.table(sort_by="self_cuda_time_total", row_limit=rows,
                                                  max_name_column_width=70)


def profile_host(model, seqs: int, prompt: int, new: int, vocab: int, rows: int = 25) -> str:
    """Where the host's time goes in an overlapped CUDA-graph decode: the engine's steps under
    cProfile (functions by their cumulative time; a GPU wait shows as the call that blocks on it)."""
    prof = cProfile.Profile()
    decode(model, seqs, prompt, new, vocab, graphs=True, overlap=True, host_profile=prof)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def long_context(model, tokens: int, new: int, chunk: int, vocab: int) -> dict:
    """One sequence: a `tokens`-token prompt prefilled in chunks, then `new` tokens decoded."""
    from rl.rollout.engine_api import SamplingParams
    from rl.rollout.native_engine import NativeEngine

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    engine = NativeEngine(model, max_slots=1, cache_tokens=tokens + new + 64, max_batch_tokens=chunk,
                          record_routing=False)
    engine.version = 0
    prompt = torch.randint(10, vocab, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    times: dict[str, float] = {}

    async def run() -> None:
        t0 = time.perf_counter()
        await engine.start_group(["long"], prompt)
        first = await engine.generate("long", [], SamplingParams(max_new_tokens=1, temperature=0.0, seed=0))
        sync()
        times["prefill_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = await engine.generate("long", [], SamplingParams(max_new_tokens=new, temperature=0.0, seed=0))
        sync()
        times["decode_s"] = time.perf_counter() - t1
        assert len(first.tokens) == 1 and len(out.tokens) == new
        await engine.finish("long")

    asyncio.run(run())
    return {"context": tokens, "chunk": chunk, **times, "decode_tok_s": new / times["decode_s"],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan"),
            "cache_gib": engine.cache.nbytes / 2**30}


def _divergence(a: list[list[int]], b: list[list[int]]) -> str:
    """Where the sequences that differ first differ (bf16 greedy decoding of random weights drifts
    apart after some tokens when two paths round differently; a broken path differs at once)."""
    firsts = sorted(next(i for i, (x, y) in enumerate(zip(s, t)) if x != y) for s, t in zip(a, b) if s != t)
    if not firsts:
        return ""
    return f"; the others first differ at token {firsts[0]} (earliest), {firsts[len(firsts) // 2]} (median)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--long-context", type=int, default=0, help="then one sequence with this many prompt tokens")
    parser.add_argument("--chunk", type=int, default=8192, help="prefill tokens per forward")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="the decode modes to run, each size; the first is the one the others are compared with")
    parser.add_argument("--repeat-first", "--repeat-eager", dest="repeat_first", action="store_true",
                        help="a second run of the first mode (eager by default), to compare tokens with")
    parser.add_argument("--transformers", action="store_true",
                        help="also transformers' KimiLinearForCausalLM.generate on a model of the same shapes")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (graphs run eagerly)")
    parser.add_argument("--dtype", default="bfloat16", help="float32: graph and eager tokens compared at full precision")
    parser.add_argument("--profile", action="store_true",
                        help="then a profiled eager decode (GPU time by module and op) and graph decode (host time)")
    parser.add_argument("--trace", default=None, help="then a Chrome trace of 8 overlapped graph decode steps (of "
                        "the compiled step among --modes), written here")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="bytes/s for the bound (default: this GPU's copy rate, measured at the start)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = build(args.preset, args.device, getattr(torch, args.dtype))
    vocab = model.config.vocab_size
    bandwidth = args.bandwidth or copy_bandwidth(args.device)
    card = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    log(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {args.dtype}; {card}, "
        f"bound at {bandwidth / 1e12:.2f} TB/s ("
        + ("given" if args.bandwidth else "its device-to-device copy, measured" if args.device == "cuda"
           else "the H200's copy rate, not measured on a CPU") + ")")
    # transformers first, every size, while no engine of ours holds memory (its torch prefill of 256
    # prompts takes tens of GiB); then its model is dropped
    generate_rates = transformers_rows(model, args.seqs, args.prompt, args.new, vocab) if args.transformers else {}
    modes = {name: MODES[name] for name in args.modes}
    for mode in modes.values():  # warm-up: first launches, allocator, compiling
        decode(model, 4, 16, 8, vocab, *mode)
    results = {"args": vars(args), "card": card, "bandwidth": bandwidth, "rows": []}
    for n in args.seqs:
        runs = {}
        for mode, flags in modes.items():
            row = decode(model, n, args.prompt, args.new, vocab, *flags)
            row["bound_tok_s"] = bound_tok_s(model, n, args.prompt + args.new // 2, bandwidth)
            row["fraction_of_bound"] = row["decode_tok_s"] / row["bound_tok_s"]
            runs[mode] = row
            log(f"{n} sequences, {mode}: decode {row['decode_tok_s']:.0f} tok/s, "
                f"bound {row['bound_tok_s']:.0f} tok/s, {row['fraction_of_bound']:.1%} of it; "
                f"{row['graphs_captured']:.0f} graphs captured in {row['capture_s']:.2f} s (left out; "
                f"{row['wall_tok_s']:.0f} tok/s with it); step {row['step_ms']:.2f} ms"
                + (" (graph replay alone: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row["replay_ms"].items()) + ")"
                   if row["replay_ms"] else "")
                + "; host ms/step: " + ", ".join(f"{k} {v:.2f}" for k, v in row["host_ms"].items())
                + ("; GPU ms/step: " + ", ".join(f"{k} {v:.2f}" for k, v in row["gpu_ms"].items())
                   if row["gpu_ms"] else "")
                + (f"; CAPTURE FAILED: {row['capture_error']}" if row["capture_error"] else ""))
        first = next(iter(runs))  # the rates and tokens of the others are given beside the first mode's
        # bf16 kernels with atomics (the MoE combine's index_add_) are not bitwise repeatable: a second run
        # of one mode says how often greedy decoding of random weights diverges between two runs of one path
        again = decode(model, n, args.prompt, args.new, vocab, *modes[first])["tokens"] if args.repeat_first else None
        tokens = {mode: row.pop("tokens") for mode, row in runs.items()}
        same = {mode: sum(a == b for a, b in zip(tokens[first], t)) for mode, t in tokens.items()}
        for mode, row in runs.items():
            row[f"same_tokens_as_{first}"] = same[mode] / n
        results["rows"] += list(runs.values())
        base = runs[first]["decode_tok_s"]
        log(f"{n} sequences, beside {first}: "
            + ", ".join(f"{mode} {row['decode_tok_s'] / base:.2f}x (greedy tokens the same for {same[mode]} of {n}"
                        + _divergence(tokens[first], tokens[mode]) + ")"
                        for mode, row in runs.items() if mode != first)
            + (f"; {first} again: the same for {sum(a == b for a, b in zip(tokens[first], again))} of {n}"
               if again else ""))
        hf = generate_rates.get(n)
        if hf is not None:
            hf["bound_tok_s"] = runs[first]["bound_tok_s"]
            hf["fraction_of_bound"] = hf["decode_tok_s"] / hf["bound_tok_s"]
            results["rows"].append(hf)
            log(f"{n} sequences, beside transformers generate ({hf['decode_tok_s']:.0f} tok/s, "
                f"{hf['fraction_of_bound']:.1%} of the bound): "
                + ", ".join(f"{mode} {row['decode_tok_s'] / hf['decode_tok_s']:.1f}x" for mode, row in runs.items()))
        write_json(results, args.json)
    if args.profile:
        log(f"profile of an eager decode at {args.seqs[0]} sequences, {args.prompt}-token prompts:\n"
            + profile_decode(model, args.seqs[0], args.prompt, args.new, vocab))
    if args.profile:
        log(f"host profile of a CUDA-graph decode at {args.seqs[0]} sequences:\n"
            + profile_host(model, args.seqs[0], args.prompt, args.new, vocab))
    if args.trace:
        compiled = "compiled" in modes
        log(f"trace of an overlapped graph decode{' (compiled)' if compiled else ''} at {args.seqs[0]} sequences "
            f"({args.trace}): " + trace_decode(model, args.seqs[0], args.prompt, 16, vocab, args.trace, compiled))
    if args.long_context:
        row = long_context(model, args.long_context, args.new, args.chunk, vocab)
        results["long_context"] = row
        log(f"one {row['context']}-token prompt: prefill {row['prefill_s']:.1f} s in {row['chunk']}-token chunks, "
            f"then {row['decode_tok_s']:.1f} tok/s decode; cache {row['cache_gib']:.2f} GiB, "
            f"peak {row['peak_gib']:.1f} GiB")
        write_json(results, args.json)


if __name__ == "__main__":
    main()
