"""Tool use: a `search` tool over a small local corpus; graded on the final answer (exact match).

Two corpora, both generated deterministically from a seed (nothing to download):
- kind="keys": entries "amber-fox: 482"; the prompt names the key (toy level, learnable by copying).
  With values_per_key > 1 each key is the subject of that many tasks, each holding its own value for
  it (the search tool answers from the episode's task): the same prompt has several answers, so a
  policy must read the value from the tool; it cannot learn the answers by heart;
- kind="docs": short articles about fictional towns; the question asks for one fact.
A JSONL corpus of {"id", "text", "question", "answer"} rows can be used instead (corpus_file).
"""
from __future__ import annotations

import json
import os
import random
import re
from typing import Any

from envs.base import Environment, Tool
from envs.domains import check_counts
from envs.domains.mathcheck import extract_answer
from envs.grades import Grade, Grader
from envs.toolcall import format_tool_call

_ADJ = ["amber", "brisk", "calm", "dusty", "eager", "fuzzy", "giant", "hollow", "icy", "jolly", "keen", "lunar",
        "misty", "noble", "olive", "proud", "quiet", "rapid", "silver", "tidy", "urban", "vivid", "windy", "young"]
_NOUN = ["fox", "owl", "pine", "reef", "stone", "tiger", "wave", "cloud", "bell", "crow", "drum", "elk", "fern",
         "gate", "hawk", "iris", "jade", "kite", "lake", "moth", "nest", "oak", "pear", "quill", "rose"]
_TOWN_A = ["Bel", "Cor", "Dun", "Fal", "Gra", "Hol", "Kes", "Lor", "Mar", "Nor", "Ost", "Pel", "Ros", "Tam", "Vel"]
_TOWN_B = ["ford", "haven", "mere", "wick", "stead", "moor", "bury", "dale", "holm", "gate", "ton", "wyn"]
_RIVERS = ["Asha", "Brenn", "Calder", "Dova", "Esk", "Frome", "Glyde", "Hune"]
_TRADES = ["salt", "wool", "glass", "timber", "copper", "cheese", "paper", "rope"]


def normalise(text: str | None) -> str:
    return re.sub(r"\s+", " ", (text or "").strip().strip(".").strip().lower())


class LookupGrader(Grader):
    version = "1"
    timeout_s = 10.0

    def score(self, payload: dict[str, Any]) -> Grade:
        pred = extract_answer(payload.get("response"))
        ok = pred is not None and normalise(pred) == normalise(payload["gold"])
        return Grade(reward=1.0 if ok else 0.0, passed=ok, grader_version="", details={"extracted": pred})


def _key_question(key: str) -> str:
    return f"Find the value of {key}."


def _keys_corpus(seed: int) -> list[dict[str, str]]:
    rng = random.Random(f"lookup/keys/{seed}")
    keys = [f"{a}-{n}" for a in _ADJ for n in _NOUN]
    rng.shuffle(keys)
    return [{"id": k, "text": f"{k}: {rng.randint(100, 999)}", "answer": "", "question": ""} for k in keys]


def _docs_corpus(seed: int) -> list[dict[str, str]]:
    rng = random.Random(f"lookup/docs/{seed}")
    towns = [a + b for a in _TOWN_A for b in _TOWN_B]
    rng.shuffle(towns)
    rows = []
    for town in towns:
        year, pop = rng.randint(1100, 1950), rng.randint(800, 90000)
        river, trade = rng.choice(_RIVERS), rng.choice(_TRADES)
        text = (f"{town} is a market town on the river {river}. It was founded in {year} and is known for its "
                f"{trade} trade. Its population is {pop}.")
        field = rng.choice(["year", "river", "trade", "population"])
        question, answer = {
            "year": (f"In what year was {town} founded?", str(year)),
            "river": (f"On which river does {town} stand?", river),
            "trade": (f"Which trade is {town} known for?", trade),
            "population": (f"What is the population of {town}?", str(pop)),
        }[field]
        rows.append({"id": town, "text": text, "question": question, "answer": answer})
    return rows


class LookupEnv(Environment):
    """Look facts up with `search` and answer. Knobs: kind ("keys" | "docs"), n_train, n_heldout, top_k, seed,
    values_per_key (keys only)."""

    name = "lookup"
    domain = "tool_use"
    max_turns = 3

    def __init__(self, kind: str = "keys", n_train: int = 400, n_heldout: int = 100, top_k: int = 3,
                 seed: int = 0, corpus_file: str | None = None, values_per_key: int = 1, **kwargs: Any) -> None:
        if kind not in ("keys", "docs"):
            raise ValueError(f"lookup: unknown kind {kind!r}; expected 'keys' or 'docs'")
        if not 1 <= int(values_per_key) <= 8:
            raise ValueError(f"lookup: values_per_key must be between 1 and 8, got {values_per_key}")
        if int(values_per_key) > 1 and (kind != "keys" or corpus_file):
            raise ValueError("lookup: values_per_key applies to the generated keys corpus "
                             "(kind='keys', no corpus_file)")
        self.values_per_key = int(values_per_key)
        check_counts("lookup", n_train, n_heldout)
        if top_k < 1:
            raise ValueError(f"lookup: top_k must be at least 1, got {top_k}")
        self.kind, self.n_train, self.n_heldout, self.top_k, self.seed = kind, n_train, n_heldout, top_k, seed
        if corpus_file and not os.path.isfile(corpus_file):  # found now, read on first use
            raise FileNotFoundError(f"lookup: corpus_file not found: {corpus_file}")
        self.corpus_file = corpus_file
        # read or generated on first use: a run holds many lookup domains
        self._corpus: tuple[list[dict[str, str]], dict[str, dict[str, str]]] | None = None
        self.system_prompt = ("Use the search tool to look things up, then reply: The answer is <answer>."
                              if kind == "keys" else
                              "Answer using the search tool over the town gazetteer. Finish with: The answer is <answer>.")
        super().__init__(**kwargs)

    @classmethod
    def domains(cls, **kwargs: Any) -> dict[str, dict[str, Any]]:
        """One domain per generated corpus: each kind under 32 seeds (`keys-7`: other keys hold other values)."""
        return {f"{kind}-{seed}": {"kind": kind, "seed": seed} for kind in ("keys", "docs") for seed in range(32)}

    @property
    def corpus(self) -> list[dict[str, str]]:
        return self._loaded()[0]

    def _loaded(self) -> tuple[list[dict[str, str]], dict[str, dict[str, str]]]:
        """The corpus and its rows by lower-case id."""
        if self._corpus is None:
            if self.corpus_file:
                with open(self.corpus_file, encoding="utf-8") as fh:
                    rows = [json.loads(line) for line in fh if line.strip()]
            else:
                rows = _keys_corpus(self.seed) if self.kind == "keys" else _docs_corpus(self.seed)
            self._corpus = (rows, {row["id"].lower(): row for row in rows})
        return self._corpus

    def make_grader(self) -> Grader:
        return LookupGrader()

    def make_tools(self) -> list[Tool]:
        return [Tool(
            name="search",
            description="Search the local corpus; returns the best matching entries.",
            parameters={"type": "object", "properties": {"query": {"type": "string"}},
                        "required": ["query"], "additionalProperties": False},
            run=self.search,
        )]

    def search(self, query: str) -> str:
        """Exact id match first, then entries ranked by shared words (ties by corpus order)."""
        q = normalise(query)
        task = self._task
        if self.values_per_key > 1 and task is not None and q == task["key"]:
            return f"{task['key']}: {task['answer']}"  # the value this task holds for its key
        by_id = self._loaded()[1]
        if q in by_id:
            return by_id[q]["text"]
        words = set(re.findall(r"[a-z0-9]+", q))
        if not words:
            return "no results"
        scored = []
        for i, row in enumerate(self.corpus):
            overlap = len(words & set(re.findall(r"[a-z0-9]+", row["text"].lower())))
            if overlap:
                scored.append((-overlap, i, row["text"]))
        scored.sort()
        return "\n".join(text for _, _, text in scored[: self.top_k]) or "no results"

    def build_tasks(self) -> Any:
        if self.values_per_key > 1:
            return self._tasks_with_values_per_key()
        rows = list(self.corpus)
        rng = random.Random(f"lookup/tasks/{self.kind}/{self.seed}")
        rng.shuffle(rows)
        tasks = []
        for row in rows[: self.n_train + self.n_heldout]:
            if self.kind == "keys" and not self.corpus_file:
                question, answer = _key_question(row["id"]), row["text"].split(": ", 1)[1]
            else:
                question, answer = row["question"], row["answer"]
            tasks.append({"task_id": f"lookup-{self.kind}-{self.seed}-{row['id']}", "question": question,
                          "answer": answer, "key": row["id"]})
        n_held = min(self.n_heldout, len(tasks) // 5)
        return {"train": tasks[: len(tasks) - n_held], "heldout": tasks[len(tasks) - n_held:]}

    def _tasks_with_values_per_key(self) -> dict[str, list[dict[str, Any]]]:
        """values_per_key tasks a key, each with its own distinct value; held-out keys are never trained on."""
        v = self.values_per_key
        rng = random.Random(f"lookup/tasks/keys/{self.seed}/{v}")
        keys = [row["id"] for row in self.corpus]
        rng.shuffle(keys)
        n_keys = min(len(keys), -(-(self.n_train + self.n_heldout) // v))
        n_held_keys = min(-(-self.n_heldout // v), n_keys // 5)
        splits: dict[str, list[dict[str, Any]]] = {"train": [], "heldout": []}
        for i, key in enumerate(keys[:n_keys]):
            for j, value in enumerate(rng.sample(range(100, 1000), v)):
                splits["heldout" if i < n_held_keys else "train"].append({
                    "task_id": f"lookup-keys-{self.seed}-{key}-v{j}", "question": _key_question(key),
                    "answer": str(value), "key": key})
        for split, n in (("train", self.n_train), ("heldout", self.n_heldout)):
            rng.shuffle(splits[split])
            del splits[split][n:]
        return splits

    def prompt(self, task: dict[str, Any]) -> str:
        return task["question"]

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        return [format_tool_call("search", {"query": task["key"]}), f"The answer is {task['answer']}."]

    def grade_payload(self, task: dict[str, Any], final_answer: str | None) -> dict[str, Any]:
        return {"response": final_answer, "gold": task["answer"]}
