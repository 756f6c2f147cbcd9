"""The native rollout engine: continuous batching, forked group prefill, slot reuse, preemption and
long episodes give the tokens and logprobs that one-at-a-time generation and a full learner forward
give."""
from __future__ import annotations

import asyncio
import copy
import zlib

import pytest
import torch

from policy import build_model
from policy.slot_cache import SlotCache
from rl.config import RolloutConfig
from rl.rollout.cache_budget import DEFAULT_CACHE_TOKENS, engine_cache_tokens
from rl.rollout import decode_graphs
from rl.rollout.engine_api import SamplingParams, TurnOutput
from rl.rollout.native_engine import NativeEngine
from rl.rollout.worker import build_engine
from rl.rollout.sampling import processed_logprobs, sample_tokens, uniform_noise

STOP = 7


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("toy", vocab_size=300).eval()


def engine(model, **kw) -> NativeEngine:
    e = NativeEngine(model, **kw)
    e.version = 3
    return e


def params(seed: int, greedy: bool = False, n: int = 6) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0 if greedy else 1.0, stop_ids=frozenset({STOP}), seed=seed)


def tool_result(member: int, turn: int) -> list[int]:
    return [] if turn == 0 else list(range(20, 20 + 2 + 3 * member + turn))  # lengths differ by member


async def play(eng: NativeEngine, groups: dict[str, tuple[list[int], list[int]]], turns: int = 3,
               greedy: bool = False, n: int = 6) -> dict[str, list]:
    """Each group: one prompt and the members to play; each member plays `turns` turns with tool
    results between them, drawing from a stream fixed by (group, member)."""
    out: dict[str, list] = {}

    async def member(gid: str, m: int) -> None:
        sid, record = f"{gid}/{m}", []
        for t in range(turns):
            o = await eng.generate(sid, tool_result(m, t), params(zlib.crc32(gid.encode()) * 10 + m, greedy, n))
            record.append((o.tokens, o.logprobs, o.versions))
        out[sid] = record + [await eng.finish(sid)]

    async def group(gid: str, prompt: list[int], members: list[int]) -> None:
        await eng.start_group([f"{gid}/{m}" for m in members], prompt)
        await asyncio.gather(*[member(gid, m) for m in members])

    await asyncio.gather(*[group(g, p, ms) for g, (p, ms) in groups.items()])
    return out


def prompts(n_groups: int, size: int = 3) -> dict[str, tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(5)
    return {f"g{k}": (torch.randint(10, 300, (4 + 5 * k,), generator=gen).tolist(), list(range(size)))
            for k in range(n_groups)}


def tokens_of(result: dict[str, list]) -> dict[str, list[list[int]]]:
    return {sid: [turn[0] for turn in rec[:-1]] for sid, rec in result.items()}


def prompts_of_3_to_127_tokens() -> dict[str, tuple[list[int], list[int]]]:
    """Five groups of three, prompts of 3, 34, 65, 96 and 127 tokens."""
    gen = torch.Generator().manual_seed(9)
    return {f"g{k}": (torch.randint(10, 300, (3 + 31 * k,), generator=gen).tolist(), list(range(3)))
            for k in range(5)}


def assert_same_turns(a: dict[str, list], b: dict[str, list], routing: bool = True) -> None:
    """Two engines' plays of the same groups: the same tokens, logprobs to 1e-4 and (if asked) routing."""
    assert tokens_of(a) == tokens_of(b)
    for sid in a:
        for x, y in zip(a[sid][:-1], b[sid][:-1]):
            torch.testing.assert_close(torch.tensor(x[1]), torch.tensor(y[1]), atol=1e-4, rtol=0)
        if routing:
            assert (a[sid][-1].routing == b[sid][-1].routing).all()


@pytest.mark.parametrize("greedy", [True, False])
def test_continuous_batching_equals_one_sequence_at_a_time(model, greedy):
    groups = prompts(4)
    together = asyncio.run(play(engine(model, max_slots=16, cache_tokens=4096), groups, greedy=greedy))
    alone = {}
    for gid, (prompt, members) in groups.items():  # one member at a time, in a fresh engine
        for m in members:
            alone.update(asyncio.run(play(engine(model, max_slots=2, cache_tokens=1024), {gid: (prompt, [m])},
                                          greedy=greedy)))
    assert tokens_of(together) == tokens_of(alone)
    for sid in together:
        for a, b in zip(together[sid][:-1], alone[sid][:-1]):
            torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), atol=1e-4, rtol=0)
            assert a[2] == [3] * len(a[0])  # every token records the weights that drew it


@pytest.mark.parametrize("greedy", [True, False])
def test_the_fixed_shape_decode_step_equals_the_general_forward(model, greedy):
    """What the CUDA graphs replay (rl/rollout/decode_graphs.py), run eagerly: batches padded to a
    bucket with the scratch slot, past keys padded to a power of two (to 128, then 256 here), the
    same tokens, logprobs and routing as the engine's variable-shape forward."""
    groups = prompts_of_3_to_127_tokens()  # 15 sequences in flight: a batch of 16 (one padding row), then fewer
    general = engine(model, max_slots=16, cache_tokens=4096, decode_graphs=False)
    fixed = engine(model, max_slots=16, cache_tokens=4096, decode_graphs=True)
    a = asyncio.run(play(general, groups, greedy=greedy, n=10))
    b = asyncio.run(play(fixed, groups, greedy=greedy, n=10))
    assert_same_turns(a, b)
    shapes = set(fixed._graphs._buffers)  # (batch, tokens per row, past keys)
    assert (16, 1, 128) in shapes and (16, 1, 256) in shapes, shapes  # 15 sequences in a batch of 16


# on a GPU greedy only: cuBLAS rounds by shape, so a sampled draw near a boundary may part
GREEDY_ON_CUDA = pytest.param(True, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a GPU"))


@pytest.mark.parametrize("greedy, device", [(True, "cpu"), (False, "cpu"), GREEDY_ON_CUDA])
def test_short_prefills_through_the_fixed_shape_step_equal_the_general_forward(model, greedy, device):
    """prefill_graph_tokens: inputs of up to 40 tokens (tool results of 3-10, prompts of 3 and 34)
    prefilled by the fixed-shape step (what a CUDA graph replays), padded to 16 / 32 / 64 tokens a
    row with padding rows on the scratch slot, beside longer prompts (65-127 tokens) in the general
    forward of the same launch: the same tokens, logprobs and routing as the general forward alone.
    On a GPU the step is captured and replayed as CUDA graphs (decoding in both engines)."""
    groups = prompts_of_3_to_127_tokens()
    model = copy.deepcopy(model).to(device)
    general = engine(model, max_slots=16, cache_tokens=4096, decode_graphs=True)
    fixed = engine(model, max_slots=16, cache_tokens=4096, decode_graphs=True, prefill_graph_tokens=40)
    a = asyncio.run(play(general, groups, greedy=greedy, n=10))
    b = asyncio.run(play(fixed, groups, greedy=greedy, n=10))
    assert_same_turns(a, b)
    assert fixed.stats().prefill_tokens == general.stats().prefill_tokens
    assert fixed._graphs.captured == (len(fixed._graphs._buffers) if device == "cuda" else 0)
    widths = {width for _, width, _ in fixed._graphs._buffers}
    assert widths == {1, 16, 64}, widths  # decode; tool results and the 3-token prompt; the 34-token prompt
    assert {width for _, width, _ in general._graphs._buffers} == {1}
    assert engine(model, decode_graphs=False, prefill_graph_tokens=40).prefill_graph_tokens == 0  # no step to run it
    # from a config: only under CUDA graphs (64 by default); a CPU's compiled fixed-shape step would pad for nothing
    assert RolloutConfig().prefill_graph_tokens == 64
    from_config = build_engine(TOY, RolloutConfig(prefill_graph_tokens=24, compile_decode=True), seed=0)
    assert from_config._graphs is not None and from_config.prefill_graph_tokens == 0
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        engine(model, decode_graphs=True, prefill_graph_tokens=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_prefill_graph_never_overwrites_the_decode_graphs_logits(model):
    """A launch replays a decode graph, then a prefill graph, then samples from both: the prefill's
    replay leaves the decode step's logits as they were, though the prefill graph was captured
    first (graphs sharing a memory pool may put one's outputs in the other's freed intermediates)."""
    eng = engine(copy.deepcopy(model).to("cuda"), max_slots=8, cache_tokens=2048, decode_graphs=True,
                 prefill_graph_tokens=40)
    graphs, cache = eng._graphs, eng.cache
    slots = [cache.alloc() for _ in range(8)]
    for slot in slots:
        cache.reserve(slot, 64)
    gen = torch.Generator().manual_seed(0)

    def inputs(n: int) -> list[list[int]]:
        return [torch.randint(10, 300, (n,), generator=gen).tolist() for _ in range(4)]

    graphs.step(slots[:4], inputs(12), [-1] * 4)  # the prefill graph, captured first
    for _ in range(2):
        decoded, _ = graphs.step(slots[:4], inputs(1), [-1] * 4)  # the decode graph: captured, then replayed
        expected = decoded.clone()
        graphs.step(slots[4:], inputs(12), [-1] * 4)  # the prefill graph replayed
        torch.testing.assert_close(decoded, expected, atol=0, rtol=0)
    assert graphs.captured == 2


def test_the_compiled_decode_step_equals_the_general_forward(model):
    """rollout.compile_decode: the fixed-shape step through torch.compile gives the same tokens and
    (to float32 rounding) logprobs as the engine's eager variable-shape forward, and is compiled
    whole (no graph break: the MoE layers' per-expert loop is one opaque op) and with symbolic sizes
    from the start: one graph for every batch of two or more rows and every key bucket, one for a
    batch of one."""
    from torch._dynamo.utils import counters

    groups = prompts(3)
    a = asyncio.run(play(engine(model, max_slots=16, cache_tokens=4096), groups, n=8))
    graphs_before = counters["stats"]["unique_graphs"]
    breaks_before = sum(counters["graph_break"].values())
    b = asyncio.run(play(engine(model, max_slots=16, cache_tokens=4096, compile_decode=True), groups, n=8))
    assert 1 <= counters["stats"]["unique_graphs"] - graphs_before <= 2
    assert sum(counters["graph_break"].values()) == breaks_before, dict(counters["graph_break"])
    assert_same_turns(a, b, routing=False)


@pytest.mark.parametrize("prefill_graph_tokens", [0, 40])
@pytest.mark.parametrize("failing", ["every capture", "the first capture"])
def test_a_failed_graph_capture_leaves_its_shape_eager(model, monkeypatch, prefill_graph_tokens, failing):
    """A capture that fails part-way, its inputs left pointing at the scratch slot (as when a stream
    left in a capture error cannot restore them), gives the eager engine's tokens: the step runs
    again on its real inputs. Its shape runs eagerly from then on; other shapes are still captured
    (on a CPU a stand-in replays the step eagerly) until MAX_CAPTURE_FAILURES captures have failed,
    and then every step runs eagerly."""
    e = engine(model, max_slots=16, cache_tokens=4096, decode_graphs=True, prefill_graph_tokens=prefill_graph_tokens)
    graphs = e._graphs
    graphs.use_graphs = True  # as on a GPU
    replayed: list[int] = []

    class CapturedOnCPU:
        def __init__(self, shape: tuple[int, int, int]) -> None:
            self.shape = shape

        def replay(self) -> None:
            replayed.append(self.shape)
            graphs._run(graphs._buffers[self.shape])

    def capture(buf, warm):
        if failing == "every capture" or graphs.capture_failures == 0:
            buf.column("slots").fill_(e.cache.scratch_slot)
            buf.column("lengths").fill_(0)
            buf.column("tables").fill_(0)
            buf.column("write_index").fill_(e.cache.num_blocks * e.cache.block_size)
            raise RuntimeError("\nCUDA error: operation not permitted when stream is capturing\nCompile with ...")
        return CapturedOnCPU(next(shape for shape, b in graphs._buffers.items() if b is buf))

    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(decode_graphs, "MAX_CAPTURE_FAILURES", 2)  # (this play has 3 or 4 shapes)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed .*not permitted.*eagerly"):
        got = asyncio.run(play(e, prompts_of_3_to_127_tokens(), greedy=True, n=10))
    reference = asyncio.run(play(engine(model, max_slots=16, cache_tokens=4096, decode_graphs=False),
                                 prompts_of_3_to_127_tokens(), greedy=True, n=10))
    assert tokens_of(got) == tokens_of(reference)
    shapes = set(graphs._buffers)
    assert len(shapes) > 2, shapes
    error = "RuntimeError: CUDA error: operation not permitted when stream is capturing Compile with ..."
    if failing == "every capture":
        assert graphs.capture_failures == 2 and not graphs.use_graphs and not replayed
        eager = "every step runs eagerly"
    else:  # one shape eager, every other one replayed
        assert graphs.capture_failures == 1 and graphs.use_graphs
        assert set(replayed) == shapes - graphs._eager and len(graphs._eager) == 1
        eager = "steps of those shapes run eagerly"
    assert e.stats().extra["graph_capture_failed"] == graphs.capture_failures
    # said whole, on one line, among the problems the trainer prints (a worker's own log is not shown)
    assert e.stats().problems == [f"CUDA graph capture failed {graphs.capture_failures} time(s), {eager}; "
                                  f"the last: {error}"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graphs_are_captured_again_after_the_cache_is_released(model):
    """A colocated run releases the engine's cache while the learner steps; the next group allocates
    it again at new addresses, and the graphs are captured again (in new pools, with no warm-up
    forwards: their shapes ran before) and give the same tokens as before the release."""
    e = engine(copy.deepcopy(model).to("cuda"), max_slots=4, cache_tokens=1024, decode_graphs=True,
               prefill_graph_tokens=40)
    first = asyncio.run(play(e, prompts(2), greedy=True))
    captured, addresses = e._graphs.captured, e.cache.tensor_ids()
    freed = asyncio.run(e.release_cache())
    assert captured >= 2 and freed > 0
    # what held the cache's memory before now holds this: the allocator cannot hand the same addresses
    # back (it may, and then the graphs are still good and kept, when nothing else took that memory)
    taken = torch.empty(freed, dtype=torch.uint8, device="cuda")
    forwards = []
    run = e._graphs._run
    e._graphs._run = lambda buf: forwards.append(buf) or run(buf)  # (replays run no forward)
    again = asyncio.run(play(e, prompts(2), greedy=True))
    assert e.cache.tensor_ids() != addresses and taken.numel() == freed
    assert e.graph_capture_error is None and e._graphs.captured == 2 * captured, e._graphs.captured
    assert len(forwards) == captured  # one captured forward a graph, none to warm up
    assert tokens_of(again) == tokens_of(first)


def test_forked_group_prefill_equals_separate_prefills(model):
    prompt = torch.randint(10, 300, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    e = engine(model, max_slots=8, cache_tokens=2048, block_size=16)
    forked = asyncio.run(play(e, {"g": (prompt, [0, 1, 2, 3])}, turns=2))
    tool_tokens = sum(len(tool_result(m, 1)) + 1 for m in range(4))
    assert e.stats().prefill_tokens == len(prompt) + tool_tokens  # the prompt went through the model once
    separate = {}
    for m in range(4):  # the same streams, each member's prompt prefilled on its own
        separate.update(asyncio.run(play(engine(model, max_slots=8, cache_tokens=2048, block_size=16),
                                         {"g": (prompt, [m])}, turns=2)))
    assert tokens_of(forked) == tokens_of(separate)


def test_slot_reuse_never_leaks_state(model):
    """A sequence in a slot another one used before behaves as in a fresh engine."""
    prompt_a = list(range(30, 90))
    prompt_b = list(range(100, 117))
    e = engine(model, max_slots=1, cache_tokens=256, block_size=8)
    asyncio.run(play(e, {"a": (prompt_a, [0])}, greedy=True))
    reused = asyncio.run(play(e, {"b": (prompt_b, [0])}, greedy=True))
    fresh = asyncio.run(play(engine(model, max_slots=1, cache_tokens=256, block_size=8), {"b": (prompt_b, [0])},
                             greedy=True))
    assert tokens_of(reused) == tokens_of(fresh)


def test_key_indices_from_block_tables_equal_the_host_built_ones(model):
    """What a fixed-shape step computes on the device from the block tables (past_from_tables) is
    the host's past_index / past_valid (indices) wherever a key is valid, and the same mask: slots of
    different lengths, one forked (shared blocks), one freed and taken again, padded key width."""
    cache = SlotCache(model, max_slots=4, num_blocks=64, block_size=4)
    a, b = cache.alloc(), cache.alloc()
    cache.reserve(a, 23)
    cache.advance([a], [23])
    cache.fork(a, b)
    cache.reserve(b, 30)
    cache.advance([b], [7])
    c = cache.alloc()
    cache.reserve(c, 9)
    cache.advance([c], [9])
    cache.free(c)
    c = cache.alloc()
    cache.reserve(c, 5)
    cache.advance([c], [5])
    slots, keys = [b, c, a], 64
    past_index, past_valid, _, _ = cache.indices(slots, [1, 1, 1], 1, keys)
    tables = torch.from_numpy(cache.block_tables(slots, keys // cache.block_size))
    lengths = torch.tensor([cache.lengths[s] for s in slots])
    index, valid = cache.past_from_tables(tables, lengths)
    assert torch.equal(valid, torch.from_numpy(past_valid)) and int(valid.sum()) == 30 + 5 + 23
    assert torch.equal(index[valid], torch.from_numpy(past_index)[valid])
    assert int(index.max()) < cache.num_blocks * cache.block_size


def test_preemption_when_the_cache_runs_out_gives_the_same_tokens(model):
    groups = prompts(3, size=2)
    roomy = asyncio.run(play(engine(model, max_slots=8, cache_tokens=4096), groups, greedy=True))
    tight = engine(model, max_slots=8, cache_tokens=112, block_size=8)  # a few sequences' worth at a time
    squeezed = asyncio.run(play(tight, groups, greedy=True))
    assert tight.stats().extra.get("preempted", 0) > 0
    assert tokens_of(squeezed) == tokens_of(roomy)


def assert_matches_learner_forward(model, result: dict[str, list], groups: dict, fed_beyond: tuple[int, ...]) -> None:
    """Each played sequence's sampled logprobs against a fresh learner forward over its tokens with
    the recorded routing replayed, and the recorded routing against the forward's own choice.
    fed_beyond: how many tokens past all but the last sampled one the engine may have fed."""
    for sid, rec in result.items():
        gid, m = sid.split("/")
        tokens, mask, logprobs = list(groups[gid][0]), [0] * len(groups[gid][0]), [0.0] * len(groups[gid][0])
        for t, (new, lps, _versions) in enumerate(rec[:-1]):
            append = tool_result(int(m), t)
            tokens += append + new
            mask += [0] * len(append) + [1] * len(new)
            logprobs += [0.0] * len(append) + lps
        record = rec[-1]
        assert record.fed_tokens in [len(tokens) - 1 + extra for extra in fed_beyond]
        routing = torch.full((1, len(tokens), *record.routing.shape[1:]), -1, dtype=torch.long)
        routing[0, :record.fed_tokens] = torch.from_numpy(record.routing.astype("int64"))
        with torch.no_grad():
            full = model(torch.tensor([tokens]), routing=routing, return_token_logprobs=True).token_logprobs[0]
            free = model(torch.tensor([tokens]), return_routing=True)
        real = torch.tensor(mask, dtype=torch.bool)
        gap = (full[real] - torch.tensor(logprobs)[real]).abs().max().item()
        assert gap < 2e-4, f"{sid}: train-vs-rollout logprob gap {gap}"
        assert torch.equal(free.routing[0, :record.fed_tokens], routing[0, :record.fed_tokens])


def test_logprobs_and_routing_match_a_fresh_learner_forward(model):
    e = engine(model, max_slots=8, cache_tokens=4096)
    result = asyncio.run(play(e, prompts(2), turns=3))
    assert_matches_learner_forward(model, result, prompts(2), fed_beyond=(0,))  # the last sampled token never fed


def test_long_episode_past_the_old_cap(model):
    """Thousands of tokens of tool output, prefilled in chunks, far past the old 512-token cap."""
    e = engine(model, max_slots=2, cache_tokens=8192, block_size=64, max_batch_tokens=512)

    async def long_episode():
        await e.start_group(["x"], list(range(10, 60)))
        total = 50
        for t in range(3):
            append = [] if t == 0 else [(11 * i + t) % 280 + 10 for i in range(1500)]
            o = await e.generate("x", append, params(seed=4, greedy=True, n=8))
            total += len(append) + len(o.tokens)
        return total, await e.finish("x")

    total, record = asyncio.run(long_episode())
    assert total > 3000 and record.fed_tokens == total - 1


def test_a_sequence_larger_than_the_whole_cache_fails_its_turn_clearly(model):
    e = engine(model, max_slots=2, cache_tokens=64, block_size=16)

    async def too_long():
        await e.start_group(["x"], list(range(10, 200)))
        await e.generate("x", [], params(seed=1))

    with pytest.raises(RuntimeError, match="needs 190 tokens of cache"):
        asyncio.run(too_long())


def test_a_failed_step_with_no_turn_in_flight_fails_the_next_turns():
    """A group's prompt is prefilled before any member asks for a turn. If that forward fails, the
    members' caches are undefined: their next turns must fail with the step's error (it used to be
    dropped, and the turn ran on whatever the failed forward had left)."""
    torch.manual_seed(0)
    m = build_model("toy", vocab_size=300).eval()
    e = engine(m, max_slots=4, cache_tokens=256)
    real_forward, calls = m.forward, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device fault")
        return real_forward(*args, **kwargs)

    m.forward = fails_once

    async def member_turn():
        await e.start_group(["g/0", "g/1"], list(range(10, 30)))
        while not calls:  # the prefill forward has started (it holds the engine's lock until it ends)
            await asyncio.sleep(0.01)
        await e.generate("g/1", [], params(seed=1))

    with pytest.raises(RuntimeError, match="engine step failed: RuntimeError: device fault"):
        asyncio.run(member_turn())
    assert e.stats().extra["step_errors"] == 1


def test_a_model_without_global_layers_forks_its_group():
    """No MLA layer, so no key blocks: a fork copies only KDA state (it used to fail half-way, silently,
    and the member was prefilled again on top of the copied state)."""
    torch.manual_seed(0)
    kda_only = build_model("toy", vocab_size=300, layer_types=["kda"] * 4).eval()
    e = engine(kda_only, max_slots=4, cache_tokens=256)
    prompt = list(range(10, 50))  # 40 tokens: the last block is partly filled
    out = tokens_of(asyncio.run(play(e, {"g": (prompt, [0, 1])}, turns=1, greedy=True)))
    assert e.stats().prefill_tokens == len(prompt)
    assert out["g/0"] == out["g/1"]


TOY = {"preset": "toy", "overrides": {"vocab_size": 300}}


def budget_engine(cache_gib: float, max_context: int) -> NativeEngine:
    cfg = RolloutConfig(max_slots=8, groups_per_worker=2, group_size=4, max_context=max_context, cache_gib=cache_gib)
    e = build_engine(TOY, cfg, seed=0)
    e.version = 3
    return e


def test_a_cache_sized_by_a_budget_holds_what_the_arithmetic_says():
    # toy, float32: a slot is 3 KDA layers x (2x64x64 state x 4 B + 3 conv steps x 384 channels x 4 B) =
    # 112,128 B; a token 48 latent+rope x 4 B = 192 B, a 16-token block 3,072 B.
    # 0.01 GiB = 10,737,418 B: 8 slots and the scratch slot take 1,009,152 B, the scratch block 3,072 B,
    # leaving room for 3,165 blocks.
    e = budget_engine(0.01, max_context=512)
    cache = e.cache
    assert (cache.max_slots, cache.num_blocks, cache.block_size) == (8, 3165, 16)
    slot, token = (f(e.model.config, torch.float32) for f in (SlotCache.bytes_per_slot, SlotCache.bytes_per_token))
    assert (slot, token) == (112_128, 192)
    assert cache.nbytes == 9 * slot + 3166 * 16 * token  # the allocation is what the arithmetic counted
    assert cache.nbytes <= 10_737_418 < cache.nbytes + 16 * token


def test_a_budget_too_small_for_one_sequence_fails_the_build_in_one_line():
    with pytest.raises(ValueError, match=r"^rollout.cache_gib=0.001 \(1,073,741 bytes\) cannot hold "
                                         r"rollout.max_slots=8 slots \(112,128 bytes each\) plus one "
                                         r"rollout.max_context=1024-token sequence \(196,608 bytes\)[^\n]*$"):
        budget_engine(0.001, max_context=1024)


def test_generation_in_a_tight_budget_sized_cache_matches_a_roomy_one():
    # 0.000978 GiB = 1,050,125 B: 8 slots and 12 blocks (192 tokens) for six sequences of ~60 tokens,
    # beside the scratch slot and block
    tight = budget_engine(0.000978, max_context=64)
    assert tight.cache.num_blocks == 12
    groups = prompts(3, size=2)
    squeezed = asyncio.run(play(tight, groups, greedy=True))
    roomy = asyncio.run(play(engine(tight.model, max_slots=8, cache_tokens=4096), groups, greedy=True))
    assert tight.stats().extra.get("preempted", 0) > 0
    assert tokens_of(squeezed) == tokens_of(roomy)


def test_greedy_rows_draw_the_argmax_with_logprob_zero():
    """What the engine's all-greedy shortcut returns without drawing noise."""
    logits = torch.randn(4, 50)
    tokens, logp = sample_tokens(logits, torch.zeros(4), torch.ones(4), torch.arange(4), torch.zeros(4))
    assert tokens.tolist() == logits.argmax(-1).tolist() and logp.tolist() == [0.0] * 4


def test_sampling_depends_only_on_seed_and_position():
    logits = torch.randn(3, 50)
    temp, top_p = torch.ones(3), torch.ones(3)
    seeds, counters = torch.tensor([1, 2, 1]), torch.tensor([0, 0, 0])
    tokens, logp = sample_tokens(logits, temp, top_p, seeds, counters)
    for b in range(3):  # each row alone draws the same token
        t1, l1 = sample_tokens(logits[b:b + 1], temp[:1], top_p[:1], seeds[b:b + 1], counters[b:b + 1])
        assert t1.item() == tokens[b].item() and l1.item() == pytest.approx(logp[b].item())
    u = uniform_noise(torch.tensor([7]), torch.tensor([3]), 100_000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01


def test_sampling_follows_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20_000
    seeds = torch.arange(n)
    tokens, logp = sample_tokens(logits.expand(n, -1), torch.full((n,), 0.7), torch.ones(n), seeds, torch.zeros(n))
    expected = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tokens, minlength=4).double() / n
    torch.testing.assert_close(freq, expected.double(), atol=0.015, rtol=0)
    torch.testing.assert_close(logp, expected.log()[tokens])


def test_top_p_samples_only_from_the_nucleus_and_reports_its_logprob():
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]]).repeat(400, 1)
    tokens, logp = sample_tokens(logits, torch.ones(400), torch.full((400,), 0.7), torch.arange(400), torch.zeros(400))
    assert set(tokens.tolist()) <= {0, 1}
    nucleus = torch.softmax(torch.tensor([3.0, 2.0]), -1).log()
    torch.testing.assert_close(logp, nucleus[tokens])
    greedy, lp = sample_tokens(logits[:1], torch.zeros(1), torch.ones(1), torch.zeros(1), torch.zeros(1))
    assert greedy.item() == 0 and lp.item() == 0.0
    assert processed_logprobs(logits[:1], torch.ones(1), torch.full((1,), 0.7))[0, 2] == float("-inf")


def turn_with_weights_updated_mid_way(model, n: int, **engine_kw) -> TurnOutput:
    """One sequence's turn of n tokens (no stop) on a copy of `model` at version 3, weights
    perturbed to version 4 once 5 tokens are out."""
    import copy

    mine = copy.deepcopy(model)
    newer = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in mine.state_dict().items()}
    e = engine(mine, **engine_kw)

    async def run():
        await e.start_group(["s/0"], list(range(10, 20)))
        turn = asyncio.ensure_future(e.generate("s/0", [], SamplingParams(max_new_tokens=n, temperature=1.0,
                                                                          stop_ids=frozenset(), seed=1)))
        while e.stats().generated_tokens < 5:
            await asyncio.sleep(0.001)
        await e.update_weights(newer, version=4)
        out = await turn
        await e.finish("s/0")
        return out

    return asyncio.run(run())


def test_weights_updated_mid_turn_label_each_token_with_the_version_that_sampled_it(model):
    """Partial rollout: the turn goes on under the new weights; tokens before the update carry the
    old version, those after it the new one."""
    out = turn_with_weights_updated_mid_way(model, 300)
    assert out.versions == sorted(out.versions) and out.versions[0] == 3 and out.versions[-1] == 4
    assert 5 <= out.versions.count(3) < 300 and len(out.versions) == len(out.tokens) == 300


def test_a_token_sampled_from_prompt_logits_held_across_an_update_carries_their_version(model):
    """A group's prompt is prefilled once and its logits held for the members' first turns: a first
    token sampled from them after a weight update is the older weights' (it used to be labelled with
    the newer version, so staleness was under-counted by one)."""
    import copy

    mine = copy.deepcopy(model)
    e = engine(mine)

    async def run() -> list[TurnOutput]:
        await e.update_weights(mine.state_dict(), version=3)
        await e.start_group(["g/0", "g/1"], list(range(10, 20)))
        while any(e.seqs[f"g/{m}"].logits is None for m in range(2)):  # prefilled, forked, logits held
            await asyncio.sleep(0.001)
        await e.update_weights(mine.state_dict(), version=4)
        turns = [e.generate(f"g/{m}", [], SamplingParams(max_new_tokens=4, temperature=1.0, stop_ids=frozenset(),
                                                          seed=m)) for m in range(2)]
        outs = await asyncio.gather(*turns)
        for m in range(2):
            await e.finish(f"g/{m}")
        return outs

    for out in asyncio.run(run()):
        assert out.versions == [3, 4, 4, 4]


def test_a_released_cache_frees_its_memory_and_generates_as_one_never_released(model):
    first, second = prompts(2), {f"h{k}": v for k, v in prompts(3).items()}
    kept, released = (engine(model, max_slots=8, cache_tokens=1024) for _ in range(2))
    held = released.cache.nbytes
    for e in (kept, released):
        asyncio.run(play(e, first))
    assert asyncio.run(released.release_cache()) == held > 0
    assert released.cache.nbytes == 0
    assert asyncio.run(released.release_cache()) == 0  # nothing left to free
    for greedy in (True, False):
        assert tokens_of(asyncio.run(play(released, second, greedy=greedy))) == \
            tokens_of(asyncio.run(play(kept, second, greedy=greedy)))
    assert released.cache.nbytes == held  # allocated again, in full


def test_an_engine_holding_a_sequence_keeps_its_cache(model):
    e = engine(model, max_slots=4, cache_tokens=256)

    async def open_then_release() -> int:
        await e.start_group(["a/0"], [11, 12, 13])
        await e.generate("a/0", [], params(1, greedy=True, n=2))  # in a slot now
        return await e.release_cache()

    held = e.cache.nbytes
    assert asyncio.run(open_then_release()) == 0 and e.cache.nbytes == held
    with pytest.raises(ValueError, match=r"^SlotCache.release: 1 slot\(s\) in use$"):
        e.cache.release()


def test_on_a_gpu_the_default_budget_is_a_share_of_the_free_memory():
    # toy, bfloat16: a slot 3 x (2x64x64 x 4 B state + 3 x 384 x 2 B conv) = 105,216 B; a token 48 x 2 B,
    # a block 1,536 B. 8 GiB free x 0.9 x a quarter of the GPU = 1,932,735,283 B: 8 slots and the scratch
    # slot take 946,944 B, the scratch block 1,536 B, leaving 1,257,673 blocks = 20,122,768 tokens (8 slots
    # of 2^23 tokens could use more).
    cfg = RolloutConfig(max_slots=8, groups_per_worker=2, group_size=4, max_context=1 << 23)
    toy, bf16, free = build_model("toy", vocab_size=300, device="meta").config, torch.bfloat16, 8 << 30
    assert engine_cache_tokens(cfg, toy, bf16, gpu=(free, 0.25)) == 20_122_768
    # the whole GPU would hold 80,521,856 tokens, more than 8 slots of 2^23 tokens can ever use
    assert engine_cache_tokens(cfg, toy, bf16, gpu=(free, 1.0)) == 8 << 23
    half = cfg.model_copy(update={"gpu_memory_fraction": 0.5})
    assert engine_cache_tokens(half, toy, bf16, gpu=(free, 0.25)) == (int(free * 0.125) - 9 * 105_216 - 1536) // 1536 * 16
    # given sizes win, and a CPU engine keeps its fixed default
    assert engine_cache_tokens(cfg.model_copy(update={"cache_tokens": 4096}), toy, bf16, gpu=(free, 0.25)) == 4096
    assert engine_cache_tokens(cfg, toy, torch.float32) == DEFAULT_CACHE_TOKENS
    # never more than every slot holding a whole max_context sequence: 8 x 512 tokens
    assert engine_cache_tokens(cfg.model_copy(update={"max_context": 500}), toy, bf16, gpu=(free, 0.25)) == 8 * 512
    with pytest.raises(ValueError, match=r"^rollout.gpu_memory_fraction=0.9 of 0.00 GiB free x GPU share 0.25 "
                                         r"\(230,400 bytes\) cannot hold rollout.max_slots=8 slots[^\n]*$"):
        engine_cache_tokens(cfg.model_copy(update={"max_context": 512}), toy, bf16, gpu=(1_024_000, 0.25))


@pytest.mark.parametrize("greedy", [True, False])
def test_short_inputs_fed_through_the_decode_batch_equal_prefill_forwards(model, greedy):
    """decode_feed_tokens (for CUDA graphs): tool results and short prompts fed a token
    a step inside the fixed-shape decode batch give the tokens and logprobs of prefill forwards."""
    groups = prompts(4)  # prompts of 4-19 tokens, tool results of 3-10
    prefilled = engine(model, max_slots=16, cache_tokens=4096, decode_graphs=True, decode_feed_tokens=0)
    fed = engine(model, max_slots=16, cache_tokens=4096, decode_graphs=True, decode_feed_tokens=12)
    a = asyncio.run(play(prefilled, groups, greedy=greedy))
    b = asyncio.run(play(fed, groups, greedy=greedy))
    assert_same_turns(a, b)
    # the inputs took decode steps: more steps, and their tokens but each one's last counted as prefill
    inputs = (sum(1 for _, members in groups.values() for m in members for t in range(3) if tool_result(m, t))
              + sum(1 for prompt, _ in groups.values() if len(prompt) <= 12))  # tool results, the short prompts
    assert fed.stats().steps > prefilled.stats().steps
    assert fed.stats().prefill_tokens == prefilled.stats().prefill_tokens - inputs
    assert engine(model).decode_feed_tokens == 0  # off by default
    assert build_engine(TOY, RolloutConfig(decode_feed_tokens=12), seed=0).decode_feed_tokens == 12  # the config's
    with pytest.raises(ValueError, match="decode_feed_tokens"):
        engine(model, decode_feed_tokens=-1)
