"""The quality gate at many domains: reports kept by code, data and settings (any change checks again),
and checks spread over Ray gate workers with one in-process grader each."""
from __future__ import annotations

import json
import time

from envs.families import match
from envs.gate_cache import GateCache
from envs.gate_parallel import check_all
from envs.quality import check_env
from envs.registry import register_file, resolve

ENV_FILE = '''
from envs import Environment, Grade, Grader


class EchoGrader(Grader):
    version = "1"

    def score(self, payload):
        ok = (payload["answer"] or "").strip() == payload["word"]
        return Grade(reward=float(ok), passed=ok, grader_version="")


class SayWord(Environment):
    name = "say-word"
    domain = "toy"

    def make_grader(self):
        return EchoGrader()

    def build_tasks(self):
        words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
        return {"train": [{"task_id": w, "word": w} for w in words[:8]],
                "heldout": [{"task_id": w, "word": w} for w in words[8:]]}

    def prompt(self, task):
        return "Say the word " + task["word"].upper() + " in lower case."

    def reference_actions_for(self, task):
        return [task["word"]]

    def grade_payload(self, task, final_answer):
        return {"answer": final_answer, "word": task["word"]}
'''


def _qa(path, answer="paris"):
    rows = [{"subset": "geo", "question": f"Capital {i}?", "answer": f"{answer}{i}"} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_report_is_kept_until_its_code_data_or_settings_change(tmp_path):
    cache = GateCache(tmp_path / "gate")
    data = _qa(tmp_path / "qa.jsonl")
    kwargs = {"data_files": str(data)}
    first = check_env("dataset:geo", kwargs, max_tasks=2, record=False, cache=cache)
    assert first["ok"] and not first.get("cached")
    again = check_env("dataset:geo", kwargs, max_tasks=2, record=False, cache=cache)
    assert again["cached"] and again["ok"] and again["adversarial"] == first["adversarial"]
    assert not check_env("dataset:geo", kwargs, max_tasks=3, record=False, cache=cache).get("cached")  # settings
    _qa(data, answer="rome")  # the data file's content
    assert not check_env("dataset:geo", kwargs, max_tasks=2, record=False, cache=cache).get("cached")
    source = tmp_path / "say_word.py"
    source.write_text(ENV_FILE)
    register_file(f"{source}:SayWord")
    assert not check_env("say-word", max_tasks=2, record=False, cache=cache).get("cached")
    assert check_env("say-word", max_tasks=2, record=False, cache=cache).get("cached")
    source.write_text(ENV_FILE + "\n# an edit\n")  # the environment's code
    assert not check_env("say-word", max_tasks=2, record=False, cache=cache).get("cached")


def test_a_failing_report_is_not_kept(tmp_path):
    cache = GateCache(tmp_path / "gate")
    source = tmp_path / "say_word.py"
    source.write_text(ENV_FILE.replace('return [task["word"]]', 'return ["wrong"]'))
    register_file(f"{source}:SayWord")
    assert not check_env("say-word", max_tasks=2, record=False, cache=cache)["ok"]
    assert not list((tmp_path / "gate").glob("*.json"))


def test_gate_workers_check_in_parallel_and_a_second_run_reads_the_cache(tmp_path, ray_session):
    cache = GateCache(tmp_path / "gate")
    data = _qa(tmp_path / "qa.jsonl")
    names = match("math:add-*")[:4] + match("lookup:keys-1*")[:3]
    checks = [(n, resolve(n), {}) for n in names] + [("dataset:geo", resolve("dataset:geo", {"data_files": str(data)}),
                                                       {"data_files": str(data)})]
    seen = []
    started = time.monotonic()
    first = check_all(checks, 2, workers=2, cache=cache, on_report=lambda name, r: seen.append(name))
    first_s = time.monotonic() - started
    assert list(first) == [c[0] for c in checks] and sorted(seen) == sorted(first)
    assert all(r["ok"] for r in first.values()), {n: r["reasons"] for n, r in first.items() if not r["ok"]}
    started = time.monotonic()
    second = check_all(checks, 2, workers=2, cache=cache)
    assert all(r["cached"] and r["ok"] for r in second.values())
    print(f"\n{len(checks)} domains: {first_s:.1f} s checked, {time.monotonic() - started:.1f} s from the cache")

