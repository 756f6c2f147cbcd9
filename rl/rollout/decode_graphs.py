"""The native engine's decode forward at fixed shapes, replayed as CUDA graphs (and short prefills).

A decode step of the hybrid is thousands of small kernels; launched one at a time from Python the
step is bound by the launches, not by the GPU. Captured once per shape in a CUDA graph, a step is
one launch. A graph fixes every shape and address, so a decode batch is padded to the next batch
bucket (padding rows read and write the slot cache's scratch slot and block) and every row's past
keys to the next key-length bucket (masked); the step's inputs are copied into buffers the graph
reads, its outputs read from buffers it writes. The past keys' positions in the blocks are computed
inside the step from the rows' block tables (a block_size-th of the keys): built on the host, they
were two [B, keys] arrays a step, 9 ms of host time at 32 rows of 8K keys. Inside the graph the forward updates the KDA
states in their slots and writes the new keys into their blocks; the step then writes the new conv
windows into the slots.

A row's input token can come from the device instead of the host (`sources`): the tokens the
engine sampled at the last step, which it has not yet read back (the engine overlaps a step's
launch with reading the last one's tokens).

The graphs hold the addresses of the model's weights and of the cache's tensors: weight updates
copy into the weights in place, so the graphs follow them; a cache released and allocated again
(colocated runs) has new tensors, so its graphs are dropped and captured again.

Short prefills (tool results, a turn's few tokens) are launch-bound on a GPU the same way: a
forward of `width` tokens per row (padded to a token bucket, padding masked) is captured per
(batch, width, keys) shape too, uncompiled (`step` with token lists longer than one).

Without CUDA (or with graphs off) the same fixed-shape step runs eagerly, which is how it is tested
against the engine's variable-shape forward on a CPU. The step can also be compiled (`compile=True`:
torch.compile). On a CPU inductor's C++ kernels fuse the small elementwise ops that bound a decode
step there (the experts' per-expert loop runs inside the graph as one opaque op, so the step is one
graph); on a GPU a graph already removes the
launches, but each of a step's ~300 kernels still takes a few microseconds of GPU time, most of them
elementwise chains that inductor's Triton kernels fuse: the compiled step is what gets captured."""
from __future__ import annotations

import contextlib
import gc
import time
import warnings

import numpy as np
import torch

from policy.layers.moe import fixed_capacity_experts
from policy.slot_cache import SlotCache

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MIN_KEY_BUCKET = 64  # past-key buckets are powers of two from here
MIN_TOKEN_BUCKET = 16  # a prefill's tokens per row: powers of two from here (few widths, few graphs)
# a failed capture leaves its shape eager; after this many, every step is: failures that repeat are
# not transient (one that is, as a collection freeing a graph mid-capture, costs one shape only)
MAX_CAPTURE_FAILURES = 3
# a step's inputs, in the order of its packed input tensor: one value per row, then `width` per row,
# then the row's block table (keys / block_size: the step turns it into the past keys' index and mask)
_ROW_COLUMNS = ("source", "slots", "lengths")
_TOKEN_COLUMNS = ("ids", "write_index", "new_valid")


def batch_bucket(n: int) -> int:
    """The smallest bucket holding n rows (multiples of the largest bucket past it)."""
    top = BATCH_BUCKETS[-1]
    return next((b for b in BATCH_BUCKETS if b >= n), -(-n // top) * top)


def key_bucket(n: int) -> int:
    return max(MIN_KEY_BUCKET, 1 << max(n - 1, 0).bit_length())


def token_bucket(n: int) -> int:
    """Tokens per row of a step: 1 for decode, else the prefill bucket holding n."""
    return 1 if n == 1 else max(MIN_TOKEN_BUCKET, 1 << (n - 1).bit_length())


class _Buffers:
    """One shape's inputs and outputs, at fixed addresses. The inputs are column ranges of one int64
    tensor, filled on the host in a (pinned) staging copy and sent in one transfer a step."""

    def __init__(self, batch: int, width: int, keys: int, block_size: int, device: torch.device) -> None:
        # source, slots, lengths: [B, 1]; ids, write_index, new_valid: [B, width] (the valid flags as 0/1:
        # the step turns them into masks; source: -1, or the row of the fed-back tokens that is this row's
        # input instead of ids); tables: [B, keys / block_size], the blocks of the row's past keys
        widths = {**{name: 1 for name in _ROW_COLUMNS}, **{name: width for name in _TOKEN_COLUMNS},
                  "tables": -(-keys // block_size)}
        self.columns: dict[str, slice] = {}
        start = 0
        for name, w in widths.items():
            self.columns[name] = slice(start, start + w)
            start += w
        self.width, self.block_size = width, block_size
        self.packed = torch.zeros(batch, start, dtype=torch.long, device=device)
        self.staging = torch.zeros(self.packed.shape, dtype=torch.long, pin_memory=device.type == "cuda")
        self.sent: torch.cuda.Event | None = None  # the last transfer out of `staging`
        self.logits: torch.Tensor | None = None  # [B, vocab] float32: the last step's (a graph's output)
        self.routing: torch.Tensor | None = None  # [B, width, n_moe, k]: the last step's, when recorded

    def column(self, name: str) -> torch.Tensor:
        return self.packed[:, self.columns[name]]

    def unpacked(self) -> dict[str, torch.Tensor]:
        """Every column, the block tables' cut by the packed tensor's own width rather than the stored
        slices: under torch.compile with symbolic sizes that cut is then symbolic too (stored ints are
        guarded; `width` is one per compiled step)."""
        cols = {name: self.packed[:, i:i + 1] for i, name in enumerate(_ROW_COLUMNS)}
        start = len(_ROW_COLUMNS)
        for name in _TOKEN_COLUMNS:
            cols[name] = self.packed[:, start:start + self.width]
            start += self.width
        cols["tables"] = self.packed[:, start:]
        return cols


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, cache: SlotCache, record_routing: bool, use_graphs: bool,
                 fed_back: torch.Tensor, compile: bool = False) -> None:
        """fed_back: [N] int64 on the cache's device, at a fixed address: tokens a row can take as its
        input (`step`'s sources), written by the engine's sampler."""
        self.model, self.cache, self.record_routing = model, cache, record_routing
        self.fed_back = fed_back
        self.device = cache.device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        # automatic dynamic shapes: one recompile makes batch and key length symbolic, not one per bucket
        self._step_fn = torch.compile(self._forward, dynamic=None) if compile else self._forward
        # on a CPU both sizes are symbolic from the first compile (`_allocate`): a whole-step compile takes
        # tens of seconds there, and the static and symbolic steps ran at the same speed
        self._symbolic = compile and not self.use_graphs
        self._buffers: dict[tuple[int, int, int], _Buffers] = {}  # by (batch, width, keys)
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._warmed: set[tuple[int, int, int]] = set()  # shapes captured before: their kernels are ready
        # memory pools: one for the decode graphs, one for the prefill graphs. Graphs sharing a pool
        # may reuse each other's freed intermediates for their own outputs, so a graph replayed
        # after another can overwrite that one's logits; a launch replays a decode graph and then a
        # prefill graph and samples from both, but never two graphs of one kind
        self._pools: dict[bool, tuple] = {}  # by whether the graph prefills (width > 1)
        self._cache_tensors: tuple[int, ...] = ()
        self.captured = 0  # graphs captured so far (EngineStats)
        self.capture_s = 0.0  # time spent capturing them (warm-up forwards included)
        self.capture_error: str | None = None  # why the last failed capture failed
        self.capture_failures = 0
        self._eager: set[tuple[int, int, int]] = set()  # shapes whose capture failed

    @torch.no_grad()
    def step(self, slots: list[int], tokens: list[list[int]], sources: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed each slot[b] the tokens[b] (every slot's blocks reserved; where sources[b] >= 0 its
        one token is fed_back[sources[b]] instead). Returns the logits after each row's last token
        [B, vocab] float32 and, when recorded, the routing [B, width, n_moe, k] (row b's first
        len(tokens[b]) real): views of the graph's output buffers, which the next step of its kind
        (decode, or prefill) may overwrite (whatever reads them must be queued before it). The KDA states and keys are
        written and the slots' lengths advanced."""
        n = len(slots)
        shape = (batch_bucket(n), token_bucket(max(map(len, tokens))),
                 key_bucket(max(self.cache.lengths[s] for s in slots)))
        buf = self._buffers.get(shape) or self._allocate(*shape)
        self._fill(buf, slots, tokens, sources)
        if self.use_graphs and shape not in self._eager:
            self._replay(shape, buf)
        else:
            self._run(buf)
        self.cache.advance(slots, [len(t) for t in tokens])
        return buf.logits[:n], None if buf.routing is None else buf.routing[:n]

    # ---- inputs ------------------------------------------------------------------------------
    def _allocate(self, batch: int, width: int, keys: int) -> _Buffers:
        buf = self._buffers[(batch, width, keys)] = _Buffers(batch, width, keys, self.cache.block_size, self.device)
        # one graph for every decode bucket (a batch of one, which dynamo specialises, has its own)
        if self._symbolic and width == 1:
            torch._dynamo.mark_dynamic(buf.packed, 1)
            if batch > 1:
                torch._dynamo.mark_dynamic(buf.packed, 0)
        return buf

    def _fill(self, buf: _Buffers, slots: list[int], tokens: list[list[int]], sources: list[int]) -> None:
        """The batch into the buffers; rows past it, and tokens past a row's, read and write the
        scratch slot and block."""
        n, width = len(slots), buf.width
        n_new = [len(t) for t in tokens]
        write_index, real = self.cache.new_indices(slots, n_new, width)
        if buf.sent is not None:
            buf.sent.synchronize()  # the last step's transfer has left the staging copy
        host, col = buf.staging.numpy(), buf.columns
        rows, pad = slice(0, n), slice(n, None)
        ids = np.zeros((n, width), dtype=np.int64)
        for b, t in enumerate(tokens):
            ids[b, :len(t)] = t
        host[rows, col["ids"]] = ids
        host[rows, col["source"]] = np.asarray(sources)[:, None]
        host[rows, col["slots"]] = np.asarray(slots)[:, None]
        host[rows, col["lengths"]] = np.asarray([self.cache.lengths[s] for s in slots])[:, None]
        host[rows, col["write_index"]] = write_index
        host[rows, col["new_valid"]] = real
        host[rows, col["tables"]] = self.cache.block_tables(slots, col["tables"].stop - col["tables"].start)
        host[pad] = 0
        host[pad, col["source"]] = -1
        host[pad, col["slots"]] = self.cache.scratch_slot
        host[pad, col["write_index"]] = self.cache.num_blocks * self.cache.block_size
        host[pad, col["new_valid"].start] = 1  # a padding row has one token, attending to its own key
        buf.packed.copy_(buf.staging, non_blocking=True)
        if self.device.type == "cuda":
            buf.sent = torch.cuda.Event()
            buf.sent.record()

    # ---- the step ----------------------------------------------------------------------------
    def _run(self, buf: _Buffers) -> None:
        # on a GPU, experts without a grouped GEMM (float32) run at a fixed capacity: capturable
        with fixed_capacity_experts() if self.use_graphs else contextlib.nullcontext():
            # a prefill stays uncompiled: a compile per width and batch would cost more than it saves
            (self._step_fn if buf.width == 1 else self._forward)(buf)

    def _forward(self, buf: _Buffers) -> None:
        col = buf.unpacked()
        slots = col["slots"][:, 0]
        new_valid = col["new_valid"] != 0
        lengths = col["lengths"][:, 0]
        past_index, past_valid = self.cache.past_from_tables(col["tables"], lengths)
        view = self.cache.view_of(slots, past_index, past_valid, col["write_index"], new_valid, lengths)
        source = col["source"]
        ids = torch.where(source >= 0, self.fed_back[source.clamp(min=0)], col["ids"])
        out = self.model(ids, cache=view, use_cache=True, logits_to_keep=1, return_routing=self.record_routing,
                         token_mask=new_valid if buf.width > 1 else None)
        self.cache.write_states(slots, out.cache)
        # the forward's own outputs, not copies: inside a graph they keep their addresses at every replay
        buf.logits = out.logits[:, -1]
        if self.record_routing and out.routing is not None:
            buf.routing = out.routing

    def _replay(self, shape: tuple[int, int, int], buf: _Buffers) -> None:
        tensors = self.cache.tensor_ids()
        if tensors != self._cache_tensors:  # a released and re-allocated cache: new addresses
            # new pools too, and the old graphs' outputs let go: capturing into the pool of graphs
            # that are gone, while tensors of theirs still live in it, is not a state to count on
            self._graphs.clear()
            self._pools.clear()
            for old in self._buffers.values():
                old.logits = old.routing = None
            self._cache_tensors = tensors
        graph = self._graphs.get(shape)
        if graph is None:
            try:
                graph = self._capture(buf, warm=shape not in self._warmed)
            except Exception as exc:  # noqa: BLE001 - an op that cannot be captured: this shape runs eagerly
                self._eager.add(shape)
                self.capture_failures += 1
                self.use_graphs = self.capture_failures < MAX_CAPTURE_FAILURES
                self._step_fn = self._forward  # uncompiled from now on: the failure may be the compiler's
                self._warmed.clear()  # (a new step function: its kernels warm up again before a capture)
                # whole, on one line: CUDA's messages may start with a line break
                self.capture_error = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
                warnings.warn(f"native engine: CUDA graph capture failed ({self.capture_error}); "
                              f"{'steps of this shape run' if self.use_graphs else 'every step runs'} eagerly",
                              RuntimeWarning, stacklevel=2)
                # the step's inputs again: a failed capture can leave them pointing at the scratch slot
                # (its own restore may fail on a stream left in a capture error), and a step run on those
                # would feed no real sequence and sample from logits without their past
                buf.packed.copy_(buf.staging)
                self._run(buf)
                return
            self._graphs[shape] = graph
            self._warmed.add(shape)
        graph.replay()

    def _capture(self, buf: _Buffers, warm: bool) -> torch.cuda.CUDAGraph:
        """Warm up (kernels compiled and tuned, lazily made handles) and capture on a side stream,
        with the buffers pointing at the scratch slot and block: neither run may change a real
        sequence's state. A shape captured before (its graph dropped with a released cache) is
        captured again without warming up: two eager forwards a graph, every step of a colocated
        run that frees its cache. The step's inputs are sent again from `staging` afterwards."""
        torch.cuda.synchronize(self.device)  # (rare: the time it takes is recorded alone)
        started = time.perf_counter()
        buf.column("slots").fill_(self.cache.scratch_slot)
        buf.column("source").fill_(-1)
        buf.column("lengths").fill_(0)  # no valid past key
        buf.column("tables").fill_(0)
        buf.column("write_index").fill_(self.cache.num_blocks * self.cache.block_size)
        # no garbage collection while capturing: a collection in any thread that frees another graph
        # (an engine dropped before this one) destroys it mid-capture, and the capture fails. (No
        # collection first either: in a rollout worker's heap it took a third of the capture time.)
        collecting = gc.isenabled()
        gc.disable()
        try:
            if (buf.width > 1) not in self._pools:
                self._pools[buf.width > 1] = torch.cuda.graph_pool_handle()
            if warm:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                compiled = buf.width == 1 and self._step_fn is not self._forward
                with torch.cuda.stream(side):
                    for _ in range(2 if compiled else 1):  # (a compiled step: compiled in the first)
                        self._run(buf)
                torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a CUDA call of another thread (a rollout worker's event loop) must not
            # invalidate this capture; the engine's own thread is the only one using its streams
            with torch.cuda.graph(graph, pool=self._pools[buf.width > 1], capture_error_mode="thread_local"):
                self._run(buf)
        finally:
            if collecting:
                gc.enable()
            buf.packed.copy_(buf.staging)
        torch.cuda.synchronize(self.device)
        self.captured += 1
        self.capture_s += time.perf_counter() - started
        return graph
