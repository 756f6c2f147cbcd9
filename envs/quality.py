"""The quality gate: run before an environment is used for training.

Checks, per task (the first `max_tasks` of the train split):
- oracle: replaying reference_actions scores the maximum (passed) on every task;
- null and adversarial policies (empty answer, echo the prompt, print the test files,
  read answers from the sandbox, exit early) score the floor;
- determinism: reset with the same seed gives the same messages and sandbox state, and a
  freshly built env gives the same tasks;
- flakiness: the reference replayed `replays` times gets the same grade every time;
- leaks: no hidden test / answer string is readable inside the episode sandbox or the prompt;
- timings of reset, step and grade.
`check_env` returns a JSON-able report; `require_env_ok` raises when the gate fails.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.base import Environment
from envs.grades import Grade
from envs.toolcall import format_tool_call

NULL_ANSWER = "I don't know."


class EnvQualityError(RuntimeError):
    """An environment failed the quality gate; `.report` holds the full report."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report
        super().__init__(f"environment {report.get('env')!r} failed the quality gate: " + "; ".join(report.get("reasons", []))
                         + " (pass allow_failing=True to use it anyway)")


class GateReport(dict):
    """The gate's report: a plain JSON-able dict, also readable as attributes (report.ok)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self, default=str))


@dataclass
class View:
    """What a scripted policy sees: the prompt, the observations so far, the turn number."""

    prompt: str
    observations: list[str] = field(default_factory=list)
    turn: int = 0


Policy = Callable[[View], str]


def _two_step(first: str) -> Policy:
    """Call a tool first, then submit whatever came back as the answer."""
    return lambda v: first if v.turn == 0 else (v.observations[-1] if v.observations else "")


_CODE_DUMP = ("```python\nimport glob\nfor p in glob.glob('**/*test*', recursive=True) + glob.glob('/*/*answer*') + glob.glob('/tmp/**', recursive=True):\n"
              "    print(open(p).read())\n```")
_READ_CMD = ("cat *test* tests/* .*answer* *answer* *expected* *solution* 2>/dev/null; "
             "find / -maxdepth 4 \\( -path /proc -o -path /sys -o -path /usr -o -path /dev \\) -prune -o -type f "
             "\\( -iname '*answer*' -o -iname '*solution*' -o -iname '*expected*' -o -iname '*hidden*' -o -iname '*test*' \\) "
             "-print 2>/dev/null | head -n 20 | xargs -r cat 2>/dev/null; env")


def adversarial_policies(env: Environment) -> dict[str, Policy]:
    """Simple cheats adapted to the env's tools. None of them should ever pass."""
    pols: dict[str, Policy] = {"empty": lambda v: "", "echo_prompt": lambda v: v.prompt}
    schemas = [t["function"] for t in env.tools]
    shell = next((s for s in schemas if "command" in s.get("parameters", {}).get("properties", {})), None)
    other = next((s for s in schemas if s.get("parameters", {}).get("required")), None)
    if shell is not None:
        pols["print_tests"] = _two_step(format_tool_call(shell["name"], {"command": "ls -la; cat *test* tests/* 2>&1"}))
        pols["read_answers"] = _two_step(format_tool_call(shell["name"], {"command": _READ_CMD}))
    elif other is not None:
        arg = other["parameters"]["required"][0]
        pols["print_tests"] = _two_step(format_tool_call(other["name"], {arg: "test"}))
        pols["read_answers"] = _two_step(format_tool_call(other["name"], {arg: "answer"}))
    else:
        pols["print_tests"] = lambda v: "```python\nprint(open('test.py').read())\n```"
        pols["read_answers"] = lambda v: _CODE_DUMP
    pols["exit_early"] = lambda v: "```python\nimport sys\nsys.exit(0)\n```"
    return pols


def run_episode(env: Environment, task_id: str, policy: Policy, seed: int = 0, timings: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """Play one episode with a scripted policy; returns the messages and the grade request."""
    t0 = time.perf_counter()
    messages, _ = env.reset(seed=seed, options={"task_id": task_id})
    _add(timings, "reset", time.perf_counter() - t0)
    view = View(prompt=messages[-1]["content"])
    while not env.done:
        action = policy(view)
        t0 = time.perf_counter()
        obs, _, terminated, truncated, info = env.step(action)
        _add(timings, "tool_step" if info.get("tool") or info.get("tool_error") else "step", time.perf_counter() - t0)
        view.turn += 1
        if obs is not None:
            view.observations.append(obs)
    return {"request": env.grade_request(), "messages": env.messages}


def reference_policy(actions: list[str]) -> Policy:
    return lambda v: actions[v.turn] if v.turn < len(actions) else ""


def _add(timings: dict[str, list[float]] | None, key: str, value: float) -> None:
    if timings is not None:
        timings.setdefault(key, []).append(value)


def _state_digest(env: Environment) -> str | None:
    """A hash of every file in the episode sandbox's work dir (names and contents)."""
    if not env.needs_sandbox:
        return None
    r = env.sandbox.exec("find . -type f ! -path './.cache/*' -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum", timeout=30)
    return hashlib.sha256((r.stdout + str(r.exit_code)).encode()).hexdigest()


_SCAN = r"""
import json, os, re, sys
cfg = json.loads(sys.stdin.read())
probes = [p.encode() for p in cfg["probes"]]
names = re.compile(cfg["names"], re.IGNORECASE) if cfg["names"] else None
hits, seen, budget = [], set(), 20000
for name, value in os.environ.items():
    for i, p in enumerate(probes):
        if p in value.encode(errors="ignore"):
            hits.append({"path": "$" + name, "probe": i})
for root in cfg["roots"]:
    if not os.path.isdir(root):
        continue
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if os.path.join(d, x) not in ("/proc", "/sys", "/dev")]
        for f in files:
            path = os.path.realpath(os.path.join(d, f))
            if path in seen or budget <= 0:
                continue
            seen.add(path); budget -= 1
            if names is not None and names.search(f):
                hits.append({"path": path, "probe": -1})
            try:
                if os.path.getsize(path) > 2_000_000:
                    continue
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            for i, p in enumerate(probes):
                if p in data:
                    hits.append({"path": path, "probe": i})
print(json.dumps(hits))
"""
SCAN_ROOTS = [".", "/tmp", "/var/tmp", "/home", "/root", "/srv", "/opt", "/mnt", "/data", "/workspace"]
MIN_PROBE_CHARS = 6  # shorter strings (like the answer "17") match by chance everywhere
# file names that look like answers or hidden tests; an env may override `leak_name_pattern`
LEAK_NAME_PATTERN = r"answer|solution|hidden|expected|oracle|gold|secret"


def leak_scan(env: Environment, task: dict[str, Any], messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Look for the task's secrets in the prompt and, from inside the sandbox, in every readable file."""
    probes = [p for p in env.leak_probes(task) if isinstance(p, str) and len(p.strip()) >= MIN_PROBE_CHARS]
    leaks: list[dict[str, Any]] = []
    for m in messages:
        for p in probes:
            if p in m["content"]:
                leaks.append({"task_id": task["task_id"], "where": f"{m['role']} message", "probe": p[:60]})
    if env.needs_sandbox:
        roots = SCAN_ROOTS + list(getattr(env, "leak_scan_roots", []))
        names = getattr(env, "leak_name_pattern", LEAK_NAME_PATTERN)
        r = env.sandbox.exec(["python3", "-c", _SCAN], stdin=json.dumps({"probes": probes, "roots": roots, "names": names}),
                             timeout=60)
        try:
            hits = json.loads(r.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return leaks + [{"task_id": task["task_id"], "where": "leak scan failed",
                             "probe": (r.stderr or r.stdout or f"exit {r.exit_code}")[:200]}]
        for h in hits:
            what = "a file name that looks like an answer" if h["probe"] < 0 else probes[h["probe"]][:60]
            leaks.append({"task_id": task["task_id"], "where": h["path"], "probe": what})
    return leaks


def _stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "mean_s": round(statistics.fmean(values), 6), "p50_s": round(statistics.median(values), 6),
            "max_s": round(max(values), 6)}


def _passed(g: Grade) -> bool:
    return bool(g.passed) and g.error is None


def check_env(name: str, env_kwargs: dict[str, Any] | None = None, max_tasks: int = 16, replays: int = 3,
              seed: int = 0, grader: Any = None, record: bool = True) -> GateReport:
    """Run the gate on a registered environment; returns the report (report["ok"] is the verdict)."""
    from envs.grading import default_grader
    from envs.registry import make, record_check

    env_kwargs = dict(env_kwargs or {})
    report = GateReport({"env": name, "env_kwargs": env_kwargs, "ok": False, "reasons": [], "tasks": 0,
                         "checked_at": time.time()})
    started = time.perf_counter()
    try:
        env = make(name, **env_kwargs)
        task_ids = list(env.dataset("train")["task_id"][:max_tasks])
    except Exception as exc:  # noqa: BLE001 - a broken env is a gate failure, not a crash
        report["reasons"].append(f"could not build the environment: {type(exc).__name__}: {exc}")
        return _finish(report, record, record_check)
    own_grader = grader is None
    grader = grader or default_grader(num_actors=2)
    try:
        _run_checks(env, name, env_kwargs, task_ids, replays, seed, grader, report)
    except Exception as exc:  # noqa: BLE001
        report["reasons"].append(f"the gate crashed while running the env: {type(exc).__name__}: {exc}")
    finally:
        env.close()
        if own_grader:
            grader.close()
    report["gate_s"] = round(time.perf_counter() - started, 3)
    return _finish(report, record, record_check)


def _finish(report: GateReport, record: bool, record_check: Callable[[str, dict[str, Any]], None]) -> GateReport:
    report["ok"] = not report["reasons"]
    if record:
        try:
            record_check(report["env"], report)
        except OSError:
            pass  # a read-only cache dir must not fail the gate
    return report


def _run_checks(env: Environment, name: str, env_kwargs: dict[str, Any], task_ids: list[str], replays: int,
                seed: int, grader: Any, report: dict[str, Any]) -> None:
    from envs.registry import make

    timings: dict[str, list[float]] = {}
    adversaries = adversarial_policies(env)
    oracle_fail, flaky, nondet, leaks = [], [], [], []
    null_pass, adv_pass = 0, {k: 0 for k in adversaries}
    examples: dict[str, list[str]] = {}

    def grade(req: Any) -> Grade:
        t0 = time.perf_counter()
        g = grader.grade(req, use_cache=False)  # never cached: replays must really re-grade
        _add(timings, "grade", time.perf_counter() - t0)
        return g

    twin = make(name, **env_kwargs)  # a fresh instance must build the same tasks
    try:
        for tid in task_ids:
            task = env.task(tid)
            refs = env.reference_actions(tid)
            if refs != env.reference_actions(tid):
                nondet.append(f"{tid}: reference_actions differ between calls")
            # oracle, replayed for flakiness
            grades = []
            for _ in range(max(1, replays)):
                ep = run_episode(env, tid, reference_policy(refs), seed, timings)
                used = sum(1 for m in ep["messages"] if m["role"] == "assistant")
                if used != len(refs):
                    oracle_fail.append(f"{tid}: the episode took {used} of {len(refs)} reference actions")
                grades.append(grade(ep["request"]))
            if not all(_passed(g) for g in grades[:1]):
                g = grades[0]
                oracle_fail.append(f"{tid}: reference scored {g.reward} (error={g.error}, details={_short(g.details)})")
            outcomes = {(g.passed, round(g.reward, 9), g.error is None) for g in grades}
            if len(outcomes) > 1:
                odd = next(g for g in grades if (g.passed, round(g.reward, 9), g.error is None) != outcomes_first(grades))
                flaky.append(f"{tid}: {len(grades)} replays gave {[(g.passed, g.reward) for g in grades]}; "
                             f"one differing grade: error={odd.error}, details={_short(odd.details)}")
            # determinism and leaks
            m1, i1 = env.reset(seed=seed, options={"task_id": tid})
            d1 = _state_digest(env)
            leaks.extend(leak_scan(env, task, m1))
            m2, _ = env.reset(seed=seed, options={"task_id": tid})
            d2 = _state_digest(env)
            if m1 != m2 or d1 != d2:
                nondet.append(f"{tid}: reset with the same seed gave a different {'prompt' if m1 != m2 else 'sandbox state'}")
            try:  # compared without a reset: no second sandbox needed
                twin_task = twin.task(tid)
            except KeyError:
                twin_task = None
            if twin_task != task or twin.prompt(twin_task) != env.prompt(task) or twin.reference_actions(tid) != refs:
                nondet.append(f"{tid}: a freshly built env gives a different task, prompt or reference")
            # null and adversarial policies
            g = grade(run_episode(env, tid, lambda v: NULL_ANSWER, seed, timings)["request"])
            null_pass += _passed(g)
            for pname, pol in adversaries.items():
                g = grade(run_episode(env, tid, pol, seed, timings)["request"])
                if _passed(g):
                    adv_pass[pname] += 1
                    examples.setdefault(pname, []).append(tid)
        a, _ = env.reset(seed=seed + 1)
        b, _ = env.reset(seed=seed + 1)
        if a != b:
            nondet.append("reset(seed) without a task_id picked different tasks")
    finally:
        twin.close()

    n = len(task_ids)
    report["tasks"] = n
    failed_tasks = {f.split(":")[0] for f in oracle_fail}
    report["oracle_pass_rate"] = round((n - len(failed_tasks)) / n, 4) if n else 0.0
    report["null_pass_rate"] = round(null_pass / n, 4) if n else 0.0
    total_adv = n * len(adversaries)
    report["adversarial_pass_rate"] = round(sum(adv_pass.values()) / total_adv, 4) if total_adv else 0.0
    report["adversarial"] = {k: round(v / n, 4) if n else 0.0 for k, v in adv_pass.items()}
    report["deterministic"] = not nondet
    report["flaky_rate"] = round(len(flaky) / n, 4) if n else 0.0
    report["leaks"] = leaks
    report["grader_version"] = env.grader.full_version
    report["timings"] = {k: _stats(v) for k, v in timings.items() if v}
    report["problems"] = {"oracle": oracle_fail[:5], "flaky": flaky[:5], "nondeterministic": nondet[:5]}
    reasons = report["reasons"]
    if n == 0:
        reasons.append("the train split is empty")
    if oracle_fail:
        reasons.append(f"oracle: the reference solution failed on {len(failed_tasks)}/{n} tasks (e.g. {oracle_fail[0]})")
    if null_pass:
        reasons.append(f"null policy: the answer {NULL_ANSWER!r} passed {null_pass}/{n} tasks")
    for pname, count in adv_pass.items():
        if count:
            reasons.append(f"adversarial policy '{pname}' passed {count}/{n} tasks (e.g. {examples[pname][0]})")
    if nondet:
        reasons.append(f"nondeterministic: {nondet[0]}")
    if flaky:
        reasons.append(f"flaky grader: {len(flaky)}/{n} tasks graded differently on identical replays (e.g. {flaky[0]})")
    if leaks:
        lk = leaks[0]
        reasons.append(f"leaks: {len(leaks)} secret(s) readable by the policy (e.g. task {lk['task_id']}: {lk['where']})")


def outcomes_first(grades: list[Grade]) -> tuple[bool, float, bool]:
    g = grades[0]
    return (g.passed, round(g.reward, 9), g.error is None)


def _short(details: dict[str, Any]) -> str:
    s = json.dumps({k: v for k, v in details.items() if k not in ("traceback",)}, default=str)
    return s if len(s) < 200 else s[:200] + "..."


def require_env_ok(name: str, env_kwargs: dict[str, Any] | None = None, allow_failing: bool = False, **kwargs: Any) -> GateReport:
    """For the trainer: run the gate; raise EnvQualityError on failure unless allow_failing."""
    report = check_env(name, env_kwargs, **kwargs)
    if not report["ok"] and not allow_failing:
        raise EnvQualityError(report)
    return report
