"""The native rollout engine: our hybrid policy served with continuous batching.

Sequences join and leave the running batch at every step. A step runs at most two forwards (three
with `prefill_graph_tokens`): one decode forward over every sequence with exactly one token to feed
(and, with `decode_feed_tokens`, every one with a short input: fed a token a step, beside the
others' decoding), and one prefill forward over sequences with several (a new group's prompt, a
tool result), right-padded and bounded by `max_batch_tokens` (longer inputs are fed in chunks over
several steps). Each sequence lives in a cache slot (policy.slot_cache): KDA states per slot, MLA
keys in shared blocks, so no step copies another sequence's cache. A group's prompt is prefilled
once and forked into its members.

When the cache runs out of blocks, the newest sequence is preempted: its memory is freed, and it
is prefilled again from its tokens when room returns (recomputation, as vLLM does).

On a GPU the decode forward runs at fixed shapes, captured once per shape as a CUDA graph
(rl/rollout/decode_graphs.py): one launch per step instead of thousands. With
`prefill_graph_tokens` the short inputs of a step go through that step too, padded to a token
bucket, in a forward of their own (longer ones keep the eager prefill forward).

Tokens are sampled on the model's device. With `overlap` (on a GPU by default) a step is launched
before the last one's tokens are read back: the host's scheduling and bookkeeping run while the GPU
computes, instead of between two of its steps. A sequence whose last token is still on the device
then decodes it straight from there, on the guess that its turn goes on (the turn's token budget
is known; a stop token is not): when the token was a stop, the step fed it into the cache, as the
next turn would have, and the token it sampled is dropped. Turns end, and requests see it, a step
later than without overlap.

The model runs in a worker thread, so the event loop keeps accepting requests (and environment
replies keep arriving) while a forward is in flight: always the same thread, since each new thread
that runs torch on a CPU brings its own OpenMP team, and teams left spinning beside it slowed every
matrix product 1.6x on two cores. Weight updates wait for the forward in flight
and apply before the next one; sequences continue under the new weights (partial rollouts), each
token recording the version that sampled it."""
from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from policy.slot_cache import BLOCK_SIZE, CacheFull, SlotCache
from policy.transfer import to_device, to_host
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
    fed: int = 0  # tokens the cache holds: tokens[:fed], and (overlap) a sampled token not yet read back
    slot: int | None = None
    logits: torch.Tensor | None = None  # next-token logits (on the device) held for a turn to come
    logits_version: int = -1  # the weights that computed the held logits (a token sampled from them is theirs)
    turn: _Turn | None = None
    sampled: int = 0  # tokens accepted so far: the position in the sequence's random stream
    inflight: int = 0  # tokens sampled on the device, not yet read back
    routing: list[np.ndarray] = field(default_factory=list)  # per fed token [n_moe, k]
    fork_of: "_Seq | None" = None  # waiting to copy this sequence's cache once it is prefilled
    admitted: float = 0.0  # for preemption order (newest first)
    epoch: int = 0  # preemptions so far: what a step launched before one fed no longer counts
    error: Exception | None = None  # a failed step left its cache undefined: every later turn fails


@dataclass
class _Row:
    """One sequence's part of a launched step."""
    seq: _Seq
    epoch: int  # seq.epoch at launch
    routing: tuple[torch.Tensor, int, int] | None = None  # (host [B, T, n_moe, k], row, tokens fed)
    shares: list[tuple[_Seq, int]] = field(default_factory=list)  # forks since (and their epochs): same routing
    sample: int = -1  # the row of the step's sampled tokens drawn for `turn`, if any
    turn: _Turn | None = None
    version: int | None = None  # held logits' weights it sampled from (None: the launch's own)


@dataclass
class _Launch:
    """A step queued on the device, read back by `_resolve`."""
    rows: list[_Row]
    version: int  # the weights that sampled its tokens
    tokens: torch.Tensor | None = None  # [m] host, valid once `done` (with the rows' routing)
    logprobs: torch.Tensor | None = None
    done: torch.cuda.Event | None = None  # recorded after the launch's last copy to the host


class NativeEngine(RolloutEngine):
    def __init__(self, model: torch.nn.Module, max_slots: int = 64, cache_tokens: int = 65536,
                 block_size: int = BLOCK_SIZE, max_batch_tokens: int = 2048, record_routing: bool = True,
                 name: str = "native", decode_graphs: bool | None = None, compile_decode: bool = False,
                 decode_feed_tokens: int = 0, prefill_graph_tokens: int = 0, overlap: bool | None = None) -> None:
        """decode_graphs: decode at fixed shapes replayed as CUDA graphs; None means on a GPU. True on a
        CPU runs the fixed-shape step eagerly (what the graphs replay, for tests). compile_decode: that
        fixed-shape step compiled with torch.compile (on a GPU, what the graphs capture).
        decode_feed_tokens: inputs of at most this many tokens (tool results, short prompts) are fed
        one token a step inside the decode batch instead of by a prefill forward of their own: meant
        for CUDA graphs, where a replayed step costs less than an eager prefill's launches and the
        other sequences keep decoding meanwhile (on a CPU it only adds steps); in the GPU pipeline
        (benchmarks/RESULTS.md) it made rollout slower, so it is off by default. prefill_graph_tokens:
        with the fixed-shape step (decode_graphs), rows feeding 2 to this many tokens (tool results,
        a turn's short inputs) are prefilled by it too, padded to a token bucket (on a GPU a replayed
        graph instead of an eager forward's launches); longer ones by the general forward. overlap: launch
        each step before reading the last one's tokens back; None means on a GPU (on a CPU the
        steps run in order anyway: True there runs the same bookkeeping, for tests)."""
        self.model = model.eval()
        self.name = name
        self.record_routing = record_routing
        self.max_batch_tokens = max_batch_tokens
        num_blocks = max(1, -(-cache_tokens // block_size))
        self.cache = SlotCache(model, max_slots=max_slots, num_blocks=num_blocks, block_size=block_size)
        on_gpu = self.cache.device.type == "cuda"
        # the last step's sampled tokens, where the next step's rows can read their input
        self._sampled = torch.zeros(max_slots + 1, dtype=torch.long, device=self.cache.device)
        self._logprobs = torch.zeros(max_slots + 1, device=self.cache.device)
        # where launched steps' tokens and logprobs land on the host: two, for the step in flight and
        # the one being launched (pinned: copied without waiting)
        pinned = self.cache.device.type == "cuda"
        self._host_out = [(torch.zeros(max_slots + 1, dtype=torch.long, pin_memory=pinned),
                           torch.zeros(max_slots + 1, pin_memory=pinned)) for _ in range(2)]
        self._launches = 0
        fixed_shapes = compile_decode or (on_gpu if decode_graphs is None else decode_graphs)
        self._graphs = (DecodeGraphs(model, self.cache, record_routing, use_graphs=on_gpu, fed_back=self._sampled,
                                     compile=compile_decode) if fixed_shapes else None)
        self.overlap = on_gpu if overlap is None else overlap
        self._pending: _Launch | None = None  # the step launched last, not yet read back
        if decode_feed_tokens < 0:
            raise ValueError(f"NativeEngine: decode_feed_tokens must be >= 0, got {decode_feed_tokens}")
        self.decode_feed_tokens = decode_feed_tokens
        if prefill_graph_tokens < 0:
            raise ValueError(f"NativeEngine: prefill_graph_tokens must be >= 0, got {prefill_graph_tokens}")
        self.prefill_graph_tokens = prefill_graph_tokens if self._graphs is not None else 0
        self.seqs: dict[str, _Seq] = {}
        self.version = -1
        self._stats = EngineStats()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None  # held by a burst of steps; requests wait for it (`_hold`)
        self._callers = 0  # requests waiting for the lock
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-engine")  # every torch call
        self._device = model.lm_head.weight.device

    # ---- the contract (coroutines of the actor's event loop; they change state only between steps)
    async def start_group(self, seq_ids: list[str], prompt: list[int]) -> None:
        self._ensure_loop()
        if not prompt:
            raise ValueError("start_group: the prompt is empty")
        async with self._hold():
            now = time.monotonic()
            parent = _Seq(seq_ids[0], list(prompt), admitted=now)
            self.seqs[parent.seq_id] = parent
            for sid in seq_ids[1:]:
                self.seqs[sid] = _Seq(sid, list(prompt), fork_of=parent, admitted=now)
        self._wake.set()

    async def generate(self, seq_id: str, append: list[int], params: SamplingParams) -> TurnOutput:
        self._ensure_loop()
        async with self._hold():
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
            elif seq.fed == len(seq.tokens) and seq.logits is None and seq.slot is not None:
                # overlap fed the last turn's stop token and dropped what came after it: the cache
                # has no logits to continue from, so it is built again from the tokens
                self._preempt(seq)
                self._count("recomputed", 1)
            seq.turn = _Turn(params, asyncio.get_running_loop().create_future())
        self._wake.set()
        return await seq.turn.future

    async def finish(self, seq_id: str) -> SequenceRecord:
        self._ensure_loop()
        async with self._hold():
            seq = self.seqs.get(seq_id)
            if seq is not None and self._pending is not None and any(r.seq is seq for r in self._pending.rows):
                await self._settle()  # its record takes the routing of the step in flight
            seq = self.seqs.pop(seq_id, None)
            if seq is None:
                return SequenceRecord(fed_tokens=0)
            if seq.turn is not None and not seq.turn.future.done():
                seq.turn.future.cancel()
            seq.turn = None
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
        async with self._hold():
            self.model.load_state_dict(weights)
            self.version = version

    async def load_weights_with(self, load: Callable[[torch.nn.Module], int]) -> None:
        """Like update_weights, for a loader that writes into the model itself and returns the
        version it loaded (rl.weight_sync's buckets): run in a thread, between two forward passes."""
        self._ensure_loop()
        async with self._hold():
            self.version = await asyncio.get_running_loop().run_in_executor(self._worker, load, self.model)

    async def release_cache(self) -> int:
        """Free the cache's memory while the engine holds no sequence (a colocated learner steps
        meanwhile); the next sequence allocates it again. Returns the bytes freed (0 when busy)."""
        self._ensure_loop()
        async with self._hold():
            if self.seqs or self.cache.released:
                return 0
            await self._settle()
            freed = self.cache.release()
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            return freed

    @property
    def graph_capture_error(self) -> str | None:
        """Why the last failed capture of a CUDA graph failed (that step shape then runs eagerly;
        after MAX_CAPTURE_FAILURES, every step), or None."""
        return None if self._graphs is None else self._graphs.capture_error

    def stats(self) -> EngineStats:
        s = self._stats
        s.running = sum(q.slot is not None for q in self.seqs.values())
        s.waiting = sum(q.slot is None for q in self.seqs.values())
        s.extra["free_blocks"] = float(self.cache.free_blocks)
        g = self._graphs
        if g is not None:
            s.extra.update(graphs_captured=float(g.captured), graph_capture_s=g.capture_s,
                           graph_capture_failed=float(g.capture_failures))
        if g is not None and g.capture_error is not None:
            eager = "every step runs eagerly" if not g.use_graphs else "steps of those shapes run eagerly"
            s.problems = [f"CUDA graph capture failed {g.capture_failures} time(s), {eager}; "
                          f"the last: {g.capture_error}"]
        return s

    def _count(self, key: str, amount: float) -> None:
        self._stats.extra[key] = self._stats.extra.get(key, 0.0) + amount

    @contextlib.asynccontextmanager
    async def _hold(self):
        """The engine to oneself between two steps: a burst of steps (`_steps`) ends as soon as
        someone waits here."""
        self._callers += 1
        try:
            await self._lock.acquire()
        finally:
            self._callers -= 1
        try:
            yield
        finally:
            self._lock.release()

    async def _settle(self) -> None:
        """Read back the step in flight (the lock held)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await asyncio.get_running_loop().run_in_executor(self._worker, self._resolve, pending)

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
                        progressed = await asyncio.get_running_loop().run_in_executor(self._worker, self._steps)
                    except Exception as exc:  # noqa: BLE001 - a failed step fails its sequences, not the engine
                        progressed = False
                        self._pending = None
                        self._count("step_errors", 1)
                        error = RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}")
                        # a forward may have written part of any fed sequence's cache: none of them
                        # can go on, including those with no turn in flight (a group prompt's prefill)
                        for seq in self.seqs.values():
                            seq.error = error
                            self._fail(seq, error)
                    self._stats.busy_s += time.perf_counter() - started
                await asyncio.sleep(0)  # requests and weight updates get in between two steps

    def _steps(self) -> bool:
        """Steps back to back while they make progress and no request waits for the engine: each
        hand-off between the event loop and this thread costs tenths of a millisecond of host
        time, a good part of a GPU decode step. Requests (new turns, finishes, weight updates) get
        in after the step running when they arrive. Returns whether the last step made progress."""
        progressed = self._step()
        while progressed and not self._callers:
            progressed = self._step()
        return progressed

    @torch.no_grad()
    def _step(self) -> bool:
        """Launch what is waiting, then read back the step launched before (with overlap; else this
        one). Returns whether anything happened."""
        pending, self._pending = self._pending, None
        started = time.perf_counter()
        launch = self._launch(pending)
        self._count("launch_s", time.perf_counter() - started)  # host time: scheduling and queueing the step
        if pending is not None:
            self._resolve(pending)
        if launch is not None:
            if self.overlap:
                self._pending = launch
            else:
                self._resolve(launch)
        self._stats.steps += 1
        return launch is not None or pending is not None

    def _launch(self, pending: _Launch | None) -> _Launch | None:
        """One scheduling round on the device: feed what is waiting (one decode forward, one prefill
        forward), fork prefilled group prompts, sample every turn whose logits are ready. Nothing is
        read back; `pending`'s rows whose turns go on decode their sampled tokens from the device."""
        chosen: set[int] = set()  # fed this step: never preempted by a later one
        decode: list[_Seq] = []
        sources: list[int] = []  # per decode row: the row of `pending`'s samples it feeds, or -1
        for row in pending.rows if pending is not None else ():
            if self._goes_on(row) and self._make_room(row.seq, row.seq.fed + 1, chosen):
                chosen.add(id(row.seq))
                decode.append(row.seq)
                sources.append(row.sample)
        parents = {id(s.fork_of) for s in self.seqs.values() if s.fork_of is not None}
        # a sequence with a token still in flight waits for it (unless it decodes it, above)
        wanting = sorted((s for s in self.seqs.values() if s.fork_of is None and s.fed < len(s.tokens)
                          and s.error is None and s.inflight == 0 and id(s) not in chosen
                          and (s.turn is not None or id(s) in parents)),
                         key=lambda s: s.admitted)
        prefill: list[tuple[_Seq, int]] = []
        budget = self.max_batch_tokens
        for seq in wanting:
            todo = len(seq.tokens) - seq.fed
            take = 1 if todo <= max(1, self.decode_feed_tokens) else min(todo, budget)
            if take < 1 or not self._make_room(seq, seq.fed + take, chosen):
                continue
            chosen.add(id(seq))
            if take == 1:
                decode.append(seq)
                sources.append(-1)
                if todo > 1:  # a short input fed through the decode batch (its last token counts as decode)
                    self._stats.prefill_tokens += 1
            else:
                prefill.append((seq, take))
                budget -= take

        launch = _Launch([], self.version)
        parts: list[torch.Tensor] = []  # logits [rows, vocab] of this step's forwards, in row order
        # fed to the end this step: id -> (seq, its logits' row in `parts`, its row of the launch)
        ready: dict[int, tuple[_Seq, int, _Row | None]] = {}
        if decode:
            spec = [src >= 0 for src in sources]
            if any(spec):  # tokens decoded before the host read them
                self._count("fed_unread", sum(spec))
            logits, routing = self._feed(decode, [1] * len(decode), sources)
            for b, s in enumerate(decode):
                row = _Row(s, s.epoch, routing=None if routing is None else (routing, b, 1))
                launch.rows.append(row)
                if s.fed == len(s.tokens) + spec[b]:
                    ready[id(s)] = (s, b, row)
            parts.append(logits)
        # short inputs through the fixed-shape step (when on), longer ones through the general forward
        short = [(s, n) for s, n in prefill if n <= self.prefill_graph_tokens]
        for group in (short, [(s, n) for s, n in prefill if n > self.prefill_graph_tokens]):
            if not group:
                continue
            offset = sum(p.shape[0] for p in parts)
            seqs = [s for s, _ in group]
            logits, routing = self._feed(seqs, [n for _, n in group], [-1] * len(seqs))
            for b, (s, n) in enumerate(group):
                row = _Row(s, s.epoch, routing=None if routing is None else (routing, b, n))
                launch.rows.append(row)
                if s.fed == len(s.tokens):
                    ready[id(s)] = (s, offset + b, row)
            parts.append(logits)
        forked = self._fork_ready(ready, pending, launch)
        # turns to sample: those fed to the end now, and those whose logits were held from before
        held = [s for s in self.seqs.values() if s.logits is not None and s.turn is not None and s.fork_of is None]
        picks = sorted((pick for pick in ready.values() if pick[0].turn is not None), key=lambda pick: pick[1])
        rows_so_far = sum(p.shape[0] for p in parts)
        # a held token's row carries the version of the weights that computed its logits: sampled
        # after a weight update, it is still the older weights' token (staleness counts from those)
        held_rows = [_Row(s, s.epoch, version=s.logits_version) for s in held]
        picks += [(s, rows_so_far + i, row) for i, (s, row) in enumerate(zip(held, held_rows))]
        launch.rows += held_rows
        if held:
            parts.append(torch.stack([s.logits for s in held]))
            for s in held:
                s.logits = None
        # fed to the end with no turn to sample yet (a group's parent waiting for its turn): held
        for s, r, _ in ready.values():
            if s.turn is None:
                s.logits, s.logits_version = _row_of(parts, r).clone(), launch.version
        if picks:
            self._sample(launch, picks, parts)
        if not (decode or prefill or forked or picks):
            return None
        if self._device.type == "cuda":  # after every copy back (tokens, logprobs, routing): `_resolve` waits for it
            launch.done = torch.cuda.Event()
            launch.done.record()
        return launch

    def _goes_on(self, row: _Row) -> bool:
        """Whether `row` sampled for a turn that is still on and has room for a token after it:
        the next step can then decode the sampled token from the device, unread."""
        seq, turn = row.seq, row.turn
        return (turn is not None and seq.turn is turn and self.seqs.get(seq.seq_id) is seq
                and seq.epoch == row.epoch and seq.slot is not None and seq.error is None
                and len(turn.out.tokens) + seq.inflight < turn.params.max_new_tokens)

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
        """Free `seq`'s memory; it is prefilled again from its tokens (a token in flight is still
        accepted, and joins them)."""
        self.cache.free(seq.slot)
        seq.slot, seq.fed, seq.logits = None, 0, None
        seq.routing = []
        seq.epoch += 1
        self._count("preempted", 1)

    def _fork_ready(self, ready: dict[int, tuple[_Seq, int, _Row | None]], pending: _Launch | None,
                    launch: _Launch) -> bool:
        """Fork every member whose group prompt is fed to the end (now, or held from before): it
        shares the parent's logits (its `ready` row, or held logits) and the routing of the parent's
        steps not yet read back. Returns whether any forked."""
        forked = False
        for child in [s for s in self.seqs.values() if s.fork_of is not None]:
            parent = child.fork_of
            if parent.slot is None or parent.fed != len(parent.tokens) or parent.inflight:
                continue
            if id(parent) not in ready and parent.logits is None:  # (not yet fed to the end)
                continue
            child.fork_of = None
            try:
                child.slot = self.cache.alloc()
                self.cache.fork(parent.slot, child.slot)
            except CacheFull:  # no room now: it is prefilled on its own later
                if child.slot is not None:
                    self.cache.free(child.slot)
                    child.slot = None
                continue
            forked = True
            child.fed = parent.fed
            child.routing = list(parent.routing)
            for row in [*(pending.rows if pending is not None else ()), *launch.rows]:
                if row.seq is parent and row.epoch == parent.epoch:
                    row.shares.append((child, child.epoch))
            if id(parent) in ready:
                ready[id(child)] = (child, ready[id(parent)][1], None)
            else:
                child.logits, child.logits_version = parent.logits, parent.logits_version
        return forked

    def _feed(self, seqs: list[_Seq], take: list[int], sources: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed seqs[b] its next take[b] tokens (one token from the device where sources[b] >= 0):
        the fixed-shape step for one token each or up to `prefill_graph_tokens`, else the general
        forward. Returns the last fed token's logits [B, vocab] float32 (on the device; a fixed-shape
        step's may be overwritten by the next one of its kind, decode or prefill) and, when recorded,
        the routing on the host [B, T, n_moe, k] int16, valid once the step's event has passed."""
        if self._graphs is not None and (max(take) == 1 or max(take) <= self.prefill_graph_tokens):
            tokens = [[0] if src >= 0 else s.tokens[s.fed:s.fed + n] for s, n, src in zip(seqs, take, sources)]
            logits, routing = self._graphs.step([s.slot for s in seqs], tokens, sources)
        else:
            logits, routing = self._forward(seqs, take, sources)
        for s, n in zip(seqs, take):
            s.fed += n
            s.logits = None
        if max(take) > 1:
            self._stats.prefill_tokens += sum(take)
        if routing is not None:  # a copy: a decode step's routing buffer is written again by the next one
            routing = to_host(routing.to(torch.int16, copy=True))
        return logits.float(), routing

    def _forward(self, seqs: list[_Seq], take: list[int], sources: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        width = max(take)
        slots = [s.slot for s in seqs]
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.bool)
        for b, (s, n, src) in enumerate(zip(seqs, take, sources)):
            if src < 0:
                ids[b, :n] = torch.tensor(s.tokens[s.fed:s.fed + n])
            mask[b, :n] = True
        ids = to_device(ids, self._device)
        if any(src >= 0 for src in sources):  # rows whose token is the last step's sample, on the device
            src = to_device(torch.tensor(sources), self._device)
            ids[:, 0] = torch.where(src >= 0, self._sampled[src.clamp(min=0)], ids[:, 0])
        view = self.cache.view(slots, take, width)
        padded = min(take) < width
        out = self.model(ids, cache=view, use_cache=True, logits_to_keep=1, return_routing=self.record_routing,
                         token_mask=to_device(mask, self._device) if padded else None)
        self.cache.commit(slots, out.cache, take)
        routing = out.routing if self.record_routing and out.routing is not None else None
        return out.logits[:, -1], routing

    def _sample(self, launch: _Launch, picks: list[tuple[_Seq, int, _Row | None]], parts: list[torch.Tensor]) -> None:
        """One token for each picked turn (seq, its logits' row in `parts`, its row of the launch if
        it has one), on the device: into the fed-back buffer (the next step's rows may read them
        there), and copied to the host without waiting."""
        dev, m = self._device, len(picks)
        rows = [r for _, r, _ in picks]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(torch.tensor(rows), dev))
        params = [s.turn.params for s, _, _ in picks]
        tokens, logprobs = self._sampled[:m], self._logprobs[:m]
        if all(p.temperature <= 0 for p in params):  # what sample_tokens gives greedy rows, without the noise
            torch.argmax(logits, -1, out=tokens)
            logprobs.zero_()
        else:
            floats = to_device(torch.tensor([[p.temperature, p.top_p] for p in params], dtype=torch.float32), dev)
            ints = to_device(torch.tensor([[p.seed, s.sampled + s.inflight] for (s, _, _), p in zip(picks, params)],
                                          dtype=torch.long), dev)
            drawn, drawn_logprobs = sample_tokens(logits, floats[:, 0], floats[:, 1], ints[:, 0], ints[:, 1],
                                                  nucleus=any(p.top_p < 1 for p in params))
            tokens.copy_(drawn)
            logprobs.copy_(drawn_logprobs)
        host_tokens, host_logprobs = self._host_out[self._launches % 2]
        self._launches += 1
        launch.tokens, launch.logprobs = host_tokens[:m], host_logprobs[:m]
        launch.tokens.copy_(tokens, non_blocking=True)
        launch.logprobs.copy_(logprobs, non_blocking=True)
        for i, (s, _, row) in enumerate(picks):
            if row is None:  # sampled from a parent's logits: a row of its own
                row = _Row(s, s.epoch)
                launch.rows.append(row)
            row.sample, row.turn = i, s.turn
            s.inflight += 1

    def _resolve(self, launch: _Launch) -> None:
        """Read a launched step back: the fed tokens' routing, and each sampled token into its turn
        (unless that turn has ended since: a stop sampled the step before)."""
        if launch.done is not None:
            started = time.perf_counter()
            launch.done.synchronize()
            self._count("wait_s", time.perf_counter() - started)  # the host idle, the device still at work
        tokens = launch.tokens.tolist() if launch.tokens is not None else []
        logprobs = launch.logprobs.tolist() if launch.logprobs is not None else []
        for row in launch.rows:
            if row.routing is not None:
                host, b, n = row.routing
                part = host[b, :n].numpy()
                for seq, epoch in [(row.seq, row.epoch), *row.shares]:
                    if seq.epoch == epoch:
                        seq.routing.extend(part)
            if row.sample >= 0:
                self._accept(row, tokens[row.sample], logprobs[row.sample],
                             launch.version if row.version is None else row.version)

    def _accept(self, row: _Row, tok: int, logprob: float, version: int) -> None:
        seq, turn = row.seq, row.turn
        seq.inflight -= 1
        if seq.turn is not turn:  # the turn ended before this token (or the sequence was finished)
            return
        seq.tokens.append(tok)
        seq.sampled += 1
        turn.out.tokens.append(tok)
        turn.out.logprobs.append(logprob)
        turn.out.versions.append(version)
        self._stats.generated_tokens += 1
        stopped = tok in turn.params.stop_ids
        if stopped or len(turn.out.tokens) >= turn.params.max_new_tokens:
            turn.out.stopped = stopped
            seq.turn = None
            turn.future.get_loop().call_soon_threadsafe(_resolve, turn.future, turn.out)


def _row_of(parts: list[torch.Tensor], row: int) -> torch.Tensor:
    """Row `row` of the logits parts taken as one matrix."""
    for part in parts:
        if row < part.shape[0]:
            return part[row]
        row -= part.shape[0]
    raise IndexError(row)


def _resolve(future: asyncio.Future, value: TurnOutput) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
