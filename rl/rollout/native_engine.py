"""The native rollout engine: our hybrid policy served with continuous batching.

Sequences join and leave the running batch at every step. A step runs at most two forwards: one
decode forward over every sequence with exactly one token to feed (and, with `decode_feed_tokens`,
every one with a short input: fed a token a step, beside the others' decoding), and one prefill
forward over sequences with several (a new group's prompt, a tool result), right-padded and bounded
by `max_batch_tokens` (longer inputs are fed in chunks over several steps). Each sequence lives in a
cache slot (policy.slot_cache): KDA states per slot, MLA keys in shared blocks, so no step copies
another sequence's cache. A group's prompt is prefilled once and forked into its members.

When the cache runs out of blocks, the newest sequence is preempted: its memory is freed, and it
is prefilled again from its tokens when room returns (recomputation, as vLLM does).

On a GPU the decode forward runs at fixed shapes, captured once per shape as a CUDA graph
(rl/rollout/decode_graphs.py): one launch per step instead of thousands.

The model runs in a worker thread, so the event loop keeps accepting requests (and environment
replies keep arriving) while a forward is in flight: always the same thread, since each new thread
that runs torch on a CPU brings its own OpenMP team, and teams left spinning beside it slowed every
matrix product 1.6x on two cores. Weight updates wait for the forward in flight
and apply before the next one; sequences continue under the new weights (partial rollouts), each
token recording the version that sampled it."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from policy.slot_cache import BLOCK_SIZE, CacheFull, SlotCache
from rl.rollout.decode_graphs import DecodeGraphs
from rl.rollout.engine_api import EngineStats, RolloutEngine, SamplingParams, SequenceRecord, TurnOutput, WeightUpdate
from rl.rollout.sampling import sample_tokens


@dataclass
class _Turn:
    params: SamplingParams
    future: asyncio.Future
    out: TurnOutput = field(default_factory=lambda: TurnOutput([], [], [], False))


@dataclass
class _Seq:
    seq_id: str
    tokens: list[int]
    fed: int = 0  # tokens[:fed] are in the cache
    slot: int | None = None
    logits: torch.Tensor | None = None  # next-token logits once everything is fed
    turn: _Turn | None = None
    sampled: int = 0  # tokens sampled so far: the position in the sequence's random stream
    routing: list[np.ndarray] = field(default_factory=list)  # per fed token [n_moe, k]
    fork_of: "_Seq | None" = None  # waiting to copy this sequence's cache once it is prefilled
    admitted: float = 0.0  # for preemption order (newest first)
    error: Exception | None = None  # a failed step left its cache undefined: every later turn fails


class NativeEngine(RolloutEngine):
    def __init__(self, model: torch.nn.Module, max_slots: int = 64, cache_tokens: int = 65536,
                 block_size: int = BLOCK_SIZE, max_batch_tokens: int = 2048, record_routing: bool = True,
                 name: str = "native", decode_graphs: bool | None = None, compile_decode: bool = False,
                 decode_feed_tokens: int = 0) -> None:
        """decode_graphs: decode at fixed shapes replayed as CUDA graphs; None means on a GPU. True on a
        CPU runs the fixed-shape step eagerly (what the graphs replay, for tests). compile_decode (CPU):
        that fixed-shape step compiled with torch.compile. decode_feed_tokens: inputs of at most this
        many tokens (tool results, short prompts) are fed one token a step inside the decode batch
        instead of by a prefill forward of their own: meant for CUDA graphs, where a replayed step
        costs less than an eager prefill's launches and the other sequences keep decoding meanwhile
        (on a CPU it only adds steps); not yet measured on a GPU, so off by default."""
        self.model = model.eval()
        self.name = name
        self.record_routing = record_routing
        self.max_batch_tokens = max_batch_tokens
        num_blocks = max(1, -(-cache_tokens // block_size))
        self.cache = SlotCache(model, max_slots=max_slots, num_blocks=num_blocks, block_size=block_size)
        on_gpu = self.cache.device.type == "cuda"
        fixed_shapes = compile_decode or (on_gpu if decode_graphs is None else decode_graphs)
        self._graphs = (DecodeGraphs(model, self.cache, record_routing, use_graphs=on_gpu, compile=compile_decode)
                        if fixed_shapes else None)
        if decode_feed_tokens < 0:
            raise ValueError(f"NativeEngine: decode_feed_tokens must be >= 0, got {decode_feed_tokens}")
        self.decode_feed_tokens = decode_feed_tokens
        self.seqs: dict[str, _Seq] = {}
        self.version = -1
        self._stats = EngineStats()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None  # held by a forward; a weight update waits for it
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-engine")  # every torch call
        self._device = model.lm_head.weight.device

    # ---- the contract (coroutines of the actor's event loop; they change state only between steps)
    async def start_group(self, seq_ids: list[str], prompt: list[int]) -> None:
        self._ensure_loop()
        if not prompt:
            raise ValueError("start_group: the prompt is empty")
        async with self._lock:
            now = time.monotonic()
            parent = _Seq(seq_ids[0], list(prompt), admitted=now)
            self.seqs[parent.seq_id] = parent
            for sid in seq_ids[1:]:
                self.seqs[sid] = _Seq(sid, list(prompt), fork_of=parent, admitted=now)
        self._wake.set()

    async def generate(self, seq_id: str, append: list[int], params: SamplingParams) -> TurnOutput:
        self._ensure_loop()
        async with self._lock:
            seq = self.seqs.get(seq_id)
            if seq is None:
                raise KeyError(f"generate: unknown sequence {seq_id!r} (start_group first)")
            if seq.turn is not None:
                raise RuntimeError(f"generate: sequence {seq_id!r} already has a turn in flight")
            if seq.error is not None:
                raise seq.error
            if append:
                seq.tokens.extend(append)
                seq.logits = None
            seq.turn = _Turn(params, asyncio.get_running_loop().create_future())
        self._wake.set()
        return await seq.turn.future

    async def finish(self, seq_id: str) -> SequenceRecord:
        self._ensure_loop()
        async with self._lock:
            seq = self.seqs.pop(seq_id, None)
            if seq is None:
                return SequenceRecord(fed_tokens=0)
            if seq.turn is not None and not seq.turn.future.done():
                seq.turn.future.cancel()
            for other in self.seqs.values():  # a member still waiting to fork from it is prefilled alone
                if other.fork_of is seq:
                    other.fork_of = None
            if seq.slot is not None:
                self.cache.free(seq.slot)
        self._wake.set()  # its memory may let a waiting sequence in
        routing = np.stack(seq.routing).astype(np.int16) if seq.routing else None
        return SequenceRecord(fed_tokens=seq.fed, routing=routing)

    async def update_weights(self, weights: WeightUpdate, version: int) -> None:
        self._ensure_loop()
        async with self._lock:
            self.model.load_state_dict(weights)
            self.version = version

    async def load_weights_with(self, load: Callable[[torch.nn.Module], int]) -> None:
        """Like update_weights, for a loader that writes into the model itself and returns the
        version it loaded (rl.weight_sync's buckets): run in a thread, between two forward passes."""
        self._ensure_loop()
        async with self._lock:
            self.version = await asyncio.get_running_loop().run_in_executor(self._worker, load, self.model)

    async def release_cache(self) -> int:
        """Free the cache's memory while the engine holds no sequence (a colocated learner steps
        meanwhile); the next sequence allocates it again. Returns the bytes freed (0 when busy)."""
        self._ensure_loop()
        async with self._lock:
            if self.seqs or self.cache.released:
                return 0
            freed = self.cache.release()
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            return freed

    def stats(self) -> EngineStats:
        s = self._stats
        s.running = sum(q.slot is not None for q in self.seqs.values())
        s.waiting = sum(q.slot is None for q in self.seqs.values())
        s.extra["free_blocks"] = float(self.cache.free_blocks)
        return s

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._worker.shutdown(wait=False)
        for seq in self.seqs.values():
            if seq.turn is not None and not seq.turn.future.done():
                seq.turn.future.cancel()
        self.seqs.clear()

    # ---- the loop ----------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._lock = asyncio.Lock()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            progressed = True
            while progressed:
                async with self._lock:
                    started = time.perf_counter()
                    try:
                        progressed = await asyncio.get_running_loop().run_in_executor(self._worker, self._step)
                    except Exception as exc:  # noqa: BLE001 - a failed step fails its sequences, not the engine
                        progressed = False
                        self._stats.extra["step_errors"] = self._stats.extra.get("step_errors", 0.0) + 1
                        error = RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}")
                        # a forward may have written part of any fed sequence's cache: none of them
                        # can go on, including those with no turn in flight (a group prompt's prefill)
                        for seq in self.seqs.values():
                            seq.error = error
                            self._fail(seq, error)
                    self._stats.busy_s += time.perf_counter() - started
                await asyncio.sleep(0)  # requests and weight updates get in between two steps

    @torch.no_grad()
    def _step(self) -> bool:
        """One scheduling round: feed what is waiting (one decode forward, one prefill forward),
        fork prefilled group prompts, sample. Returns whether anything happened."""
        parents = {id(s.fork_of) for s in self.seqs.values() if s.fork_of is not None}
        wanting = sorted((s for s in self.seqs.values() if s.fork_of is None and s.fed < len(s.tokens)
                          and s.error is None and (s.turn is not None or id(s) in parents)),
                         key=lambda s: s.admitted)
        decode: list[_Seq] = []
        prefill: list[tuple[_Seq, int]] = []
        chosen: set[int] = set()  # fed this step: never preempted by a later one
        budget = self.max_batch_tokens
        for seq in wanting:
            todo = len(seq.tokens) - seq.fed
            take = 1 if todo <= max(1, self.decode_feed_tokens) else min(todo, budget)
            if take < 1 or not self._make_room(seq, seq.fed + take, chosen):
                continue
            chosen.add(id(seq))
            if take == 1:
                decode.append(seq)
                if todo > 1:  # a short input fed through the decode batch (its last token counts as decode)
                    self._stats.prefill_tokens += 1
            else:
                prefill.append((seq, take))
                budget -= take
        if decode:
            self._decode(decode)
        if prefill:
            self._forward([s for s, _ in prefill], [n for _, n in prefill])
        forked = [s for s in list(self.seqs.values()) if s.fork_of is not None
                  and s.fork_of.slot is not None and s.fork_of.fed == len(s.fork_of.tokens)
                  and s.fork_of.logits is not None]
        for child in forked:
            self._fork(child)
        ready = [s for s in self.seqs.values() if s.turn is not None and s.logits is not None and s.fork_of is None]
        if ready:
            self._sample(ready)
        self._stats.steps += 1
        return bool(decode or prefill or forked or ready)

    def _make_room(self, seq: _Seq, length: int, chosen: set[int]) -> bool:
        """A slot and blocks for `seq` up to `length` tokens, preempting newer sequences if needed;
        False when it must wait. A sequence larger than the whole cache fails its turn."""
        capacity = self.cache.num_blocks * self.cache.block_size
        if length > capacity:
            self._fail(seq, RuntimeError(f"sequence {seq.seq_id!r} needs {length} tokens of cache; the engine holds "
                                         f"{capacity} (raise rollout.cache_tokens or cache_gib, or lower max_context)"))
            return False
        while True:
            try:
                if seq.slot is None:
                    seq.slot = self.cache.alloc()
                self.cache.reserve(seq.slot, length)
                return True
            except CacheFull:
                victims = [s for s in self.seqs.values() if s.slot is not None and s is not seq
                           and s.admitted >= seq.admitted and id(s) not in chosen and not self._is_parent(s)]
                if not victims:
                    if seq.slot is not None and seq.fed == 0:
                        self.cache.free(seq.slot)  # hold nothing while waiting
                        seq.slot = None
                    return False
                self._preempt(max(victims, key=lambda s: s.admitted))

    def _is_parent(self, seq: _Seq) -> bool:
        return any(o.fork_of is seq for o in self.seqs.values())

    def _fail(self, seq: _Seq, error: Exception) -> None:
        turn, seq.turn = seq.turn, None
        if turn is not None and not turn.future.done():
            turn.future.get_loop().call_soon_threadsafe(_reject, turn.future, error)

    def _preempt(self, seq: _Seq) -> None:
        self.cache.free(seq.slot)
        seq.slot, seq.fed, seq.logits = None, 0, None
        seq.routing = []
        self._stats.extra["preempted"] = self._stats.extra.get("preempted", 0.0) + 1

    def _fork(self, child: _Seq) -> None:
        parent = child.fork_of
        child.fork_of = None
        try:
            child.slot = self.cache.alloc()
            self.cache.fork(parent.slot, child.slot)
        except CacheFull:  # no room now: it is prefilled on its own later
            if child.slot is not None:
                self.cache.free(child.slot)
                child.slot = None
            return
        child.fed = parent.fed
        child.logits = parent.logits
        child.routing = list(parent.routing)

    def _forward(self, seqs: list[_Seq], take: list[int]) -> None:
        width = max(take)
        slots = [s.slot for s in seqs]
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.bool)
        for b, (s, n) in enumerate(zip(seqs, take)):
            ids[b, :n] = torch.tensor(s.tokens[s.fed:s.fed + n])
            mask[b, :n] = True
        view = self.cache.view(slots, take, width)
        padded = min(take) < width
        out = self.model(ids.to(self._device), cache=view, use_cache=True, logits_to_keep=1,
                         return_routing=self.record_routing, token_mask=mask.to(self._device) if padded else None)
        self.cache.commit(slots, out.cache, take)
        logits = out.logits[:, -1]
        routing = None
        if self.record_routing and out.routing is not None:
            routing = out.routing.to(torch.int16).cpu().numpy()
        for b, (s, n) in enumerate(zip(seqs, take)):
            s.fed += n
            s.logits = logits[b] if s.fed == len(s.tokens) else None
            if routing is not None:
                s.routing.extend(routing[b, :n])
        if width > 1:
            self._stats.prefill_tokens += sum(take)

    def _decode(self, seqs: list[_Seq]) -> None:
        """One token for each of `seqs`: the fixed-shape (graph) step, or the general forward."""
        if self._graphs is None:
            self._forward(seqs, [1] * len(seqs))
            return
        logits, routing = self._graphs.step([s.slot for s in seqs], [s.tokens[s.fed] for s in seqs])
        routing = None if routing is None else routing.to(torch.int16).cpu().numpy()
        for b, s in enumerate(seqs):
            s.fed += 1
            s.logits = logits[b] if s.fed == len(s.tokens) else None
            if routing is not None:
                s.routing.append(routing[b])
        self._stats.extra["graphs_captured"] = float(self._graphs.captured)
        if self._graphs.capture_error is not None:
            self._stats.extra["graph_capture_failed"] = 1.0

    def _sample(self, seqs: list[_Seq]) -> None:
        params = [s.turn.params for s in seqs]
        dev = self._device
        logits = torch.stack([s.logits for s in seqs])
        if all(p.temperature <= 0 for p in params):  # what sample_tokens gives greedy rows, without the noise
            tokens, logprobs = logits.argmax(-1), torch.zeros(len(seqs))
        else:
            tokens, logprobs = sample_tokens(
                logits,
                torch.tensor([p.temperature for p in params], device=dev),
                torch.tensor([p.top_p for p in params], device=dev),
                torch.tensor([p.seed for p in params], device=dev),
                torch.tensor([s.sampled for s in seqs], device=dev))
        for s, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
            turn = s.turn
            s.tokens.append(tok)
            s.sampled += 1
            s.logits = None
            turn.out.tokens.append(tok)
            turn.out.logprobs.append(lp)
            turn.out.versions.append(self.version)
            stopped = tok in turn.params.stop_ids
            if stopped or len(turn.out.tokens) >= turn.params.max_new_tokens:
                turn.out.stopped = stopped
                s.turn = None
                turn.future.get_loop().call_soon_threadsafe(_resolve, turn.future, turn.out)
        self._stats.generated_tokens += len(seqs)


def _resolve(future: asyncio.Future, value: TurnOutput) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
