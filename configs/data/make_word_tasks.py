"""Writes word_tasks.parquet beside this file: the user-data family of configs/many_domains.yaml.

100 subsets (10 question templates x 10 vocabularies), 30 questions each; the answer is always a
word of the question, so a small policy can learn each subset from the text alone. Deterministic:

    .venv/bin/python configs/data/make_word_tasks.py
"""
from __future__ import annotations

import random
from pathlib import Path

import datasets

VOCABULARIES = {
    "animals": "cat dog owl fox bear wolf deer hare lynx mole seal frog newt toad yak",
    "colours": "red blue green amber teal pink gray black white gold cyan lime navy rust plum",
    "fruits": "apple pear plum fig kiwi lime date grape mango melon peach berry cherry lemon guava",
    "metals": "iron tin zinc lead gold silver copper nickel cobalt chrome bronze brass steel pewter",
    "tools": "saw drill hammer wrench chisel rasp file plane clamp level pliers shovel rake hoe axe",
    "trees": "oak ash elm fir pine yew birch alder beech cedar larch maple rowan spruce willow",
    "birds": "crow wren hawk kite lark swan dove gull rook tern heron robin finch eagle raven",
    "fish": "cod eel carp pike tuna hake ling sole bass trout perch shad dace chub bream",
    "music": "drum harp lute oboe tuba horn fife bell gong flute viola cello organ piano banjo",
    "ships": "boat raft barge canoe ferry yacht sloop ketch dhow junk punt skiff brig scow tug",
}
TEMPLATES = {  # name: (question from words w[0..3], index of the answer)
    "first": ("What is the first word of: {0} {1} {2}?", 0),
    "second": ("What is the second word of: {0} {1} {2}?", 1),
    "last": ("What is the last word of: {0} {1} {2}?", 2),
    "twice": ("Which word appears twice: {0} {1} {0} {2}?", 0),
    "after": ("Which word comes after {1} in: {0} {1} {2} {3}?", 2),
    "before": ("Which word comes before {2} in: {0} {1} {2} {3}?", 1),
    "pair": ("{0} goes with {1}. {2} goes with {3}. What goes with {2}?", 3),
    "quoted": ("Which word is quoted: {0} '{1}' {2}?", 1),
    "capital": ("Which word is in capitals: {0} {1} {2}?", 1),
    "missing": ("{0} {1} {2}. {0} {2}. Which word is missing from the second list?", 1),
}
PER_SUBSET = 30


def rows() -> list[dict[str, str]]:
    out = []
    for template, (text, answer_at) in TEMPLATES.items():
        for vocab, words in VOCABULARIES.items():
            rng = random.Random(f"{template}/{vocab}")
            seen: set[str] = set()
            pool = words.split()
            while len(seen) < PER_SUBSET:
                picked = rng.sample(pool, 4)
                if template == "capital":
                    picked[1] = picked[1].upper()
                question = text.format(*picked)
                if question in seen:
                    continue
                seen.add(question)
                subset = f"{template}-{vocab}"
                out.append({"subset": subset, "task_id": f"{subset}-{len(seen) - 1}", "question": question,
                            "answer": picked[answer_at],
                            "split": "heldout" if len(seen) > PER_SUBSET * 4 // 5 else "train"})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("word_tasks.parquet")
    datasets.Dataset.from_list(rows()).to_parquet(str(path))
    print(f"{path}: {len(rows())} questions")
