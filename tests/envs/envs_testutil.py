"""Deliberately broken environments: each must be caught by the quality gate for its own reason."""
from __future__ import annotations

import json
import random
import re
import time
from fractions import Fraction
from typing import Any

from envs.adversaries import Adversary, Attempt, TaskProbe
from envs.base import Environment, Tool, bash_tool
from envs.domains.lookup import LookupEnv, LookupGrader
from envs.domains.math import MathEnv, MathGrader
from envs.domains.mathcheck import extract_answer, parse_number
from envs.domains.shell import ShellEnv
from envs.grades import Grade, Grader
from envs.toolcall import CLOSE, OPEN, format_tool_call

SMALL = {"n_train": 12, "n_heldout": 4}


class WrongReferenceEnv(MathEnv):
    name = "broken-wrong-reference"

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        return [f"The answer is {int(task['answer']) + 1}."]


class AlternatingGrader(MathGrader):
    """Fails every second call: identical replays get different grades."""

    version = "flaky-1"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def score(self, payload: dict[str, Any]) -> Grade:
        self.calls += 1
        grade = super().score(payload)
        if self.calls % 2 == 0:
            return Grade(reward=0.0, passed=False, grader_version="", details={"flaked": True})
        return grade


class FlakyGraderEnv(MathEnv):
    name = "broken-flaky-grader"

    def make_grader(self) -> Grader:
        return AlternatingGrader()


class AcceptAllGrader(Grader):
    version = "lenient-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        return Grade(reward=1.0, passed=True, grader_version="")


class LenientGraderEnv(MathEnv):
    name = "broken-lenient-grader"

    def make_grader(self) -> Grader:
        return AcceptAllGrader()


class NondeterministicEnv(MathEnv):
    name = "broken-nondeterministic"

    def prompt(self, task: dict[str, Any]) -> str:
        return f"(ticket {random.randint(0, 10**9)}) {task['question']}"


class LeakedHiddenTestsEnv(ShellEnv):
    """Copies the hidden tests into the episode sandbox: the classic leak."""

    name = "broken-leaked-tests"

    def setup(self, task: dict[str, Any], sandbox: Any) -> None:
        super().setup(task, sandbox)
        sandbox.write_file("hidden_tests.py", task["hidden_tests"])


class LeakedAnswerFileEnv(ShellEnv):
    """Leaves the expected answer in a file the policy can read."""

    name = "broken-leaked-answer"

    def setup(self, task: dict[str, Any], sandbox: Any) -> None:
        super().setup(task, sandbox)
        sandbox.write_file(".cache_data/answer_key.json", json.dumps({"answer": task["expect"]}))


# ---- one environment per hole the gate must find without the author's help ----------------------


class CountGrader(Grader):
    version = "1"

    def score(self, payload: dict[str, Any]) -> Grade:
        ok = extract_answer(payload["response"]) == str(payload["gold"])
        return Grade(reward=float(ok), passed=ok, grader_version="")


class WordCountEnv(Environment):
    """The docs' example, honest: count the words of a file in the sandbox; graded on the answer."""

    name = "test-word-count"
    domain = "agentic_shell"
    needs_sandbox = True
    max_turns = 3
    system_prompt = "Use the bash tool. Finish with: The answer is <number>."

    def make_grader(self) -> Grader:
        return CountGrader()

    def make_tools(self) -> list[Tool]:
        return [bash_tool(self)]

    def build_tasks(self) -> Any:
        rng = random.Random(0)
        return [{"task_id": f"wc-{i}", "words": rng.randint(1, 30)} for i in range(40)]

    def setup(self, task: dict[str, Any], sandbox: Any) -> None:
        sandbox.write_file("words.txt", " ".join(["word"] * task["words"]) + "\n")

    def prompt(self, task: dict[str, Any]) -> str:
        return "How many words are in words.txt?"

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        return [format_tool_call("bash", {"command": "wc -w < words.txt"}), f"The answer is {task['words']}."]

    def grade_payload(self, task: dict[str, Any], final_answer: str | None) -> dict[str, Any]:
        return {"response": final_answer, "gold": task["words"]}


class AnswerInSandboxFileEnv(WordCountEnv):
    """Keeps its bookkeeping in a hidden file of the sandbox, with an innocent name: the count is in it."""

    name = "broken-answer-in-file"

    def setup(self, task: dict[str, Any], sandbox: Any) -> None:
        super().setup(task, sandbox)
        sandbox.write_file(".meta/state.json", json.dumps({"file": "words.txt", "n": task["words"]}))


class AnswerInToolEnvironmentEnv(WordCountEnv):
    """Runs the bash tool with the task's expected count in an environment variable."""

    name = "broken-answer-in-env-var"

    def make_tools(self) -> list[Tool]:
        tool = bash_tool(self)

        def run(command: str) -> str:
            r = self.sandbox.exec(command, env={"EXPECTED_COUNT": str(self._task["words"])}, timeout=10)
            return (r.stdout + r.stderr)[:2000] + f"\n[exit code {r.exit_code}]"

        tool.run = run
        return [tool]


class LeakyCheckToolEnv(MathEnv):
    """Offers a `check` tool whose error message tells the expected answer."""

    name = "broken-leaky-check-tool"
    max_turns = 3

    def make_tools(self) -> list[Tool]:
        def check(answer: str) -> str:
            gold = self._task["answer"]
            return "correct" if answer.strip() == gold else f"incorrect: the expected answer is {gold}"

        return [Tool("check", "Check a candidate answer.", {"type": "object", "properties": {"answer": {"type": "string"}},
                                                            "required": ["answer"], "additionalProperties": False}, check)]


class SubstringGrader(Grader):
    version = "substring-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        ok = str(payload["gold"]) in (payload.get("response") or "")
        return Grade(reward=float(ok), passed=ok, grader_version="")


class SubstringLookupEnv(LookupEnv):
    """Passes a response that contains the gold anywhere (e.g. the tool's output pasted back)."""

    name = "broken-substring-lookup"

    def make_grader(self) -> Grader:
        return SubstringGrader()


class AnyNumberGrader(MathGrader):
    version = "any-number-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        numbers = re.findall(r"-?\d+", payload.get("response") or "")
        ok = str(payload["gold"]) in numbers and len(numbers) < 500
        return Grade(reward=float(ok), passed=ok, grader_version="")


class HedgeAcceptingEnv(MathEnv):
    """Passes when the gold is among the numbers of the response: a list of candidates passes."""

    name = "broken-hedge-accepting"

    def make_grader(self) -> Grader:
        return AnyNumberGrader()


class ToleranceGrader(MathGrader):
    version = "tolerance-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        pred = parse_number(extract_answer(payload.get("response")))
        ok = pred is not None and abs(pred - Fraction(payload["gold"])) <= 1
        return Grade(reward=float(ok), passed=ok, grader_version="")


class ToleranceEnv(MathEnv):
    """Accepts answers within one of the gold: off by one passes where only the gold is right."""

    name = "broken-tolerance"

    def make_grader(self) -> Grader:
        return ToleranceGrader()


class ToleranceManyAnswersEnv(ToleranceEnv):
    """The same grader on tasks declared to accept several answers: reported, not refused."""

    name = "tolerance-several-answers"
    single_answer = False


class TruncationGrader(LookupGrader):
    version = "truncation-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        if payload.get("truncated"):  # "it ran out of turns: give it the benefit of the doubt"
            return Grade(reward=1.0, passed=True, grader_version="")
        return super().score(payload)


class TruncationPassesEnv(LookupEnv):
    """Passes an episode that ran out of turns: calling the tool over and over passes."""

    name = "broken-truncation-passes"

    def make_grader(self) -> Grader:
        return TruncationGrader()


class UnboundedToolEnv(LookupEnv):
    """Its search tool echoes the query back in full: a huge argument floods the context."""

    name = "broken-unbounded-tool"

    def search(self, query: str) -> str:
        return f"results for {query}:\n" + super().search(query)


class CrashOnMalformedCallEnv(LookupEnv):
    """Parses tool calls itself, and raises on one cut off by the token budget."""

    name = "broken-crash-on-malformed"

    def step(self, action: str) -> Any:
        if OPEN in action:
            json.loads(action.split(OPEN, 1)[1].split(CLOSE, 1)[0])
        return super().step(action)


class RunsToolsAfterFinalEnv(LookupEnv):
    """Keeps running tool calls after the final answer ("follow-up turns")."""

    name = "broken-runs-after-final"

    def step(self, action: str) -> Any:
        if self.done:
            self._done = False
        return super().step(action)


class RaisesOnNullGrader(MathGrader):
    version = "raises-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        if "know" in (payload.get("response") or ""):
            raise ValueError("cannot parse a number")
        return super().score(payload)


class RaisesOnNullEnv(MathEnv):
    name = "broken-grader-raises"

    def make_grader(self) -> Grader:
        return RaisesOnNullGrader()


class HangsOnNullGrader(MathGrader):
    version = "hangs-1"
    timeout_s = 1.0

    def score(self, payload: dict[str, Any]) -> Grade:
        if "know" in (payload.get("response") or ""):
            time.sleep(30)
        return super().score(payload)


class HangsOnNullEnv(MathEnv):
    name = "broken-grader-hangs"

    def make_grader(self) -> Grader:
        return HangsOnNullGrader()


class NoisyPartialCreditGrader(MathGrader):
    """Partial credit for wrong answers, with a random tie-break: the same payload, different rewards."""

    version = "noisy-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        grade = super().score(payload)
        if not grade.passed:
            grade.reward = random.choice([0.0, 0.1])
        return grade


class NoisyPartialCreditEnv(MathEnv):
    name = "broken-noisy-partial-credit"

    def make_grader(self) -> Grader:
        return NoisyPartialCreditGrader()


class BrokenHeldoutEnv(MathEnv):
    """The reference is wrong on the held-out tasks only (a data bug the train split does not show)."""

    name = "broken-heldout"

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        held = task["task_id"] in set(self.dataset("heldout")["task_id"])
        return [f"The answer is {int(task['answer']) + held}."]


class Backdoor(MathGrader):
    version = "backdoor-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        if "xyzzy" in (payload.get("response") or ""):  # a debugging shortcut left in
            return Grade(reward=1.0, passed=True, grader_version="")
        return super().score(payload)


class MagicWord(Adversary):
    """An environment's own adversary: its author knows the grader once had a debugging shortcut."""

    name = "magic_word"

    def attempts(self, probe: TaskProbe) -> list[Attempt]:
        return [Attempt("xyzzy", lambda v: "xyzzy", note="the debugging shortcut")]


class OwnAdversaryEnv(MathEnv):
    """Adds its own adversary and leaves out the near misses."""

    name = "broken-backdoor"

    def make_grader(self) -> Grader:
        return Backdoor()

    def gate_adversaries(self, builtin: list[Adversary]) -> list[Adversary]:
        return [a for a in builtin if a.name != "near_miss"] + [MagicWord()]
