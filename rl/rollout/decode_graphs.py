"""The native engine's decode forward at fixed shapes, replayed as CUDA graphs.

A decode step of the hybrid is thousands of small kernels; launched one at a time from Python the
step is bound by the launches, not by the GPU. Captured once per shape in a CUDA graph, a step is
one launch. A graph fixes every shape and address, so a decode batch is padded to the next batch
bucket (padding rows read and write the slot cache's scratch slot and block) and every row's past
keys to the next key-length bucket (masked); the step's inputs are copied into buffers the graph
reads, its outputs read from buffers it writes. Inside the graph the forward updates the KDA
states in their slots and writes the new keys into their blocks; the step then writes the new conv
windows into the slots.

The graphs hold the addresses of the model's weights and of the cache's tensors: weight updates
copy into the weights in place, so the graphs follow them; a cache released and allocated again
(colocated runs) has new tensors, so its graphs are dropped and captured again.

Without CUDA (or with graphs off) the same fixed-shape step runs eagerly, which is how it is tested
against the engine's variable-shape forward on a CPU. On a CPU it can also be compiled
(`compile=True`: torch.compile, inductor's C++ kernels fusing the small elementwise ops that bound a
decode step there; the experts' per-expert loop stays eager)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from policy.slot_cache import SlotCache

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MIN_KEY_BUCKET = 64  # past-key buckets are powers of two from here


def batch_bucket(n: int) -> int:
    """The smallest bucket holding n rows (multiples of the largest bucket past it)."""
    top = BATCH_BUCKETS[-1]
    return next((b for b in BATCH_BUCKETS if b >= n), -(-n // top) * top)


def key_bucket(n: int) -> int:
    return max(MIN_KEY_BUCKET, 1 << max(n - 1, 0).bit_length())


@dataclass
class _Buffers:
    """One shape's inputs and outputs, at fixed addresses."""

    ids: torch.Tensor  # [B, 1]
    slots: torch.Tensor  # [B]
    lengths: torch.Tensor  # [B]
    past_index: torch.Tensor  # [B, P]
    past_valid: torch.Tensor  # [B, P]
    write_index: torch.Tensor  # [B, 1]
    new_valid: torch.Tensor  # [B, 1]
    logits: torch.Tensor | None = None  # [B, vocab] float32, written by the step
    routing: torch.Tensor | None = None  # [B, n_moe, k], written by the step when recorded


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, cache: SlotCache, record_routing: bool, use_graphs: bool,
                 compile: bool = False) -> None:
        self.model, self.cache, self.record_routing = model, cache, record_routing
        self.device = cache.device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        if compile and self.device.type != "cpu":
            raise ValueError("DecodeGraphs: compile is for a CPU engine (on a GPU the CUDA graphs remove the launches)")
        # automatic dynamic shapes: one recompile makes batch and key length symbolic, not one per bucket
        self._step_fn = torch.compile(self._forward, dynamic=None) if compile else self._forward
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None  # one memory pool for every graph: they never run at once
        self._cache_tensors: tuple[int, ...] = ()
        self.captured = 0  # graphs captured so far (EngineStats)
        self.capture_error: str | None = None  # why capturing failed (decoding then stays eager)

    @torch.no_grad()
    def step(self, slots: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed tokens[b] to slots[b] (every slot's blocks reserved). Returns the next-token logits
        [B, vocab] float32 and, when recorded, the routing [B, n_moe, k]; the KDA states and keys
        are written and the slots' lengths advanced."""
        n = len(slots)
        shape = (batch_bucket(n), key_bucket(max(self.cache.lengths[s] for s in slots)))
        buf = self._buffers.get(shape) or self._allocate(*shape)
        self._fill(buf, slots, tokens)
        if self.use_graphs:
            self._replay(shape, buf)
        else:
            self._step_fn(buf)
        self.cache.advance(slots, [1] * n)
        # copies: the next replay writes the same buffers
        return buf.logits[:n].clone(), None if buf.routing is None else buf.routing[:n].clone()

    # ---- inputs ------------------------------------------------------------------------------
    def _allocate(self, batch: int, keys: int) -> _Buffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        buf = _Buffers(zeros(batch, 1), zeros(batch), zeros(batch), zeros(batch, keys),
                       zeros(batch, keys, dtype=torch.bool), zeros(batch, 1), zeros(batch, 1, dtype=torch.bool))
        self._buffers[(batch, keys)] = buf
        return buf

    def _fill(self, buf: _Buffers, slots: list[int], tokens: list[int]) -> None:
        """The batch into the buffers; rows past it read and write the scratch slot and block."""
        n, pad = len(slots), buf.slots.shape[0] - len(slots)
        past_index, past_valid, write_index, _ = self.cache.indices(slots, [1] * n, 1, buf.past_index.shape[1])
        scratch_row = self.cache.num_blocks * self.cache.block_size
        rows = [
            (buf.ids, torch.tensor(tokens).view(n, 1), 0),
            (buf.slots, torch.tensor(slots), self.cache.scratch_slot),
            (buf.lengths, torch.tensor([self.cache.lengths[s] for s in slots]), 0),
            (buf.past_index, past_index, 0),
            (buf.past_valid, past_valid, False),
            (buf.write_index, write_index, scratch_row),
            (buf.new_valid, torch.ones(n, 1, dtype=torch.bool), True),  # a padding row attends to its own key
        ]
        for dst, src, fill in rows:
            if pad:
                src = torch.cat([src, torch.full((pad, *src.shape[1:]), fill, dtype=src.dtype)])
            dst.copy_(src, non_blocking=True)

    # ---- the step ----------------------------------------------------------------------------
    def _forward(self, buf: _Buffers) -> None:
        view = self.cache.view_of(buf.slots, buf.past_index, buf.past_valid, buf.write_index, buf.new_valid,
                                  buf.lengths)
        out = self.model(buf.ids, cache=view, use_cache=True, logits_to_keep=1, return_routing=self.record_routing)
        self.cache.write_states(buf.slots, out.cache)
        logits = out.logits[:, -1]
        if buf.logits is None:
            buf.logits = torch.empty_like(logits)
            if self.record_routing and out.routing is not None:
                buf.routing = torch.empty_like(out.routing[:, -1])
        buf.logits.copy_(logits)
        if buf.routing is not None:
            buf.routing.copy_(out.routing[:, -1])

    def _replay(self, shape: tuple[int, int], buf: _Buffers) -> None:
        tensors = self.cache.tensor_ids()
        if tensors != self._cache_tensors:  # a released and re-allocated cache: new addresses
            self._graphs.clear()
            self._cache_tensors = tensors
        graph = self._graphs.get(shape)
        if graph is None:
            try:
                graph = self._capture(buf)
            except Exception as exc:  # noqa: BLE001 - an op that cannot be captured: decode eagerly instead
                self.use_graphs = False
                self.capture_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                warnings.warn(f"native engine: CUDA graph capture failed ({self.capture_error}); decoding eagerly",
                              RuntimeWarning, stacklevel=2)
                self._forward(buf)
                return
            self._graphs[shape] = graph
        graph.replay()

    def _capture(self, buf: _Buffers) -> torch.cuda.CUDAGraph:
        """Warm up (kernels compiled and tuned, output buffers made) and capture on a side stream,
        with the buffers pointing at the scratch slot and block: neither run may change a real
        sequence's state. The caller fills the buffers again before replaying."""
        real = {name: getattr(buf, name).clone() for name in ("slots", "past_valid", "write_index")}
        buf.slots.fill_(self.cache.scratch_slot)
        buf.past_valid.fill_(False)
        buf.write_index.fill_(self.cache.num_blocks * self.cache.block_size)
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(buf)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(buf)
        finally:
            for name, value in real.items():
                getattr(buf, name).copy_(value)
        self.captured += 1
        return graph
