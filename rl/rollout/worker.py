"""Rollout worker: a Ray actor (asyncio) that plays many GRPO groups at once with one engine.

Each group is a coroutine: reset its episodes on the environment worker, open the group in the
engine (prompt prefilled once), then play each member turn by turn (generate, step the
environment, append its reply), and grade. While one episode waits for a tool or a grader, the
engine decodes the others. Every sample records the weight version of each token it generated.

The effort level's budget (`WorkItem.max_new_tokens`) bounds the tokens an episode generates,
reasoning and response over all its turns: each turn may generate what the episode has left (every
engine honours max_new_tokens), less `effort.answer_reserve` tokens kept back. At the budget:
- a turn cut while reasoning is closed by the worker (the tokenizer's close tag, never trained on),
  and the model answers within the reserve: the turn counts as `forced`;
- a turn cut anywhere else continues into the reserve;
- a turn still cut when the budget is spent is never sent to the environment: the episode ends
  truncated (`budget_cut`) and is graded as it stands (no final answer, the sandbox as it is).
A turn cut by the context (rollout.max_context) is sent as it stands, as before budgets."""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any, Iterator

import numpy as np
import ray
import torch

from rl.config import EffortConfig, RolloutConfig
from rl.rollout.context import ELIDED, Turn, elide_tool_outputs
from rl.rollout.engine_api import EngineStats, RolloutEngine, SamplingParams, SequenceRecord, TurnOutput
from rl.rollout.env_worker import EpisodeEnd, EpisodeStart, StepReply
from rl.rollout.layout import stop_token_ids
from rl.shipping import ShippedDir, localize
from rl.types import EPISODE_PHASES, Sample, WorkItem, env_worker_index
from rl.weight_sync import SyncSpec, SyncTicket, WeightSink, receive_state


class NoWeightsError(RuntimeError):
    """The worker holds no policy weights (it was just started or restarted by Ray)."""


def member_seed(group_seed: int, member: int) -> int:
    """Each member of a group draws from its own random stream."""
    return (group_seed * 1_000_003 + member) % (1 << 62)


def build_engine(model_spec: dict[str, Any], cfg: RolloutConfig, seed: int) -> RolloutEngine:
    """The configured engine around the policy. A saved policy (`path`: rl eval) holds version 0;
    in training the engine holds no weights (version -1) until the learner's arrive. Call it inside
    the event loop that will use the engine (vLLM's engine is tied to one)."""
    torch.manual_seed(seed)
    saved = model_spec.get("path")
    version = 0 if saved else -1
    if cfg.engine == "native":
        from policy import build_policy, load_policy

        from kimi_kernels.fusion import set_fusion
        from rl.placement import actor_device, actor_gpu_share
        from rl.rollout.cache_budget import engine_cache_tokens
        from rl.rollout.native_engine import NativeEngine

        from policy.dtypes import device_precision, params_to

        if not cfg.fused_ops:
            set_fusion(False)  # this process's compiled elementwise chains (KIMI_FUSED_OPS=0 turns off all)
        device = actor_device()  # the engine runs where its model is, in the learner's precision there
        model = params_to((load_policy(saved) if saved else build_policy(model_spec)).to(device),
                          device_precision(device))
        # on a GPU the default budget is a share of what is free now that the model is loaded
        gpu = (torch.cuda.mem_get_info(device)[0], actor_gpu_share()) if device.type == "cuda" else None
        cache_tokens = engine_cache_tokens(cfg, model.config, model.lm_head.weight.dtype, gpu=gpu)
        graphs = cfg.cuda_graphs and device.type == "cuda"
        # short prefills at fixed shapes pay only as replayed graphs: eager (a CPU's compiled decode
        # step) their padding is wasted work
        engine = NativeEngine(model, max_slots=cfg.max_slots, cache_tokens=cache_tokens,
                              max_batch_tokens=cfg.max_batch_tokens, record_routing=cfg.record_routing,
                              decode_graphs=graphs, compile_decode=cfg.compile_decode,
                              decode_feed_tokens=cfg.decode_feed_tokens,
                              prefill_graph_tokens=cfg.prefill_graph_tokens if graphs else 0,
                              overlap=cfg.overlap_decode and device.type == "cuda")
        engine.version = version
        return engine
    model_dir = saved or model_spec["hf_path"]
    if cfg.engine == "transformers":
        from rl.rollout.hf_engine import TransformersEngine

        return TransformersEngine(model_dir, initial_version=version, threads=1)
    from rl.rollout.vllm_engine import VLLMEngine, check_servable

    v = cfg.vllm
    check_servable(model_dir, cfg.record_routing, v.dtype)
    return VLLMEngine(model_dir, dtype=v.dtype, max_model_len=v.max_model_len, max_num_seqs=v.max_num_seqs,
                      seed=seed, record_routing=cfg.record_routing, kv_cache_gib=v.kv_cache_gib,
                      memory_fraction=v.memory_fraction, initial_version=version,
                      verify_every_update=v.verify_every_update, enforce_eager=v.enforce_eager)


class RolloutWorker:
    answer_reserve = 0  # effort.answer_reserve: tokens of an episode's budget kept for a forced answer

    def __init__(self, model_spec: dict[str, Any], tokenizer: ShippedDir, env_worker_names: list[str],
                 cfg: RolloutConfig, seed: int, effort: EffortConfig | None = None) -> None:
        torch.set_num_threads(1)
        from policy import load_tokenizer

        self.tokenizer = load_tokenizer(str(tokenizer.local()))
        self._engine_args = (localize(model_spec), cfg, seed)
        self._engine: RolloutEngine | None = None  # built in the actor's event loop, on first use
        self.env_workers = [ray.get_actor(name) for name in env_worker_names]
        self.max_context = cfg.max_context
        self.stop_ids = frozenset(stop_token_ids(self.tokenizer))
        self.context_policy, self.keep_tool_outputs = cfg.context_policy, cfg.keep_tool_outputs
        self.elided = self.tokenizer.encode_tool_result(ELIDED)
        if effort is not None:
            self.answer_reserve = effort.answer_reserve

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            self._engine = build_engine(*self._engine_args)
        return self._engine

    async def ping(self) -> int:
        return os.getpid()

    async def shutdown(self) -> None:
        """Stop the engine's processes and memory (a vLLM engine runs its own)."""
        if self._engine is not None:
            self._engine.shutdown()

    async def set_weights(self, state: dict[str, torch.Tensor] | SyncTicket, version: int) -> int:
        """New weights: a whole state dict, or a bucketed sync's ticket from the learner's object-store
        transport: loaded straight into the native engine's model; the others take it as a state dict
        of views into the object store (one copy on the way, where the learner's state dict took
        pickling and three)."""
        if isinstance(state, SyncTicket):
            if not hasattr(self.engine, "load_weights_with"):
                state = await asyncio.to_thread(receive_state, state)
            else:
                if getattr(self, "weight_sink", None) is None:  # also after a restart: object store needs no group
                    await self.open_weight_sync(SyncSpec(transport="object_store"), 0)
                return await self.pull_weights(state)
        await self.engine.update_weights(state, version)
        return version

    # -- weight sync in buckets (rl.weight_sync; the scheduler does not call these yet) ---------
    async def open_weight_sync(self, spec: SyncSpec, rank: int) -> None:
        if not hasattr(self.engine, "load_weights_with"):
            raise ValueError(f"bucketed weight sync writes into the native engine's model; "
                             f"{type(self.engine).__name__} takes whole state dicts (set_weights)")
        device = next(self.engine.model.parameters()).device
        if getattr(self, "weight_sink", None) is not None:
            self.weight_sink.close()
        self.weight_sink = await asyncio.to_thread(WeightSink, spec, rank, device)  # waits for the group

    async def pull_weights(self, ticket: SyncTicket | None) -> int:
        """Take one sync from the learner (ticket None: over the broadcast group); the version held."""
        return await self.weight_sink.pull(self.engine, ticket)

    async def release_cache(self) -> int:
        """Free the engine's cache memory if it holds no sequence (rl.trainer asks before a
        colocated learner steps); the bytes freed. An engine not built yet holds nothing."""
        return 0 if self._engine is None else await self._engine.release_cache()

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    def _env_worker(self, item: WorkItem):
        return self.env_workers[env_worker_index(item.env, len(self.env_workers))]

    async def run_group(self, item: WorkItem) -> list[Sample]:
        if self.engine.version < 0:
            raise NoWeightsError("rollout worker has no weights yet: call set_weights first")
        env_worker = self._env_worker(item)
        ids = [f"{item.episode_prefix}/{i}" for i in range(item.group_size)]
        opened = list(ids)  # engine sequences to close if the group is abandoned (segments join)
        started = time.monotonic()
        start: EpisodeStart = await env_worker.reset_group.remote(item, ids)
        try:
            prompt = self.tokenizer.apply_chat_template(start.messages, effort=item.effort, add_generation_prompt=True,
                                                        tools=start.tools or None)
            if len(prompt) >= self.max_context:
                raise ValueError(f"prompt of task {item.task_id!r} in {item.env!r} is {len(prompt)} tokens, "
                                 f"over rollout.max_context={self.max_context}")
            await self.engine.start_group(ids, prompt)
            start_s = time.monotonic() - started
            episodes = await asyncio.gather(*[self._episode(item, i, sid, prompt, start, env_worker, opened, start_s)
                                              for i, sid in enumerate(ids)])
            return [sample for segments in episodes for sample in segments]
        except BaseException:  # failed or cancelled (aborted by the scheduler): free everything it holds
            await asyncio.shield(self._abandon(item.episode_prefix, opened, env_worker))
            raise

    async def _abandon(self, prefix: str, opened: list[str], env_worker) -> None:
        for sid in opened:
            await self.engine.finish(sid)
        await env_worker.abort.remote(prefix)

    async def _episode(self, item: WorkItem, member: int, sid: str, prompt: list[int], start: EpisodeStart,
                       env_worker, opened: list[str], start_s: float = 0.0) -> list[Sample]:
        """Play one episode; returns its samples: one, or one per segment when the context policy
        rebuilt its context (each trains on the tokens generated in it). start_s: the seconds its
        group took to start (Sample.phase_s)."""
        clock = _PhaseClock(start_s)
        seg, seg_id = _Segment(prompt), sid
        history: list[Turn] = []
        segments: list[tuple[_Segment, SequenceRecord]] = []
        append: list[int] = []
        turns, truncated, done = 0, False, False
        unstepped: list[dict[str, str]] = []  # a turn the budget cut: in the record, never sent to the environment
        budget = _Budget(item.max_new_tokens, self.answer_reserve if getattr(self.tokenizer, "reasoning", False) else 0)
        longest = 0  # the longest turn so far: what the next one is expected to need
        while turns < start.max_turns and not done:
            if (self.context_policy == "elide_tool_outputs" and history
                    and len(seg.tokens) + len(append) + min(budget.left, longest) >= self.max_context):
                rebuilt = elide_tool_outputs(prompt, history, self.elided, self.keep_tool_outputs)
                with clock.phase("generate"):  # the rebuilt context's prefill
                    segments.append((seg, await self.engine.finish(seg_id)))
                    seg, seg_id = _Segment(rebuilt), f"{sid}@{len(segments)}"
                    opened.append(seg_id)
                    await self.engine.start_group([seg_id], rebuilt)
                append = []
            room = self.max_context - len(seg.tokens) - len(append) - 1
            if budget.left <= 0 or room <= 0:
                truncated = True
                budget.cut = budget.left <= 0
                break
            with clock.phase("generate"):
                left = budget.left
                tokens, stopped = await self._turn(item, member, seg, seg_id, append, budget, room)
            turns += 1
            longest = max(longest, left - budget.left)
            if not stopped and budget.left <= 0:  # cut by the budget: never stepped, graded as it stands
                truncated = budget.cut = True
                unstepped = [{"role": "assistant", "content": self.tokenizer.decode(tokens), "cut": "budget"}]
                break
            with clock.phase("tools"):
                text = self.tokenizer.canonical_action(self.tokenizer.decode(tokens))
                reply: StepReply = await env_worker.step.remote(sid, text)
            done, truncated = reply.done, reply.truncated
            if not done:
                append = self.tokenizer.encode_tool_result(reply.observation)
                history.append(Turn(tokens, append))
        truncated = truncated or not done  # out of context or of turns while the episode went on
        with clock.phase("grade"):
            segments.append((seg, await self.engine.finish(seg_id)))
            end: EpisodeEnd = await env_worker.finish.remote(sid)
        return [Sample(
            uid=f"{item.uid}/{member}" + (f"@{k}" if k else ""), group_uid=item.uid, env=item.env,
            domain=start.domain, task_id=item.task_id, effort=item.effort, tokens=part.tokens,
            loss_mask=part.loss_mask, behavior_logprobs=part.logprobs, token_versions=part.versions,
            reward=float(end.grade.reward), passed=bool(end.grade.passed), grade_error=end.grade.error,
            grader_version=end.grade.grader_version, grade_details=end.grade.details, num_turns=turns,
            truncated=truncated, routing=part.routing(record), transcript=end.transcript + unstepped, engine=self.engine.name,
            segment=k, phase_s=clock.seconds, budget=budget.total, reasoning_tokens=part.reasoning,
            forced_turns=budget.forced, budget_cut=budget.cut)
            for k, (part, record) in enumerate(segments)]

    async def _turn(self, item: WorkItem, member: int, seg: "_Segment", seg_id: str, append: list[int],
                    budget: "_Budget", room: int) -> tuple[list[int], bool]:
        """One assistant turn within the episode's budget (see the module's docstring): the tokens
        the environment reads (a forced close tag included) and whether the turn ended on a stop."""
        def params(n: int) -> SamplingParams:
            return SamplingParams(max_new_tokens=n, temperature=item.temperature, top_p=item.top_p,
                                  stop_ids=self.stop_ids, seed=member_seed(item.seed, member))

        first = min(budget.left - budget.reserve if budget.left > budget.reserve else budget.left, room)
        out = await self.engine.generate(seg_id, append, params(first))
        seg.add(append, out)
        budget.left -= len(out.tokens)
        room -= len(out.tokens)
        tokens = list(out.tokens)
        if out.stopped or len(out.tokens) < first or budget.left <= 0 or room <= 0:
            seg.reasoning += self.tokenizer.reasoning_split(tokens)[0]
            return tokens, out.stopped
        thinking, still_open = self.tokenizer.reasoning_split(tokens)
        force = self.tokenizer.forced_answer_ids if still_open else []
        if force and room > len(force):  # close the reasoning; the model answers within the reserve
            budget.forced += 1
            more = await self.engine.generate(seg_id, force, params(min(budget.left, room - len(force))))
            seg.add(force, more)
            seg.reasoning += thinking + self.tokenizer.reasoning_split(more.tokens)[0]
            tokens += force + more.tokens
        else:  # cut outside reasoning: the turn goes on into the reserve
            more = await self.engine.generate(seg_id, [], params(min(budget.left, room)))
            seg.add([], more)
            tokens += more.tokens
            seg.reasoning += self.tokenizer.reasoning_split(tokens)[0]
        budget.left -= len(more.tokens)
        return tokens, more.stopped


class _Budget:
    """An episode's token budget: what is left, the reserve kept for a forced answer, what it cut."""

    def __init__(self, total: int, reserve: int) -> None:
        self.total, self.left, self.reserve = total, total, reserve
        self.forced = 0  # turns whose reasoning the worker closed
        self.cut = False  # the episode ended because the budget ran out


class _PhaseClock:
    """One episode's wall time by phase (Sample.phase_s), the group's start counted in each."""

    def __init__(self, start_s: float) -> None:
        self.seconds = {**dict.fromkeys(EPISODE_PHASES, 0.0), "start": start_s}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] += time.monotonic() - began


class _Segment:
    """The tokens of one context an episode was played in, and what was generated in it."""

    def __init__(self, context: list[int]) -> None:
        self.tokens, self.loss_mask = list(context), [0] * len(context)
        self.logprobs, self.versions = [0.0] * len(context), [-1] * len(context)
        self.reasoning = 0  # generated tokens of reasoning in this context

    def add(self, append: list[int], out: TurnOutput) -> None:
        self.tokens += append + out.tokens
        self.loss_mask += [0] * len(append) + [1] * len(out.tokens)
        self.logprobs += [0.0] * len(append) + out.logprobs
        self.versions += [-1] * len(append) + out.versions

    def routing(self, record: SequenceRecord) -> np.ndarray | None:
        """Experts per token, -1 for the tokens never fed (the last sampled one)."""
        if record.routing is None:
            return None
        routing = np.full((len(self.tokens), *record.routing.shape[1:]), -1, dtype=np.int16)
        routing[:record.routing.shape[0]] = record.routing
        return routing
