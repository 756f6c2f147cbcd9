"""Adversaries of the quality gate: scripted policies that try to pass a task without solving it.

The gate replays each task's reference solution first and hands every adversary a `TaskProbe`:
the reference's final answer and the answer inside it (the gold, as the reference writes it),
the tool outputs it saw, whether the final answer is graded at all, where else the gold can be
read (sandbox files, environment variables) and what words the sandbox shows. No adversary needs
the environment's author to say what is secret. Each returns `Attempt`s: a policy to play, and
whether a pass fails the gate (`must_fail`) or is only reported.

Add your own by subclassing `Adversary` and returning it from `Environment.gate_adversaries`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, ClassVar

from envs.base import Environment
from envs.domains.mathcheck import extract_answer
from envs.toolcall import OPEN, format_tool_call

NULL_ANSWER = "I don't know."
MIN_SECRET_CHARS = 6  # a shorter gold ("17") turns up by chance: it needs an answer-like context or a control
_ANSWER_CONTEXT = r"(?:answer|expected|solution|correct|gold|result|truth)[\w\"']{0,12}\W{0,4}(?:(?:is|was|be)\W{1,4})?"
_FENCE = re.compile(r"```[\w+-]*[ \t]*\n(.*?)```", re.DOTALL)
_NUMERIC = re.compile(r"[+-]?\d+(?:\.\d+)?(?:/\d+)?")
_INT_LITERAL = re.compile(r"(?<![\w.])\d+(?![\w.])")


@dataclass
class View:
    """What a scripted policy sees: the prompt, the observations so far, the turn number."""

    prompt: str
    observations: list[str] = field(default_factory=list)
    turn: int = 0


Policy = Callable[[View], str]


@dataclass(frozen=True)
class Attempt:
    """One scripted episode. `after_final` is a turn sent after the episode ended: the environment
    must refuse it (raise) rather than run it."""

    label: str
    policy: Policy
    must_fail: bool = True  # False: a pass is reported, not a gate failure
    note: str = ""
    after_final: str | None = None


@dataclass(frozen=True)
class Find:
    """A place outside the task's own work where the gold answer can be read."""

    where: str  # a sandbox path, or $NAME for an environment variable
    context: str = ""  # the text around it


@dataclass
class TaskProbe:
    env: Environment
    task: dict[str, Any]
    task_id: str
    split: str
    prompt: str
    reference: list[str]  # the reference actions
    final_answer: str | None  # the reference's last turn when it is an answer (not a tool call)
    gold: str | None  # the answer as it appears inside final_answer
    final_graded: bool  # False: the reference's tool turns pass whatever the final answer says
    reference_passed: bool
    tool_outputs: list[str]  # observations seen while replaying the reference
    finds: list[Find]  # where else the gold is readable (sandbox files, environment variables)
    sandbox_words: list[str]  # words readable in the sandbox's work dir at reset

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.env.tools]

    @property
    def answer_matters(self) -> bool:
        """Answer-based adversaries apply: the reference passes and its final answer is graded."""
        return self.reference_passed and self.gold is not None and self.final_graded

    def answering(self, answer: str) -> str:
        """The reference's final answer with its gold replaced by `answer` (same format)."""
        assert self.final_answer is not None and self.gold is not None
        i = self.final_answer.rfind(self.gold)
        return self.final_answer[:i] + answer + self.final_answer[i + len(self.gold):]

    def then_answer(self, final: str) -> Policy:
        """Do the reference's tool turns, then give `final` instead of its answer."""
        return script(self.reference[:-1] + [final])


class Adversary:
    """A family of cheats. `attempts` may return nothing when the family does not apply."""

    name: ClassVar[str] = ""

    def attempts(self, probe: TaskProbe) -> list[Attempt]:
        raise NotImplementedError(f"{type(self).__name__} must implement attempts()")


def clip(text: str, chars: int = 60) -> str:
    """Short enough for a one-line reason."""
    return text if len(text) <= chars else text[:chars] + "..."


def script(actions: list[str]) -> Policy:
    """Play fixed turns in order (an empty answer once they run out)."""
    return lambda v: actions[v.turn] if v.turn < len(actions) else ""


def answer_in(final: str | None) -> str | None:
    """The answer inside a final turn, as written there: the last code block, else an extracted
    answer ("The answer is 17." -> "17"), else the whole text."""
    if not final or not final.strip():
        return None
    blocks = _FENCE.findall(final)
    if blocks:
        gold = blocks[-1].strip("\n")
    else:
        gold = extract_answer(final) or final.strip()
    return gold if gold and gold in final else None


def gold_in(text: str, gold: str, strict: bool) -> bool:
    """Whether `gold` occurs in `text` as a whole token; strict (short golds): only where it reads
    as an answer (after "answer", "expected", ... or as the whole text), not as any number."""
    if text.strip() == gold.strip():
        return True
    token = r"(?<![\w.])" + re.escape(gold) + r"(?![\w])"
    if not strict:
        return re.search(token, text) is not None
    return re.search(_ANSWER_CONTEXT + token, text, re.IGNORECASE) is not None


def shell_tool(probe: TaskProbe) -> str | None:
    """The name of a tool that runs shell commands (a string parameter named `command`), if any."""
    for t in probe.tools:
        if t.get("parameters", {}).get("properties", {}).get("command", {}).get("type") == "string":
            return t["name"]
    return None


def _placeholder(spec: dict[str, Any], text: str) -> Any:
    kind = spec.get("type")
    return {"integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}.get(kind, text)


def agnostic_call(tool: dict[str, Any], text: str = "answer") -> str:
    """A well-formed call that knows nothing about the task."""
    props = tool.get("parameters", {}).get("properties", {})
    required = tool.get("parameters", {}).get("required", list(props))
    return format_tool_call(tool["name"], {k: _placeholder(props.get(k, {}), text) for k in required})


# ---- the built-in adversaries ------------------------------------------------------------------


class NullAnswer(Adversary):
    """Admit not knowing. Graders must score it at the floor and must not fail on it."""

    name = "null"

    def attempts(self, probe: TaskProbe) -> list[Attempt]:
        return [Attempt("i_dont_know", lambda v: NULL_ANSWER)]


_CODE_DUMP = ("```python\nimport glob\nfor p in glob.glob('**/*test*', recursive=True) + glob.glob('/*/*answer*') + glob.glob('/tmp/**', recursive=True):\n"
              "    print(open(p).read())\n```")
_READ_CMD = ("cat *test* tests/* .*answer* *answer* *expected* *solution* 2>/dev/null; "
             "find / -maxdepth 4 \\( -path /proc -o -path /sys -o -path /usr -o -path /dev \\) -prune -o -type f "
             "\\( -iname '*answer*' -o -iname '*solution*' -o -iname '*expected*' -o -iname '*hidden*' -o -iname '*test*' \\) "
             "-print 2>/dev/null | head -n 20 | xargs -r cat 2>/dev/null; env")


def _two_step(first: str) -> Policy:
    """Call a tool first, then submit whatever came back as the answer."""
    return lambda v: first if v.turn == 0 else (v.observations[-1] if v.observations else "")


class Cheats(Adversary):
    """Simple cheats adapted to the tools: empty answer, echo the prompt, print the test files,
    read answer-like files, exit early."""

    name = "cheat"

    def attempts(self, probe: TaskProbe) -> list[Attempt]:
        out = [Attempt("empty", lambda v: ""), Attempt("echo_prompt", lambda v: v.prompt)]
        shell = shell_tool(probe)
        other = next((t for t in probe.tools if t.get("parameters", {}).get("required")), None)
        if shell is not None:
            out.append(Attempt("print_tests", _two_step(format_tool_call(shell, {"command": "ls -la; cat *test* tests/* 2>&1"}))))
            out.append(Attempt("read_answers", _two_step(format_tool_call(shell, {"command": _READ_CMD}))))
        elif other is not None:
            out.append(Attempt("print_tests", _two_step(agnostic_call(other, "test"))))
            out.append(Attempt("read_answers", _two_step(agnostic_call(other, "answer"))))
        else:
            out.append(Attempt("print_tests", lambda v: "```python\nprint(open('test.py').read())\n```"))
            out.append(Attempt("read_answers", lambda v: _CODE_DUMP))
        out.append(Attempt("exit_early", lambda v: "```python\nimport sys\nsys.exit(0)\n```"))
        return out


class FoundAnswer(Adversary):
    """Answer with the gold found where the policy can read it without solving the task: a file
    in the sandbox (any name, hidden or not) or an environment variable; and answer with a tool
    output of the reference, verbatim, where it contains the gold (a grader that looks for the
    gold anywhere in the response accepts that)."""

    name = "found_answer"

    def attempts(self, probe: TaskProbe) -> list[Attempt]:
        if not probe.answer_matters:
            return []
        out = []
        if probe.finds and probe.tools:
            shell = shell_tool(probe)
            reads = []
            for f in probe.finds[:3]:
                if shell is not None:
                    cmd = f"printenv {f.where[1:]}" if f.where.startswith("$") else f"cat {_quote(f.where)}"
                    reads.append(format_tool_call(shell, {"command": cmd}))
            reads = reads[:max(0, probe.env.max_turns - 1)]  # keep the last turn for the answer
            where = ", ".join(f.where for f in probe.finds[:3])
            out.append(Attempt("sandbox", script(reads + [probe.final_answer or ""]),
                               note=f"the answer {clip(probe.gold)!r} is readable at {where}"))
        seen: set[str] = set()
        for obs in probe.tool_outputs:  # an output that is just the answer is a tool doing its job
            if obs not in seen and obs.strip() != probe.gold.strip() and gold_in(obs, probe.gold, strict=False) and len(seen) < 2:
                seen.add(obs)
                out.append(Attempt(f"tool_output_verbatim{len(seen) if len(seen) > 1 else ''}",
                                   probe.then_answer(obs), note="answered with a tool output that contains the answer"))
        return out


def _quote(path: str) -> str:
    return "'" + path.replace("'", "'\\''") + "'"


class Hedge(Adversary):
    """Answers holding many candidates, the gold among them (never first or last): all small
    integers, the words of the prompt and of the sandbox, several answers in one, other formats."""

    name = "hedge"

    def attempts(self, probe: TaskProbe) -> list[Attempt]:
        if not probe.answer_matters or "\n" in probe.gold or len(probe.gold) > 200:
            return []
        gold = probe.gold
        words = re.findall(r"[\w.+/-]{1,24}", probe.prompt) + probe.sandbox_words
        pool = ([str(i) for i in range(-10, 101)] if _NUMERIC.fullmatch(gold) else []) + words
        cands = [c for c in dict.fromkeys(pool) if c.strip(".") and c != gold][:150]
        if not cands:
            cands = [gold + "0", "0"]
        mid = len(cands) // 2 or 1
        cands = cands[:mid] + [gold] + cands[mid:]
        note = f"{len(cands)} candidates, the answer {clip(gold)!r} at position {mid + 1}"
        forms = {
            "list": probe.answering(", ".join(cands)),
            "or": probe.answering(" or ".join(cands)),
            "lines": "\n".join(probe.answering(c) for c in cands),
            "json": probe.answering(json.dumps(cands)),
            "boxed": " ".join(f"\\boxed{{{c}}}" for c in cands),
        }
        return [Attempt(label, probe.then_answer(text), note=note) for label, text in forms.items()]


class NearMiss(Adversary):
    """The reference answer perturbed: off by one, wrong sign, truncated, with extra text. Each
    must fail where a task has one right answer; elsewhere (`single_answer = False`) a pass is
    reported, not failed, and so is extra text where the answer is read out of prose
    (`answer_in_prose = True`)."""

    name = "near_miss"

    def attempts(self, probe: TaskProbe) -> list[Attempt]:
        if not probe.answer_matters:
            return []
        strict = probe.env.single_answer
        note = "" if strict else f"{probe.env.name} accepts several answers (single_answer=False): reported, not failed"
        prose = f"{probe.env.name} reads its answer out of prose (answer_in_prose=True): reported, not failed"
        out = []
        for label, wrong in near_misses(probe.gold).items():
            lenient = label == "extra_text" and probe.env.answer_in_prose
            out.append(Attempt(label, probe.then_answer(probe.answering(wrong)), must_fail=strict and not lenient,
                               note=(prose if lenient else note) or f"{clip(probe.gold)!r} -> {clip(wrong)!r}"))
        return out


def near_misses(gold: str) -> dict[str, str]:
    """Perturbations of an answer that should no longer be right."""
    out: dict[str, str] = {}
    if "\n" in gold:  # a program or a text block: change its last integer literal, drop its last line
        literals = list(_INT_LITERAL.finditer(gold))
        if literals:
            m = literals[-1]
            out["off_by_one"] = gold[:m.start()] + str(int(m.group()) + 1) + gold[m.end():]
        lines = gold.rstrip().splitlines()
        if len(lines) > 1:
            out["truncated"] = "\n".join(lines[:-1])
        return {k: v for k, v in out.items() if v != gold}
    if _NUMERIC.fullmatch(gold):
        value = Fraction(gold)
        one_more = value + 1
        out["off_by_one"] = str(one_more) if "." not in gold else f"{float(one_more):g}"
        if value:
            out["wrong_sign"] = gold[1:] if gold[0] == "-" else "-" + gold.lstrip("+")
    elif gold[-1:].isalnum():
        last = gold[-1]
        nxt = {"z": "a", "Z": "A", "9": "0"}.get(last, chr(ord(last) + 1))
        out["off_by_one"] = gold[:-1] + nxt
    if len(gold) >= 2 and gold[:-1].strip("+-./") != "":
        out["truncated"] = gold[:-1]
    out["extra_text"] = f"{gold} and some extra text"
    return {k: v for k, v in out.items() if v != gold}


MAX_JUNK_EPISODES = 3


class ToolAbuse(Adversary):
    """Tool calls that know nothing of the task: malformed, unknown tool, missing or ill-typed
    arguments, task-agnostic ones (`env`, `ls`, an empty query), the same call repeated until the
    turns run out, a call whose output is huge, and a call after the final answer. None may pass;
    where a tool output reveals the gold the junk-call policy answers with it (a leaking tool)."""

    name = "tool_abuse"

    def attempts(self, probe: TaskProbe) -> list[Attempt]:
        env, tools = probe.env, probe.tools
        after = agnostic_call(tools[0]) if tools else probe.final_answer or "The answer is 0."
        out = [Attempt("call_after_final", lambda v: NULL_ANSWER, after_final=after)]
        if not tools:
            return out
        junk = junk_calls(probe)
        # keep a turn to answer with what the calls revealed, where the answer matters
        per_episode = max(1, env.max_turns - 1) if probe.answer_matters else env.max_turns
        for i in range(0, min(len(junk), per_episode * MAX_JUNK_EPISODES), per_episode):
            label = "junk_calls" if i == 0 else f"junk_calls_{i // per_episode + 1}"
            out.append(Attempt(label, _junk_policy(probe, junk[i:i + per_episode])))
        shell = shell_tool(probe)
        repeated = (format_tool_call(shell, {"command": "env"}) if shell else agnostic_call(tools[0], ""))
        out.append(Attempt("repeated_call", lambda v: repeated))
        if shell is not None:
            huge = format_tool_call(shell, {"command": "head -c 3000000 /dev/zero | tr '\\0' x; echo"})
        else:
            huge = agnostic_call(tools[0], "x" * 200_000)
        out.append(Attempt("huge_output", script([huge, NULL_ANSWER])))
        return out


def junk_calls(probe: TaskProbe) -> list[str]:
    tools = probe.tools
    shell = shell_tool(probe)
    first = tools[0]
    props = first.get("parameters", {}).get("properties", {})
    required = first.get("parameters", {}).get("required", list(props))
    if shell is not None:
        calls = [format_tool_call(shell, {"command": "env"}), format_tool_call(shell, {"command": "ls -la . /tmp"})]
    else:
        calls = [agnostic_call(first, ""), agnostic_call(first, "answer")]
    calls.append(OPEN + '{"name": "' + first["name"] + '", "arguments": {')  # cut off mid-call
    calls.append(format_tool_call("no_such_tool", {}))
    calls.append(format_tool_call(first["name"], {}))
    if required:
        key = required[0]
        calls.append(format_tool_call(first["name"], {key: 12345 if props.get(key, {}).get("type") == "string" else "x"}))
    return calls


def _junk_policy(probe: TaskProbe, calls: list[str]) -> Policy:
    """Make the calls; once an observation reveals the gold, answer with it."""
    gold = probe.gold if probe.answer_matters else None

    def policy(v: View) -> str:
        if gold is not None and any(gold_in(o, gold, strict=len(gold) < MIN_SECRET_CHARS) for o in v.observations):
            return probe.final_answer or ""
        return calls[v.turn] if v.turn < len(calls) else NULL_ANSWER

    return policy


def builtin_adversaries() -> list[Adversary]:
    return [NullAnswer(), Cheats(), FoundAnswer(), Hedge(), NearMiss(), ToolAbuse()]
