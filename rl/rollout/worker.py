"""Rollout worker: a Ray actor that plays GRPO groups of episodes with the current policy weights.

It owns a generation engine and talks to environment workers (reset/step) and, through them, to
the grader pool. Every sample records the weight version that produced it."""
from __future__ import annotations

import os
from typing import Any

import ray
import torch

from rl.rollout.engine import TorchEngine
from rl.rollout.layout import stop_token_ids
from rl.types import Sample, WorkItem, env_worker_index


class NoWeightsError(RuntimeError):
    """The worker holds no policy weights (it was just started or restarted by Ray)."""


class RolloutWorker:
    def __init__(self, model_spec: dict[str, Any], tokenizer_dir: str, env_worker_names: list[str],
                 max_context: int, record_routing: bool, seed: int) -> None:
        torch.set_num_threads(1)
        from policy import Tokenizer, build_model, from_pretrained

        self.tokenizer = Tokenizer.load(tokenizer_dir)
        torch.manual_seed(seed)
        if model_spec.get("path"):  # evaluating a saved policy: its weights are version 0
            model, self.weight_version = from_pretrained(model_spec["path"]), 0
        else:  # training: weights arrive from the learner
            model, self.weight_version = build_model(model_spec["preset"], **model_spec["overrides"]), -1
        self.engine = TorchEngine(model, record_routing=record_routing, seed=seed)
        self.env_workers = [ray.get_actor(name) for name in env_worker_names]
        self.max_context = max_context
        self.stop_ids = stop_token_ids(self.tokenizer)

    def ping(self) -> int:
        return os.getpid()

    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        self.engine.load_state_dict(state)
        self.weight_version = version
        return version

    def _env_worker(self, item: WorkItem):
        return self.env_workers[env_worker_index(item.env, len(self.env_workers))]

    def run_group(self, item: WorkItem) -> list[Sample]:
        if self.weight_version < 0:
            raise NoWeightsError("rollout worker has no weights yet: call set_weights first")
        env_worker = self._env_worker(item)
        episode_ids = [f"{item.uid}/{i}" for i in range(item.group_size)]
        start = ray.get(env_worker.reset_group.remote(item, episode_ids))
        prompt = self.tokenizer.apply_chat_template(start["messages"], effort=item.effort, add_generation_prompt=True)
        if len(prompt) >= self.max_context:
            ray.get(env_worker.abort.remote(item.uid))
            raise ValueError(f"prompt of task {item.task_id!r} in {item.env!r} is {len(prompt)} tokens, "
                             f"over rollout.max_context={self.max_context}")
        version = self.weight_version
        self.engine.start(prompt, item.group_size)
        active = list(range(item.group_size))
        turns = [0] * item.group_size
        truncated = [False] * item.group_size
        for _ in range(start["max_turns"]):
            if not active:
                break
            budget = min(item.max_new_tokens,
                         self.max_context - max(len(self.engine.rows[i].tokens) for i in active) - 1)
            if budget <= 0:
                for i in active:
                    truncated[i] = True
                break
            results = self.engine.generate_turn(active, budget, self.stop_ids, item.temperature, item.top_p)
            for i in active:
                turns[i] += 1
            actions = [(episode_ids[i], self.tokenizer.decode(results[i].new_tokens)) for i in active]
            replies = ray.get(env_worker.step_many.remote(actions))
            still = []
            for i, reply in zip(active, replies):
                if reply["done"]:
                    truncated[i] = truncated[i] or reply["truncated"]
                    continue
                self.engine.extend(i, self.tokenizer.encode_tool_result(reply["observation"]))
                if len(self.engine.rows[i].tokens) >= self.max_context:
                    truncated[i] = True
                    continue
                still.append(i)
            active = still
        grades = ray.get(env_worker.finish_many.remote(episode_ids))
        samples = []
        for i, (eid, grade) in enumerate(zip(episode_ids, grades)):
            row = self.engine.rows[i]
            n = len(row.tokens)
            samples.append(Sample(
                uid=eid, group_uid=item.uid, env=item.env, domain=start["domain"], task_id=item.task_id,
                effort=item.effort, tokens=row.tokens, loss_mask=row.loss_mask, behavior_logprobs=row.logprobs,
                weight_version=version, reward=grade["reward"], passed=grade["passed"],
                grade_error=grade["error"], grader_version=grade["grader_version"], num_turns=turns[i],
                transcript=grade["transcript"], grade_details=grade["details"],
                truncated=truncated[i] or i in active,  # still going when max_turns ran out
                routing=self.engine.routing_array(i, n),
            ))
        return samples
