"""The contract every rollout engine keeps (the native engine, vLLM, transformers' generate).

An engine serves many sequences at once. The rollout worker opens a GRPO group with one shared
prompt (`start_group`: prefilled once, then forked), and then asks for one assistant turn at a time
per sequence (`generate`), passing the environment's tokens (tool results, the next assistant
header) to append first. Token-in, token-out: the engine never sees text.

Every generated token comes with the logprob of the distribution it was drawn from (after
temperature and top-p, fp32) and the weight version that drew it: weights may change between two
tokens of one sequence (partial rollouts), and the learner needs to know.

Sampling is reproducible per sequence: `SamplingParams.seed` fixes the sequence's random stream, so
the same seed gives the same tokens however sequences are batched together (up to float noise of
batched kernels)."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy (logprobs are then reported as 0)
    top_p: float = 1.0
    stop_ids: frozenset[int] = frozenset()
    seed: int = 0  # the sequence's random stream; turns continue it


@dataclass
class TurnOutput:
    tokens: list[int]  # generated this turn; the last is a stop id when `stopped`
    logprobs: list[float]  # per token, of the processed distribution it was sampled from
    versions: list[int]  # per token, the weight version that sampled it
    stopped: bool  # ended on a stop id (False: the turn's token budget ran out)


@dataclass
class SequenceRecord:
    """What an engine knows of a sequence once it is finished."""

    fed_tokens: int  # tokens the model has consumed (all but the last sampled one; with the native engine's
    # overlapped steps, that one too when its turn ended on a stop)
    routing: np.ndarray | None = None  # int16 [fed_tokens, n_moe_layers, top_k]: experts chosen per fed token


@dataclass
class EngineStats:
    running: int = 0  # sequences holding a cache slot
    waiting: int = 0  # sequences queued for a slot
    steps: int = 0  # forward passes so far
    generated_tokens: int = 0
    prefill_tokens: int = 0
    busy_s: float = 0.0  # time spent in forward passes and sampling
    extra: dict[str, float] = field(default_factory=dict)
    # what went wrong and was worked around, a line each (a CUDA graph capture failed: decoding eagerly)
    problems: list[str] = field(default_factory=list)


WeightUpdate = dict[str, torch.Tensor]  # the learner's state_dict (its own parameter names)


class RolloutEngine(abc.ABC):
    """Async: many `generate` calls are in flight at once; the engine batches them."""

    name: str = ""  # recorded on every sample it produced
    version: int = -1  # weight version held; -1 until the first update

    @abc.abstractmethod
    async def start_group(self, seq_ids: list[str], prompt: list[int]) -> None:
        """Open one sequence per id, all starting with `prompt` (prefilled once, then shared)."""

    @abc.abstractmethod
    async def generate(self, seq_id: str, append: list[int], params: SamplingParams) -> TurnOutput:
        """Append `append` (environment tokens; may be empty) to the sequence, then sample one turn."""

    @abc.abstractmethod
    async def finish(self, seq_id: str) -> SequenceRecord:
        """Close a sequence (also one in the middle of a turn: that turn is abandoned) and free its
        memory; returns what the engine recorded for it."""

    @abc.abstractmethod
    async def update_weights(self, weights: WeightUpdate, version: int) -> None:
        """Load new weights between two forward passes. Sequences in flight continue under them."""

    async def release_cache(self) -> int:
        """Free cache memory while no sequence is open, allocated again when one opens; the bytes
        freed. Engines whose memory is not theirs to release (vLLM, transformers) free nothing."""
        return 0

    def stats(self) -> EngineStats:
        return EngineStats()

    def shutdown(self) -> None:
        """Release processes and memory (an engine must leave nothing running)."""
