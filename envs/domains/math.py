"""Math: generated arithmetic, fraction and multi-step word problems, graded by answer equivalence."""
from __future__ import annotations

import random
import re
from fractions import Fraction
from typing import Any, Callable

from envs.base import Environment
from envs.data import ensure_task_ids, load_tasks, normalise_splits
from envs.domains import check_counts
from envs.domains.mathcheck import equivalent, extract_answer
from envs.grades import Grade, Grader

KINDS = ("arithmetic", "fractions", "word")


ANSWER_STYLES = ("marker", "last_number")
_OP_NAMES = {"add": "+", "sub": "-", "addsub": "+-", "mul": "*"}  # the arithmetic domains' operations


def last_number(text: str | None, question: str = "") -> str | None:
    """The last number in a response: how small chat models answer ("17 + 25 = 42"). The question
    restated in the response is skipped: echoing "What is 0 + 5?" must not answer 5."""
    text = text or ""
    if question.strip():
        text = text.replace(question.strip(), " ")
    found = re.findall(r"-?\d+(?:\.\d+)?(?:/\d+)?", text.replace(",", ""))
    return found[-1] if found else None


class MathGrader(Grader):
    version = "1"
    timeout_s = 10.0

    def __init__(self, allow_expressions: bool = False, answer_style: str = "marker") -> None:
        self.allow_expressions = allow_expressions
        self.answer_style = answer_style
        if answer_style == "last_number":
            self.version = "2-last-number"  # another scoring: another version (no cache mix-up)

    def score(self, payload: dict[str, Any]) -> Grade:
        if self.answer_style == "last_number":
            pred = last_number(payload.get("response"), payload.get("question", ""))
        else:
            pred = extract_answer(payload.get("response"))
        ok = equivalent(pred, str(payload["gold"]), allow_expressions=self.allow_expressions)
        return Grade(reward=1.0 if ok else 0.0, passed=ok, grader_version="", details={"extracted": pred})


# draws in a row that repeat known questions before a small space counts as used up: the chance that one
# of its last questions is still undrawn then is below e^-25 for spaces of up to 200 questions
_EXHAUSTED_AFTER = 5000


def _unique(make: Callable[[random.Random], dict[str, Any]], rng: random.Random, count: int, seen: set[str]) -> list[dict[str, Any]]:
    """Draw `count` tasks whose questions are all new (so heldout never repeats a train question)."""
    out: list[dict[str, Any]] = []
    tries = misses = 0
    while len(out) < count and tries < count * 50 and misses < _EXHAUSTED_AFTER:
        tries += 1
        task = make(rng)
        if task["question"] not in seen:
            seen.add(task["question"])
            out.append(task)
            misses = 0
        else:
            misses += 1
    return out


def _arithmetic(max_operand: int, ops: str, n_terms: int) -> Callable[[random.Random], dict[str, Any]]:
    def make(rng: random.Random) -> dict[str, Any]:
        while True:
            nums = [rng.randint(0, max_operand) for _ in range(n_terms)]
            chosen = [rng.choice(ops) for _ in range(n_terms - 1)]
            expr = str(nums[0]) + "".join(f" {o} {n}" for o, n in zip(chosen, nums[1:]))
            value = eval(expr.replace("x", "*"), {"__builtins__": {}})  # our own generated digits and + - *
            if value >= 0:  # non-negative answers keep the toy vocabulary small
                return {"question": f"What is {expr.replace('*', 'x')}?", "answer": str(value)}

    return make


def _fractions(max_operand: int) -> Callable[[random.Random], dict[str, Any]]:
    def make(rng: random.Random) -> dict[str, Any]:
        a = Fraction(rng.randint(1, max_operand), rng.randint(2, max_operand))
        b = Fraction(rng.randint(1, max_operand), rng.randint(2, max_operand))
        op = rng.choice("+-")
        value = a + b if op == "+" else a - b
        return {"question": f"What is {a} {op} {b}? Give the answer as a fraction in lowest terms.", "answer": str(value)}

    return make


_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jia", "Kai", "Lena"]
_ITEMS = ["apples", "marbles", "stickers", "coins", "books", "shells", "pencils", "cards"]


def _word(max_operand: int) -> Callable[[random.Random], dict[str, Any]]:
    def make(rng: random.Random) -> dict[str, Any]:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        start = rng.randint(2, max_operand)
        bags, per_bag = rng.randint(2, 6), rng.randint(2, max(2, max_operand // 2))
        after_buy = start + bags * per_bag
        give = rng.randint(1, after_buy - 1)
        friends = rng.randint(2, 5)
        left = after_buy - give
        if rng.random() < 0.5 or left % friends:
            q = (f"{name} has {start} {item}. {name} buys {bags} bags with {per_bag} {item} in each bag, "
                 f"then gives away {give} {item}. How many {item} does {name} have now?")
            return {"question": q, "answer": str(left)}
        q = (f"{name} has {start} {item} and buys {bags} bags with {per_bag} {item} each. After giving away {give}, "
             f"{name} shares the rest equally among {friends} friends. How many {item} does each friend get?")
        return {"question": q, "answer": str(left // friends)}

    return make


class MathEnv(Environment):
    """Single-turn math. Knobs: kind, max_operand, ops, n_terms, n_train, n_heldout, seed, data_files,
    answer_style ("marker": the answer after "The answer is"; "last_number": the response's last
    number, the style of small pretrained chat models)."""

    name = "math"
    domain = "math"
    system_prompt = "Solve the problem. End with: The answer is <number>."
    max_turns = 1

    def __init__(
        self,
        kind: str = "arithmetic",
        max_operand: int = 20,
        ops: str = "+-",
        n_terms: int = 2,
        n_train: int = 400,
        n_heldout: int = 100,
        seed: int = 0,
        data_files: str | None = None,
        allow_expressions: bool = False,
        answer_style: str = "marker",
        **kwargs: Any,
    ) -> None:
        if answer_style not in ANSWER_STYLES:
            raise ValueError(f"math: unknown answer_style {answer_style!r}; expected one of {ANSWER_STYLES}")
        if kind not in KINDS:
            raise ValueError(f"math: unknown kind {kind!r}; expected one of {KINDS}")
        if not ops or set(ops) - set("+-*x"):
            raise ValueError(f"math: ops must be made of '+', '-', '*', got {ops!r}")
        if max_operand < 2 or n_terms < 2:
            raise ValueError("math: max_operand and n_terms must be at least 2")
        check_counts("math", n_train, n_heldout)
        self.kind, self.max_operand, self.ops, self.n_terms = kind, max_operand, ops.replace("x", "*"), n_terms
        self.n_train, self.n_heldout, self.seed, self.data_files = n_train, n_heldout, seed, data_files
        self.allow_expressions, self.answer_style = allow_expressions, answer_style
        if answer_style == "last_number":
            self.system_prompt = "Solve the problem."
            self.answer_in_prose = True  # "6, because ..." is the style, not a near miss
        super().__init__(**kwargs)

    @classmethod
    def domains(cls, **kwargs: Any) -> dict[str, dict[str, Any]]:
        """Its kinds by operation, operand range and length (`add-9x2`: a + b up to 9), fractions and
        word problems by operand range."""
        out: dict[str, dict[str, Any]] = {}
        for op_name, ops in _OP_NAMES.items():
            for max_operand in (3, 5, 9, 20, 50, 99):
                for n_terms in (2, 3) if op_name != "sub" else (2,):  # a - b - c is mostly negative
                    out[f"{op_name}-{max_operand}x{n_terms}"] = {"kind": "arithmetic", "ops": ops,
                                                                "max_operand": max_operand, "n_terms": n_terms}
        out.update({f"fractions-{m}": {"kind": "fractions", "max_operand": m} for m in (3, 5, 9, 12)})
        out.update({f"word-{m}": {"kind": "word", "max_operand": m} for m in (10, 20, 30)})
        return out

    def make_grader(self) -> Grader:
        return MathGrader(allow_expressions=self.allow_expressions, answer_style=self.answer_style)

    def build_tasks(self) -> Any:
        if self.data_files:  # user data: columns question, answer (task_id optional)
            data = load_tasks(self.data_files)
            if hasattr(data, "column_names") and isinstance(data.column_names, list):
                data = ensure_task_ids(data, "math")
            return normalise_splits(data, self.heldout_fraction, salt=self.name)
        make = {
            "arithmetic": lambda: _arithmetic(self.max_operand, self.ops, self.n_terms),
            "fractions": lambda: _fractions(self.max_operand),
            "word": lambda: _word(self.max_operand),
        }[self.kind]()
        rng = random.Random(f"math/{self.kind}/{self.seed}")
        seen: set[str] = set()
        tasks = _unique(make, rng, self.n_train + self.n_heldout, seen)
        if len(tasks) < 2:
            raise ValueError(f"math: the settings allow only {len(tasks)} distinct problems")
        n_held = min(self.n_heldout, len(tasks) // 5) if len(tasks) < self.n_train + self.n_heldout else self.n_heldout
        for i, t in enumerate(tasks):
            t["task_id"] = f"math-{self.kind}-{self.seed}-{i}"
        return {"train": tasks[: len(tasks) - n_held], "heldout": tasks[len(tasks) - n_held:]}

    def prompt(self, task: dict[str, Any]) -> str:
        return task["question"]

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        return [f"The answer is {task['answer']}."]

    def grade_payload(self, task: dict[str, Any], final_answer: str | None) -> dict[str, Any]:
        return {"response": final_answer, "gold": str(task["answer"]), "question": task["question"]}
