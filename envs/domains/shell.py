"""Agentic shell: multi-turn tasks in a persistent sandbox, graded on the final sandbox state.

Kinds:
- "create_file" (toy): create file X containing Y; reference is one `echo` call;
- "fix_test": calc.py has a bug that test_calc.py exposes; fix calc.py. Graded by hidden
  tests run by the grader in a sandbox of its own (they never enter the episode sandbox);
- "sqlite": answer a question about shop.db by writing the answer to answer.txt.
grade_payload() copies the relevant files out of the sandbox, so the grader needs no
access to the episode's sandbox.
"""
from __future__ import annotations

import json
import os
import random
import sqlite3
import tempfile
from typing import Any

from envs.base import Environment, Tool, bash_tool
from envs.domains import check_counts
from envs.domains.judge import run_judge
from envs.grades import Grade, Grader
from envs.toolcall import format_tool_call

KINDS = ("create_file", "fix_test", "sqlite")
_FILES = ["notes.txt", "a.txt", "out.txt", "log.txt", "data.txt", "name.txt", "todo.txt", "b.txt",
          "msg.txt", "word.txt", "list.txt", "key.txt"]
_WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pepper", "violet", "candle", "rocket",
          "garden", "silver", "window", "forest", "lemon", "planet", "bridge", "coffee", "dragon", "falcon", "harbor",
          "island", "jungle", "kettle", "ladder", "marble", "needle", "orange", "pillow", "quartz", "saddle",
          "tunnel", "velvet", "walnut", "yellow", "zipper", "anchor", "button", "copper", "desert", "engine",
          "feather", "glacier", "hammer", "igloo", "jacket", "kitten", "lantern", "meadow"]
_CUSTOMERS = ["ana", "ben", "cai", "dora", "eli", "finn", "gia", "hugo"]
_ITEMS = ["pen", "cup", "lamp", "book", "sock", "mug", "fan", "hat"]
_STATUSES = ["shipped", "pending", "returned"]
_SQL_QUESTIONS = ("total", "count", "item")  # the sqlite tasks' questions, by rng.randrange(3)

# fix_test families: (function, argument, correct body, buggy body, input kind, parameter grid)
_BUGS: list[tuple[str, str, str, str, str, range]] = [
    ("scale", "x", "return x * {k}", "return x + {k}", "int", range(2, 40)),
    ("offset", "x", "return x + {k}", "return x - {k}", "int", range(2, 40)),
    ("is_multiple", "x", "return x % {k} == 0", "return x % {k} == 1", "int", range(3, 40)),
    ("count_above", "xs", "return sum(1 for x in xs if x > {k})", "return sum(1 for x in xs if x >= {k})", "list", range(2, 40)),
    ("last_n", "xs", "return xs[-{k}:]", "return xs[-{k}:-1]", "list", range(2, 9)),
    ("total_from", "xs", "return sum(xs[{k}:])", "return sum(xs[{k} + 1:])", "list", range(1, 9)),
]

# each kind's variants, the domains of the family: the file to create, the buggy function, the question
_VARIANTS = {"create_file": [f.split(".")[0] for f in _FILES], "fix_test": [b[0] for b in _BUGS],
             "sqlite": list(_SQL_QUESTIONS)}


class ShellGrader(Grader):
    """Checks captured final sandbox state: file contents, or hidden tests run in a fresh sandbox, in a process
    apart from calc.py's (envs/domains/judge.py), so calc.py can neither read them nor forge their verdict."""

    version = "2"
    timeout_s = 60.0

    def __init__(self, sandbox_backend: str = "auto") -> None:
        self.sandbox_backend = sandbox_backend

    def score(self, payload: dict[str, Any]) -> Grade:
        kind, files = payload["kind"], payload["files"]
        if kind in ("create_file", "sqlite"):
            path, want = payload["path"], payload["expect"]
            got = files.get(path)
            ok = got is not None and got.strip() == want.strip()
            return Grade(reward=float(ok), passed=ok, grader_version="",
                         details={"found": None if got is None else got[:80]})
        if kind == "fix_test":
            return self._hidden_tests(payload)
        raise ValueError(f"shell grader: unknown task kind {kind!r}")

    def _hidden_tests(self, payload: dict[str, Any]) -> Grade:
        source = payload["files"].get("calc.py")
        if source is None:
            return Grade(reward=0.0, passed=False, grader_version="", details={"reason": "calc.py is missing"})
        ok, r = run_judge(self.sandbox_backend, ("calc.py", source), "calc", payload["hidden_tests"], timeout=10.0)
        return Grade(reward=float(ok), passed=ok, grader_version="",
                     details={"exit_code": r.exit_code, "stderr_tail": (r.stderr or "")[-300:]})


def _create_file_tasks(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(f"shell/create/{seed}")
    tasks = [{"task_id": f"shell-create-{seed}-{f}-{w}", "kind": "create_file", "variant": f.split(".")[0],
              "path": f, "expect": w,
              "prompt": f"Create a file named {f} containing {w}.", "setup": "{}", "hidden_tests": ""}
             for f in _FILES for w in _WORDS]
    rng.shuffle(tasks)
    return tasks


def _bug_inputs(kind: str, k: int, rng: random.Random) -> list[Any]:
    if kind == "int":
        return [k - 1, k, k + 1, 2 * k, 0] + [rng.randint(-10, 3 * k) for _ in range(3)]
    out = []
    for n in (0, 3, 5, 8, 10, 12):
        xs = [rng.randint(-5, k + 10) for _ in range(n)]
        if n >= 3:
            xs[rng.randrange(n)] = k
        out.append(xs)
    return out


def _fix_test_tasks(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(f"shell/fix/{seed}")
    tasks = []
    for fn, arg, good_t, bad_t, kind, grid in _BUGS:
        for k in grid:
            good, bad = good_t.format(k=k), bad_t.format(k=k)
            ns: dict[str, Any] = {}
            exec(f"def {fn}({arg}):\n    {good}\n", ns)  # our own reference, to compute expected values
            bad_ns: dict[str, Any] = {}
            exec(f"def {fn}({arg}):\n    {bad}\n", bad_ns)
            cases = [(x, ns[fn](x)) for x in _bug_inputs(kind, k, rng)]
            failing = [c for c in cases if bad_ns[fn](c[0]) != c[1]]
            if not failing:
                continue  # the bug would be invisible: skip this parameter
            visible = failing[:2]
            hidden = [c for c in cases if c not in visible]
            visible_src = "from calc import {f}\n\n".format(f=fn) + "".join(
                f"assert {fn}({x!r}) == {y!r}, 'wrong result for {fn}({x!r})'\n" for x, y in visible) + "print('visible tests passed')\n"
            hidden_src = f"from calc import {fn}\n" + "".join(f"assert {fn}({x!r}) == {y!r}\n" for x, y in cases)
            files = {"calc.py": f"def {fn}({arg}):\n    {bad}\n", "test_calc.py": visible_src}
            tasks.append({
                "task_id": f"shell-fix-{seed}-{fn}-{k}", "kind": "fix_test", "variant": fn, "path": "calc.py",
                "expect": f"def {fn}({arg}):\n    {good}\n",
                "prompt": "The tests in test_calc.py fail (run: python3 test_calc.py). Fix the bug in calc.py.",
                "setup": json.dumps(files), "hidden_tests": hidden_src,
                "probe": "\n".join(f"assert {fn}({x!r}) == {y!r}" for x, y in hidden),
            })
    rng.shuffle(tasks)
    return tasks


def _make_db(rows: list[tuple[int, str, str, int, str]]) -> bytes:
    """The database file bytes, built on the host (identical bytes for identical rows)."""
    fd, path = tempfile.mkstemp(suffix=".db")
    os.close(fd)
    try:
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, item TEXT, qty INTEGER, status TEXT)")
        con.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)", rows)
        con.commit()
        con.close()
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)


def _sqlite_tasks(seed: int, n: int) -> list[dict[str, Any]]:
    rng = random.Random(f"shell/sqlite/{seed}")
    tasks = []
    for i in range(n):
        rows = [(j + 1, rng.choice(_CUSTOMERS), rng.choice(_ITEMS), rng.randint(1, 9), rng.choice(_STATUSES))
                for j in range(rng.randint(8, 20))]
        q = rng.randrange(3)
        if q == 0:
            c = rng.choice([r[1] for r in rows])
            text, sql = f"What is the total qty ordered by customer '{c}'?", f"SELECT SUM(qty) FROM orders WHERE customer='{c}'"
            answer = str(sum(r[3] for r in rows if r[1] == c))
        elif q == 1:
            s = rng.choice(_STATUSES)
            text, sql = f"How many orders have status '{s}'?", f"SELECT COUNT(*) FROM orders WHERE status='{s}'"
            answer = str(sum(1 for r in rows if r[4] == s))
        else:
            r = rng.choice(rows)
            text, sql = f"Which item does order {r[0]} contain?", f"SELECT item FROM orders WHERE id={r[0]}"
            answer = r[2]
        tasks.append({
            "task_id": f"shell-sqlite-{seed}-{i}", "kind": "sqlite", "variant": _SQL_QUESTIONS[q], "path": "answer.txt",
            "expect": answer,
            "prompt": f"The SQLite database shop.db has a table orders(id, customer, item, qty, status). {text} "
                      "Write just the answer to answer.txt.",
            "setup": json.dumps({"rows": rows}), "hidden_tests": sql,
        })
    return tasks


class ShellEnv(Environment):
    """Multi-turn shell tasks in a persistent sandbox. Knobs: kind, n_train, n_heldout, seed, max_turns."""

    name = "shell"
    domain = "agentic_shell"
    needs_sandbox = True
    system_prompt = "You work in a Linux shell. Use the bash tool, then reply Done."

    def __init__(self, kind: str = "create_file", n_train: int = 400, n_heldout: int = 100, seed: int = 0,
                 max_turns: int | None = None, tool_timeout_s: float = 10.0, variant: str | None = None,
                 **kwargs: Any) -> None:
        if kind not in KINDS:
            raise ValueError(f"shell: unknown kind {kind!r}; expected one of {KINDS}")
        if variant is not None and variant not in _VARIANTS[kind]:
            raise ValueError(f"shell: kind {kind!r} has no variant {variant!r}; it has {list(_VARIANTS[kind])}")
        check_counts("shell", n_train, n_heldout)
        self.kind, self.n_train, self.n_heldout, self.seed = kind, n_train, n_heldout, seed
        self.variant = variant  # one sort of the kind's tasks (a file, a bug's function, a question), or all
        self.tool_timeout_s = tool_timeout_s
        super().__init__(max_turns=max_turns if max_turns is not None else (3 if kind == "create_file" else 8), **kwargs)

    @classmethod
    def domains(cls, **kwargs: Any) -> dict[str, dict[str, Any]]:
        """One domain per variant of each kind: the file to create, the function with the bug, the question."""
        return {f"{kind}-{v}": {"kind": kind, "variant": v} for kind in KINDS for v in _VARIANTS[kind]}

    def make_grader(self) -> Grader:
        return ShellGrader(sandbox_backend=self.sandbox_backend)

    def make_tools(self) -> list[Tool]:
        return [bash_tool(self, timeout_s=self.tool_timeout_s)]

    def build_tasks(self) -> Any:
        total = self.n_train + self.n_heldout
        tasks = {"create_file": lambda: _create_file_tasks(self.seed), "fix_test": lambda: _fix_test_tasks(self.seed),
                 # a variant keeps about a third of the questions: draw enough of them
                 "sqlite": lambda: _sqlite_tasks(self.seed, total * (3 if self.variant else 1))}[self.kind]()
        if self.variant is not None:
            tasks = [t for t in tasks if t["variant"] == self.variant]
        for t in tasks:
            t.setdefault("probe", "")
        n_held = min(self.n_heldout, len(tasks) // 5)
        tasks = tasks[: self.n_train + n_held]
        return {"train": tasks[: len(tasks) - n_held], "heldout": tasks[len(tasks) - n_held:]}

    def setup(self, task: dict[str, Any], sandbox: Any) -> None:
        spec = json.loads(task["setup"])
        if task["kind"] == "fix_test":
            for path, text in spec.items():
                sandbox.write_file(path, text)
        elif task["kind"] == "sqlite":
            sandbox.write_file("shop.db", _make_db([tuple(r) for r in spec["rows"]]))

    def prompt(self, task: dict[str, Any]) -> str:
        return task["prompt"]

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        kind = task["kind"]
        if kind == "create_file":
            cmd = f"echo {task['expect']} > {task['path']}"
        elif kind == "fix_test":
            cmd = f"cat > calc.py <<'EOF'\n{task['expect']}EOF\npython3 test_calc.py"
        else:
            sql = task["hidden_tests"]
            cmd = f"python3 -c \"import sqlite3; print(sqlite3.connect('shop.db').execute(\\\"{sql}\\\").fetchone()[0])\" > answer.txt"
        return [format_tool_call("bash", {"command": cmd}), "Done."]

    def grade_payload(self, task: dict[str, Any], final_answer: str | None) -> dict[str, Any]:
        files = {task["path"]: self._read(task["path"])}
        payload: dict[str, Any] = {"kind": task["kind"], "path": task["path"], "files": files, "response": final_answer}
        if task["kind"] == "fix_test":
            payload["hidden_tests"] = task["hidden_tests"]
        else:
            payload["expect"] = task["expect"]
        return payload

    def leak_probes(self, task: dict[str, Any]) -> list[str]:
        if task["kind"] != "fix_test":
            return []  # create_file's answer is in the prompt by design; sqlite answers are short numbers
        return [line for line in task["probe"].splitlines() if line] + [task["expect"].splitlines()[1].strip()]

    def _read(self, path: str) -> str | None:
        try:
            return self.sandbox.read_file(path, max_bytes=65536).decode("utf-8", errors="replace")
        except Exception:  # noqa: BLE001 - a missing or unreadable file is simply absent state
            return None
