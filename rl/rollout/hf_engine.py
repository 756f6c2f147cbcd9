"""TransformersEngine: the rollout engine contract (engine_api.py) over transformers' `model.generate`,
the slow baseline the vLLM engine is measured against.

One sequence runs at a time (a lock; `generate` runs in a thread so the event loop stays free): a
batched `generate` would share one random stream, and the contract wants each sequence's tokens
fixed by its own seed. Every turn re-reads the whole sequence (no cache kept between turns).
Logprobs are those of the processed distribution (`output_scores`: logits after temperature and
top-p), in float32."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rl.rollout.engine_api import EngineStats, RolloutEngine, SamplingParams, SequenceRecord, TurnOutput, WeightUpdate
from rl.rollout.vllm_engine import turn_seed


@dataclass
class _Seq:
    tokens: list[int]
    turn: int = 0
    closed: bool = False


class TransformersEngine(RolloutEngine):
    """`model`: a transformers causal LM, or the directory of one (loaded in `dtype`). Weight
    updates are its own state_dict (an HFPolicy learner's names are the same)."""

    name = "transformers"

    def __init__(self, model: nn.Module | str | Path, dtype: torch.dtype = torch.float32,
                 initial_version: int = 0, threads: int | None = None) -> None:
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        self.model = model.eval()
        self.version = initial_version
        self.threads = threads
        self._seqs: dict[str, _Seq] = {}
        self._lock = threading.Lock()
        self._stats = EngineStats()

    async def start_group(self, seq_ids: list[str], prompt: list[int]) -> None:
        for sid in seq_ids:
            if sid in self._seqs:
                raise ValueError(f"transformers engine: sequence {sid!r} is already open")
        for sid in seq_ids:
            self._seqs[sid] = _Seq(tokens=list(prompt))

    async def generate(self, seq_id: str, append: list[int], params: SamplingParams) -> TurnOutput:
        seq = self._seqs.get(seq_id)
        if seq is None or seq.closed:
            raise KeyError(f"transformers engine: no open sequence {seq_id!r}")
        seq.tokens.extend(append)
        self._stats.waiting += 1
        try:
            out = await asyncio.to_thread(self._generate, seq, params)
        finally:
            seq.turn += 1
        return out

    def _generate(self, seq: _Seq, params: SamplingParams) -> TurnOutput:
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        class _Closed(StoppingCriteria):  # finish() mid-turn abandons the turn at the next token
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), seq.closed, dtype=torch.bool)

        greedy = params.temperature == 0
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=not greedy, num_beams=1,
            temperature=None if greedy else params.temperature, top_p=None if greedy else params.top_p, top_k=0,
            eos_token_id=sorted(params.stop_ids) or None, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True)
        with self._lock:
            self._stats.waiting -= 1
            self._stats.running += 1
            start = time.perf_counter()
            try:
                if seq.closed:
                    return TurnOutput([], [], [], False)
                threads = torch.get_num_threads()
                if self.threads:
                    torch.set_num_threads(self.threads)
                with torch.random.fork_rng(), torch.no_grad():
                    torch.manual_seed(turn_seed(params.seed, seq.turn, 0))
                    ids = torch.tensor([seq.tokens], device=self.model.device)
                    res = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                              stopping_criteria=StoppingCriteriaList([_Closed()]))
                torch.set_num_threads(threads)
                version = self.version
            finally:
                self._stats.running -= 1
                self._stats.busy_s += time.perf_counter() - start
        new = res.sequences[0, len(seq.tokens):].tolist()
        if greedy:
            logprobs = [0.0] * len(new)
        else:
            logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(res.scores, new)]
        stopped = bool(new) and new[-1] in params.stop_ids
        seq.tokens.extend(new)
        self._stats.generated_tokens += len(new)
        self._stats.prefill_tokens += len(seq.tokens) - len(new)
        self._stats.steps += len(new)
        return TurnOutput(new, logprobs, [version] * len(new), stopped)

    async def finish(self, seq_id: str) -> SequenceRecord:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"transformers engine: no open sequence {seq_id!r}")
        seq.closed = True
        return SequenceRecord(fed_tokens=max(len(seq.tokens) - 1, 0))

    async def update_weights(self, weights: WeightUpdate, version: int) -> None:
        # a bucketed sync sends a tied weight once (under its first name): its other names may be absent
        every_name = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        tied = every_name - dict(self.model.named_parameters()).keys()

        def load() -> None:
            with self._lock:  # between two turns: never under a running generate
                missing, unexpected = self.model.load_state_dict(weights, strict=False)
                if set(missing) - tied or unexpected:
                    raise ValueError(f"transformers engine: the update does not match the model: missing "
                                     f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
                self.version = version

        await asyncio.to_thread(load)

    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(running=s.running, waiting=s.waiting, steps=s.steps, generated_tokens=s.generated_tokens,
                           prefill_tokens=s.prefill_tokens, busy_s=s.busy_s)

    def shutdown(self) -> None:
        """In-process: nothing runs once the last turn returns."""
        self._seqs.clear()
