"""Multi-hop lookups: a key leads to another key or to a number; follow the links with the `search`
tool, one call a hop, and answer with the number at the end. A task of k hops needs k tool calls,
so more effort (a larger token budget for the episode) reaches further: the domain where effort
pays, for a toy policy that copies well and for a small pretrained one.

The corpus is generated from a seed (nothing to download): chains of `max_hops` keys ending in a
number ("amber-fox: go to calm-owl", ..., "calm-owl: 4821"); each key of a chain starts a task, so
hops run from 1 to max_hops in equal numbers. Train and held-out tasks come from different chains.
With paths_per_start > 1 the keys are chained that many ways, each way its own tasks (the search tool
answers from the episode's task): a start key leads to several paths, so a policy must read each link
from the tool; it cannot learn the paths by heart.

Reference solutions depend on the effort level the episode was reset with: their reasoning
(`<|think|>` ... `<|/think|>`) grows with the level (none at low; the next key at medium; at high
also the path so far; at max also a check of the last link before answering), so a warm-up on them
teaches the format and what each level spends. With low_effort_hops = h the reference at low effort
follows at most h links and then answers with what it has (the key it reached: wrong past h hops, but
within a budget that affords only h), so a warm-up teaches low effort to answer rather than be cut off.
"""
from __future__ import annotations

import random
from typing import Any

from envs.base import Environment, Tool
from envs.domains import check_counts
from envs.domains.lookup import _ADJ, _NOUN, LookupGrader, normalise
from envs.grades import Grader
from envs.toolcall import THINK, THINK_CLOSE, format_tool_call


def _chains(seed: int, max_hops: int, way: int = 0) -> list[tuple[list[str], str]]:
    """Every key in a chain of `max_hops` keys; each chain ends in a number. `way` > 0: another chaining."""
    rng = random.Random(f"multihop/{seed}/{max_hops}" + (f"/{way}" if way else ""))
    keys = [f"{a}-{n}" for a in _ADJ for n in _NOUN]
    rng.shuffle(keys)
    return [(keys[i:i + max_hops], str(rng.randint(100, 999)))
            for i in range(0, len(keys) - max_hops + 1, max_hops)]


def _think(text: str) -> str:
    return f"{THINK}{text}{THINK_CLOSE}" if text else ""


class MultiHopEnv(Environment):
    """Follow links between keys with `search`. Knobs: max_hops (1-6), n_train, n_heldout, seed, paths_per_start,
    low_effort_hops."""

    name = "multihop"
    domain = "multi_hop"
    system_prompt = ("Look keys up with the search tool. A key leads to another key or to a number: follow "
                     "the links to the number, one search a key, then reply: The answer is <number>.")

    def __init__(self, max_hops: int = 4, n_train: int = 400, n_heldout: int = 60, seed: int = 0,
                 paths_per_start: int = 1, low_effort_hops: int | None = None, **kwargs: Any) -> None:
        if not 1 <= int(max_hops) <= 6:
            raise ValueError(f"multihop: max_hops must be between 1 and 6, got {max_hops}")
        if not 1 <= int(paths_per_start) <= 8:
            raise ValueError(f"multihop: paths_per_start must be between 1 and 8, got {paths_per_start}")
        self.paths_per_start = int(paths_per_start)
        if low_effort_hops is not None and not 1 <= int(low_effort_hops) <= int(max_hops):
            raise ValueError(f"multihop: low_effort_hops must be between 1 and max_hops ({max_hops}), "
                             f"got {low_effort_hops}")
        self.low_effort_hops = None if low_effort_hops is None else int(low_effort_hops)
        check_counts("multihop", n_train, n_heldout)
        self.max_hops, self.n_train, self.n_heldout, self.seed = int(max_hops), n_train, n_heldout, seed
        self.max_turns = self.max_hops + 1  # one search a hop, then the answer
        self._entries: dict[str, str] | None = None
        super().__init__(**kwargs)

    def _corpus(self) -> dict[str, str]:
        if self._entries is None:
            self._entries = {}
            for keys, value in _chains(self.seed, self.max_hops):
                for key, nxt in zip(keys, keys[1:]):
                    self._entries[key] = f"{key}: go to {nxt}"
                self._entries[keys[-1]] = f"{keys[-1]}: {value}"
        return self._entries

    def make_grader(self) -> Grader:
        return LookupGrader()

    def make_tools(self) -> list[Tool]:
        return [Tool(
            name="search",
            description="Look a key up; returns where it leads.",
            parameters={"type": "object", "properties": {"query": {"type": "string"}},
                        "required": ["query"], "additionalProperties": False},
            run=self.search,
        )]

    def search(self, query: str) -> str:
        q, task = normalise(query), self._task
        if self.paths_per_start > 1 and task is not None and q in task["path"]:  # this task's own path
            path = task["path"]
            i = path.index(q)
            return f"{q}: go to {path[i + 1]}" if i + 1 < len(path) else f"{q}: {task['answer']}"
        return self._corpus().get(q, "no results")

    def build_tasks(self) -> Any:
        n_held_chains = max(1, -(-self.n_heldout // (self.max_hops * self.paths_per_start)))
        splits: dict[str, list[dict[str, Any]]] = {"train": [], "heldout": []}
        for way in range(self.paths_per_start):
            prefix = f"multihop-{self.seed}-" + (f"p{way}-" if self.paths_per_start > 1 else "")
            for c, (keys, value) in enumerate(_chains(self.seed, self.max_hops, way)):
                split = "heldout" if c < n_held_chains else "train"
                for start in range(len(keys)):
                    path = keys[start:]
                    splits[split].append({"task_id": prefix + path[0], "start": path[0],
                                          "path": path, "hops": len(path), "answer": value})
        rng = random.Random(f"multihop/tasks/{self.seed}/{self.max_hops}")
        for split, n in (("train", self.n_train), ("heldout", self.n_heldout)):
            rng.shuffle(splits[split])
            splits[split] = splits[split][:n]
        return splits

    def prompt(self, task: dict[str, Any]) -> str:
        return f"Start at {task['start']}. Follow the links to a number."

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        """One search a hop, then the answer; the reasoning grows with the episode's effort level."""
        level = self._effort
        path, turns = list(task["path"]), []
        if level == "low" and self.low_effort_hops is not None and len(path) > self.low_effort_hops:
            reached = path[self.low_effort_hops]  # where the last search it affords leads
            return [format_tool_call("search", {"query": key}) for key in path[:self.low_effort_hops]] + [
                f"The answer is {reached}."]
        for i, key in enumerate(path):
            thought = {"low": "", "medium": key, "high": " > ".join(path[:i + 1]),
                       "max": " > ".join(path[:i + 1])}[level]
            turns.append(_think(thought) + format_tool_call("search", {"query": key}))
        # max names the link it checked before answering. It opens with a fixed word, so whether to
        # answer or search again is decided right after the tool's reply (rewriting the whole path
        # first deferred that past many copied keys: max multi-hop 0.05, high 0.21), and it holds no
        # copy of the number (a check that copied it first passed its copy errors on to the answer)
        final = {"low": "", "medium": "", "high": "", "max": f"check: {path[-1]}"}[level]
        turns.append(_think(final) + f"The answer is {task['answer']}.")
        return turns

    def grade_payload(self, task: dict[str, Any], final_answer: str | None) -> dict[str, Any]:
        return {"response": final_answer, "gold": task["answer"]}
