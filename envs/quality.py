"""The quality gate: run before an environment is used for training.

On every split (train and heldout; `max_tasks` tasks of each, all by default):
- oracle: replaying reference_actions scores the maximum (passed) on every task;
- flakiness: the reference replayed `replays` times gets the same grade every time;
- adversaries (envs.adversaries, pluggable per environment) never pass: the null answer, simple
  cheats, answers found where the policy can read them (sandbox files, environment variables,
  tool outputs), hedges, near misses of the reference answer (reported, not failed, where tasks
  accept several answers), tool-call abuse. None needs the author to say what is secret;
- the environment survives them: no exception from reset/step, tool outputs stay bounded, no turn
  is accepted after the final answer;
- grader consistency: every grade comes back without an error (a grader that raises or hangs
  fails the gate with its error; a hang stops the gate), and the same payloads graded again, in
  reverse order, get the same grades (no hidden state);
- determinism: reset with the same seed gives the same messages and sandbox state, and a freshly
  built env gives the same tasks;
- leaks: the author's `leak_probes` and answer-like file names are not readable in the sandbox;
- timings of reset, step, scan and grade.
`check_env` returns a JSON-able report whose `reasons` are one line each, naming the adversary and
a task; `findings` hold the transcripts of passing adversaries. `require_env_ok` raises on failure.
"""
from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from envs.adversaries import (MIN_SECRET_CHARS, NULL_ANSWER, Adversary, Attempt, Find, Policy, TaskProbe,
                              answer_in, builtin_adversaries, gold_in)
from envs.base import Environment
from envs.data import SPLITS
from envs.gate_cache import GateCache, cache_key
from envs.gate_episodes import Episode, GateSandboxes, add_timing, reference_policy, run_episode, state_digest
from envs.grades import Grade, GradeRequest
from envs.grading import timed_out
from envs.sandbox_scan import LEAK_NAME_PATTERN, SCAN_ROOTS, ScanResult, scan_sandbox
from envs.toolcall import parse_turn

if TYPE_CHECKING:
    from envs.registry import EnvRecipe

MAX_OBSERVATION_CHARS = 20_000  # a tool output longer than this would flood the policy's context
CONSISTENCY_TASKS = 2  # per split: every payload of these tasks is graded a second time, in reverse order
MAX_FINDINGS = 3  # transcripts kept per adversary attempt
TRANSCRIPT_CHARS = 2000
MIN_PROBE_CHARS = MIN_SECRET_CHARS  # shorter author probes (like "17") match by chance everywhere


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


def _stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "mean_s": round(statistics.fmean(values), 6), "p50_s": round(statistics.median(values), 6),
            "max_s": round(max(values), 6)}


def _passed(g: Grade) -> bool:
    return bool(g.passed) and g.error is None


def _outcome(g: Grade) -> tuple[bool, float, bool]:
    return (bool(g.passed), round(float(g.reward), 9), g.error is None)


def _short(details: dict[str, Any]) -> str:
    s = json.dumps({k: v for k, v in details.items() if k not in ("traceback",)}, default=str)
    return s if len(s) < 200 else s[:200] + "..."


def _transcript(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        text = m["content"]
        if len(text) > TRANSCRIPT_CHARS:
            text = text[:TRANSCRIPT_CHARS] + f"... [{len(text) - TRANSCRIPT_CHARS} more chars]"
        out.append({"role": m["role"], "content": text})
    return out


class _Stop(Exception):
    """A grader hung: the gate stops (its reason is already recorded)."""


@dataclass
class _Task:
    split: str
    task_id: str
    task: dict[str, Any]
    refs: list[str]
    final_answer: str | None
    gold: str | None
    prompt: str = ""
    final_graded: bool = True
    reference_passed: bool = False
    tool_outputs: list[str] = field(default_factory=list)
    scan: ScanResult | None = None
    graded: list[tuple[str, GradeRequest, Grade]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"task {self.task_id} ({self.split})"


@dataclass
class _Tally:
    must_fail: bool
    tried: int = 0
    passed: list[tuple[_Task, str]] = field(default_factory=list)  # (task, the attempt's note)


def check_env(name: str, env_kwargs: dict[str, Any] | None = None, max_tasks: int | None = None, replays: int = 3,
              seed: int = 0, grader: Any = None, record: bool = True, splits: tuple[str, ...] = SPLITS,
              recipe: EnvRecipe | None = None, cache: GateCache | None = None) -> GateReport:
    """Run the gate on a registered environment; returns the report (report["ok"] is the verdict).

    max_tasks caps the tasks checked per split (None: all of them); splits: which to check. recipe: build
    from it instead of the name (a worker process that never saw the registration). cache: a passing report
    kept under the same code, data and settings is returned as it was (`"cached": true`), and a new passing
    one is kept (envs/gate_cache.py)."""
    from envs.grading import default_grader
    from envs.registry import class_version, make, record_check

    env_kwargs = dict(env_kwargs or {})
    build = recipe.make if recipe is not None else (lambda: make(name, **env_kwargs))
    report = GateReport({"env": name, "env_kwargs": env_kwargs, "ok": False, "reasons": [], "tasks": 0,
                         "checked_at": time.time()})
    started = time.perf_counter()
    key = None
    try:
        env = build()
        report["class_version"] = class_version(type(env))
        task_ids = {s: list(env.dataset(s)["task_id"])[:max_tasks] for s in splits}
        if cache is not None:
            key = cache_key(name, env_kwargs, env, {"max_tasks": max_tasks, "replays": replays, "seed": seed,
                                                    "splits": list(splits)})
            kept = cache.get(key)
            if kept is not None:
                env.close()
                return GateReport({**kept, "cached": True, "gate_s": round(time.perf_counter() - started, 3)})
    except Exception as exc:  # noqa: BLE001 - a broken env is a gate failure, not a crash
        report["reasons"].append(f"could not build the environment: {type(exc).__name__}: {exc}")
        return _finish(report, record, record_check)
    own_grader = grader is None
    grader = grader or default_grader(num_actors=2)
    gate = _Gate(env, name, env_kwargs, replays, seed, grader, report, build)
    try:
        gate.run(task_ids)
    except _Stop:
        report["stopped"] = True
    except Exception as exc:  # noqa: BLE001
        report["reasons"].append(f"the gate crashed while running the env: {type(exc).__name__}: {exc}")
    finally:
        gate.summarise()
        gate.close()
        env.close()
        if own_grader:
            grader.close()
    report["gate_s"] = round(time.perf_counter() - started, 3)
    report["per_task_s"] = round(report["gate_s"] / report["tasks"], 4) if report["tasks"] else None
    report = _finish(report, record, record_check)
    if cache is not None and key is not None:
        cache.put(key, report.to_dict())
    return report


def _finish(report: GateReport, record: bool, record_check: Any) -> GateReport:
    report["ok"] = not report["reasons"]
    if record:
        try:
            record_check(report["env"], report)
        except OSError:
            pass  # a read-only cache dir must not fail the gate
    return report


class _Gate:
    def __init__(self, env: Environment, name: str, env_kwargs: dict[str, Any], replays: int, seed: int,
                 grader: Any, report: GateReport, build: Callable[[], Environment]) -> None:
        self.env, self.name, self.env_kwargs, self.build = env, name, env_kwargs, build
        self.replays, self.seed, self.grader, self.report = max(1, replays), seed, grader, report
        self.tasks: list[_Task] = []
        self.timings: dict[str, list[float]] = {}
        self.oracle_fail: list[str] = []
        self.flaky: list[str] = []
        self.nondet: list[str] = []
        self.leaks: list[dict[str, Any]] = []
        self.tallies: dict[str, _Tally] = {}
        self.findings: list[dict[str, Any]] = []
        self.env_raised: list[str] = []
        self.unbounded: list[str] = []
        self.after_final: list[str] = []
        self.grader_errors: list[str] = []
        self.inconsistent: list[str] = []
        self.crashed: list[str] = []
        self.regraded = 0
        self.adversaries: list[Adversary] = []
        self.split_sizes: dict[str, int] = {}
        self.sandboxes = GateSandboxes(env.sandbox_backend) if env.needs_sandbox else None
        self.scan_sandbox: Any = None

    # -- grading -----------------------------------------------------------------------------
    def grade(self, items: list[tuple[str, _Task, GradeRequest]], dedupe: bool = True) -> list[Grade]:
        """Grade in parallel, uncached (identical payloads once when dedupe). A hang stops the gate."""
        keys = [req.cache_key() if dedupe else str(i) for i, (_, _, req) in enumerate(items)]
        first = {k: i for i, k in reversed(list(enumerate(keys)))}
        unique = sorted(first.values())
        t0 = time.perf_counter()
        graded = self.grader.grade_many([items[i][2] for i in unique], use_cache=False, stop_on_timeout=True)
        if unique:
            add_timing(self.timings, "grade", (time.perf_counter() - t0) / len(unique))  # per grade, in parallel
        for i, g in zip(unique, graded):
            if timed_out(g):
                label, task, _ = items[i]
                self.report["reasons"].append(f"grader hung: {g.error} on '{label}' ({task.where}); the gate stopped there")
                raise _Stop
        by_index = dict(zip(unique, graded))
        grades = [by_index[first[k]] for k in keys]
        for (label, task, _), g in zip(items, grades):
            if g.error is not None and label != "reference":
                self.grader_errors.append(f"'{label}' on {task.where}: {g.error}")
        return grades

    def play(self, task: _Task, policy: Policy, after_final: str | None = None) -> Episode:
        return run_episode(self.env, task.task_id, policy, self.seed, self.timings, after_final, self.sandboxes)

    def close(self) -> None:
        if self.sandboxes is not None:
            self.sandboxes.close()

    # -- phases ------------------------------------------------------------------------------
    def run(self, task_ids: dict[str, list[str]]) -> None:
        env = self.env
        self.adversaries = list(env.gate_adversaries(builtin_adversaries()))
        self.split_sizes = {split: len(ids) for split, ids in task_ids.items()}
        for split, ids in task_ids.items():
            for tid in ids:
                refs = env.reference_actions(tid)
                if refs != env.reference_actions(tid):
                    self.nondet.append(f"{tid}: reference_actions differ between calls")
                last = refs[-1] if refs else None
                final = last if last is not None and not (env.tools and parse_turn(last).wants_tool) else None
                self.tasks.append(_Task(split, tid, env.task(tid), refs, final, answer_in(final)))
        golds = sorted({t.gold for t in self.tasks if t.gold is not None and "\n" not in t.gold})
        twin = self.build()  # a fresh instance must build the same tasks
        replays: list[tuple[_Task, list[Episode], Episode | None]] = []
        try:
            for task in self.tasks:
                replays.append((task, *self.replay_reference(task)))
                self.check_reset(task, twin, golds)
        finally:
            twin.close()
        a, _ = env.reset(seed=self.seed + 1)
        b, _ = env.reset(seed=self.seed + 1)
        if a != b:
            self.nondet.append("reset(seed) without a task_id picked different tasks")
        # all grading of a phase in one batch: graders run in parallel across tasks
        items = [(label, task, ep.request) for task, episodes, probe in replays
                 for label, ep in [*(("reference", e) for e in episodes), ("gate/final_answer_probe", probe)]
                 if ep is not None and ep.request is not None]
        grades = iter(self.grade(items, dedupe=False))
        for task, episodes, probe in replays:
            if episodes:
                self.judge_reference(task, episodes, [next(grades) for _ in episodes],
                                     next(grades) if probe is not None and probe.request is not None else None)
        played = [(task, key, attempt, ep) for task in self.tasks for key, attempt, ep in self.attack(task, self.finds(task, golds))]
        grades = self.grade([(key, task, ep.request) for task, key, _, ep in played])
        for (task, key, attempt, ep), g in zip(played, grades):
            self.judge_attempt(task, key, attempt, ep, g)
        self.check_consistency()

    def replay_reference(self, task: _Task) -> tuple[list[Episode], Episode | None]:
        """Play the reference `replays` times and, when it uses tools, once more with the null answer
        in place of its final answer (does the final answer matter at all?)."""
        episodes = [self.play(task, reference_policy(task.refs)) for _ in range(self.replays)]
        broken = next((ep for ep in episodes if ep.error), None)
        if broken is not None:
            self.oracle_fail.append(f"{task.task_id}: the reference replay raised {broken.error}")
            return [], None
        ep = episodes[0]
        task.prompt = ep.messages[1]["content"] if len(ep.messages) > 1 else ""
        task.tool_outputs = ep.observations
        used = sum(1 for m in ep.messages if m["role"] == "assistant")
        if used != len(task.refs):
            self.oracle_fail.append(f"{task.task_id}: the episode took {used} of {len(task.refs)} reference actions")
        if ep.final_answer != task.final_answer:
            task.gold = None  # the replay did not end on the reference's answer: nothing to perturb
        probe = None
        if task.gold is not None and len(task.refs) > 1:
            probe = self.play(task, reference_policy(task.refs[:-1] + [NULL_ANSWER]))
        return episodes, probe

    def judge_reference(self, task: _Task, episodes: list[Episode], refs: list[Grade], probe: Grade | None) -> None:
        g = refs[0]
        task.reference_passed = _passed(g)
        if not task.reference_passed:
            self.oracle_fail.append(f"{task.task_id}: reference scored {g.reward} (error={g.error}, details={_short(g.details)})")
        if len({_outcome(x) for x in refs}) > 1:
            odd = next(x for x in refs if _outcome(x) != _outcome(g))
            self.flaky.append(f"{task.task_id}: {len(refs)} replays gave {[(x.passed, x.reward) for x in refs]}; "
                              f"one differing grade: error={odd.error}, details={_short(odd.details)}")
        if probe is not None:
            task.final_graded = not _passed(probe)
        task.graded.append(("reference", episodes[0].request, g))

    def check_reset(self, task: _Task, twin: Environment, golds: list[str]) -> None:
        env, tid = self.env, task.task_id
        m1, d1 = self.reset_state(tid)
        probes = [p for p in env.leak_probes(task.task) if isinstance(p, str) and len(p.strip()) >= MIN_PROBE_CHARS]
        for m in m1:
            for p in probes:
                if p in m["content"]:
                    self.leaks.append({"task_id": tid, "where": f"{m['role']} message", "probe": p[:60]})
        if env.needs_sandbox:
            t0 = time.perf_counter()
            roots = SCAN_ROOTS + list(getattr(env, "leak_scan_roots", []))
            names = getattr(env, "leak_name_pattern", LEAK_NAME_PATTERN)
            task.scan = scan_sandbox(self.scan_sandbox, probes, golds, roots, names)
            add_timing(self.timings, "scan", time.perf_counter() - t0)
            if task.scan.error is not None:
                self.leaks.append({"task_id": tid, "where": "leak scan failed", "probe": task.scan.error})
            for where, i in task.scan.probe_hits:
                what = "a file name that looks like an answer" if i < 0 else probes[i][:60]
                self.leaks.append({"task_id": tid, "where": where, "probe": what})
        if self.scan_sandbox is not None:
            self.sandboxes.release(self.scan_sandbox)
            self.scan_sandbox = None
        m2, d2 = self.reset_state(tid, keep=False)
        if m1 != m2 or d1 != d2:
            self.nondet.append(f"{tid}: reset with the same seed gave a different {'prompt' if m1 != m2 else 'sandbox state'}")
        try:  # compared without a reset: no second sandbox needed
            twin_task = twin.task(tid)
        except KeyError:
            twin_task = None
        if twin_task != task.task or twin.prompt(twin_task) != env.prompt(task.task) or twin.reference_actions(tid) != task.refs:
            self.nondet.append(f"{tid}: a freshly built env gives a different task, prompt or reference")

    def reset_state(self, task_id: str, keep: bool = True) -> tuple[list[dict[str, str]], str | None]:
        """Reset to a task: its messages and sandbox digest (the sandbox kept for a scan when keep)."""
        sandbox = self.sandboxes.acquire(timeout=120) if self.sandboxes is not None else None
        messages, _ = self.env.reset(seed=self.seed, options={"task_id": task_id, "sandbox": sandbox})
        digest = state_digest(self.env)
        if sandbox is not None:
            if keep:
                self.scan_sandbox = sandbox
            else:
                self.sandboxes.release(sandbox)
        return messages, digest

    def finds(self, task: _Task, golds: list[str]) -> list[Find]:
        """Where this task's gold is readable in its sandbox at reset, chance matches left out: a
        place also holding it in other tasks' sandboxes (whose golds differ) is not about this task."""
        if task.scan is None or task.gold is None or task.gold not in golds:
            return []
        gi = golds.index(task.gold)
        controls = [t for t in self.tasks if t.scan is not None and t.gold is not None and t.gold != task.gold]
        out = []
        for where, i, context in task.scan.gold_hits:
            if i != gi:
                continue
            if controls:
                also = sum(1 for t in controls if any(w == where and j == gi for w, j, _ in t.scan.gold_hits))
                real = also * 2 < len(controls)
            else:
                real = len(task.gold) >= MIN_SECRET_CHARS or gold_in(context, task.gold, strict=True)
            if real:
                out.append(Find(where, context))
        return out

    def attack(self, task: _Task, finds: list[Find]) -> list[tuple[str, Attempt, Episode]]:
        """Play every adversary's attempts on one task (graded later, with all the others)."""
        probe = TaskProbe(env=self.env, task=task.task, task_id=task.task_id, split=task.split, prompt=task.prompt,
                          reference=task.refs, final_answer=task.final_answer, gold=task.gold,
                          final_graded=task.final_graded, reference_passed=task.reference_passed,
                          tool_outputs=task.tool_outputs, finds=finds,
                          sandbox_words=task.scan.words if task.scan else [])
        played: list[tuple[str, Attempt, Episode]] = []
        for adv in self.adversaries:
            try:
                attempts = adv.attempts(probe)
            except Exception as exc:  # noqa: BLE001 - a buggy plug-in adversary is reported, not fatal
                self.crashed.append(f"adversary '{adv.name}' crashed on {task.where}: {type(exc).__name__}: {exc}")
                continue
            for attempt in attempts:
                key = f"{adv.name}/{attempt.label}"
                ep = self.play(task, attempt.policy, attempt.after_final)
                longest = max((len(o) for o in ep.observations), default=0)
                if longest > MAX_OBSERVATION_CHARS:
                    self.unbounded.append(f"'{key}' got a {longest}-char tool output on {task.where} "
                                          f"(cap tool outputs at {MAX_OBSERVATION_CHARS} chars)")
                if ep.accepted_after_final:
                    self.after_final.append(f"'{key}' on {task.where}")
                if ep.error is not None:
                    self.env_raised.append(f"'{key}' made the environment raise on {task.where}: {ep.error}")
                    continue
                played.append((key, attempt, ep))
        return played

    def judge_attempt(self, task: _Task, key: str, attempt: Attempt, ep: Episode, g: Grade) -> None:
        tally = self.tallies.setdefault(key, _Tally(attempt.must_fail))
        tally.tried += 1
        task.graded.append((key, ep.request, g))
        if not _passed(g):
            return
        tally.passed.append((task, attempt.note))
        if sum(1 for f in self.findings if f["adversary"] == key) < MAX_FINDINGS:
            self.findings.append({"adversary": key, "task_id": task.task_id, "split": task.split,
                                  "must_fail": attempt.must_fail, "note": attempt.note, "reward": g.reward,
                                  "transcript": _transcript(ep.messages)})

    def check_consistency(self) -> None:
        """Grade every distinct payload of the first tasks of each split again, in reverse order."""
        per_split: dict[str, int] = {}
        items, before = [], []
        for task in self.tasks:
            if per_split.get(task.split, 0) >= CONSISTENCY_TASKS:
                continue
            per_split[task.split] = per_split.get(task.split, 0) + 1
            seen = set()
            for label, req, g in task.graded:
                if req.cache_key() not in seen:
                    seen.add(req.cache_key())
                    items.append((label, task, req))
                    before.append(g)
        items.reverse()
        before.reverse()
        again = self.grade(items, dedupe=False)
        self.regraded = len(items)
        for (label, task, _), g1, g2 in zip(items, before, again):
            if _outcome(g1) != _outcome(g2):
                self.inconsistent.append(f"'{label}' on {task.where}: passed={g1.passed} reward={g1.reward} "
                                         f"then passed={g2.passed} reward={g2.reward} (error={g2.error})")

    # -- the report ----------------------------------------------------------------------------
    def summarise(self) -> None:
        report, n = self.report, len(self.tasks)
        report["tasks"] = n
        report["splits"] = dict(self.split_sizes)
        failed_tasks = {f.split(":")[0] for f in self.oracle_fail}
        report["oracle_pass_rate"] = round((n - len(failed_tasks)) / n, 4) if n else 0.0
        null = self.tallies.get("null/i_dont_know")
        report["null_pass_rate"] = round(len(null.passed) / null.tried, 4) if null and null.tried else 0.0
        strict = {k: t for k, t in self.tallies.items() if t.must_fail and k != "null/i_dont_know"}
        tried = sum(t.tried for t in strict.values())
        report["adversarial_pass_rate"] = round(sum(len(t.passed) for t in strict.values()) / tried, 4) if tried else 0.0
        report["adversarial"] = {k: round(len(t.passed) / t.tried, 4) for k, t in sorted(self.tallies.items()) if t.tried}
        report["adversaries"] = [a.name for a in self.adversaries]
        report["deterministic"] = not self.nondet
        report["flaky_rate"] = round(len(self.flaky) / n, 4) if n else 0.0
        report["leaks"] = self.leaks
        report["grader_version"] = self.env.grader.full_version
        report["timings"] = {k: _stats(v) for k, v in self.timings.items() if v}
        report["consistency"] = {"regraded": self.regraded, "inconsistent": self.inconsistent[:5],
                                 "grader_errors": self.grader_errors[:5]}
        report["findings"] = self.findings
        report["problems"] = {"oracle": self.oracle_fail[:5], "flaky": self.flaky[:5], "nondeterministic": self.nondet[:5],
                              "environment_raised": self.env_raised[:5], "unbounded_output": self.unbounded[:5]}
        report["reported"] = [_passes_line(k, t) for k, t in sorted(self.tallies.items()) if t.passed and not t.must_fail]
        reasons: list[str] = []
        if "train" in report["splits"] and report["splits"]["train"] == 0:
            reasons.append("the train split is empty")
        if self.oracle_fail:
            reasons.append(f"oracle: the reference solution failed on {len(failed_tasks)}/{n} tasks (e.g. {self.oracle_fail[0]})")
        if null is not None and null.passed:
            reasons.append(f"null policy: the answer {NULL_ANSWER!r} passed {len(null.passed)}/{null.tried} tasks "
                           f"(e.g. {null.passed[0][0].where})")
        reasons += [_passes_line(k, t) for k, t in sorted(strict.items()) if t.passed]
        for what, items in (("the environment raised", self.env_raised), ("unbounded tool output", self.unbounded),
                            ("a turn after the final answer was accepted", self.after_final),
                            ("adversary crashed", self.crashed)):
            if items:
                reasons.append(f"{what}: {len(items)} time(s) (e.g. {items[0]})")
        if self.grader_errors:
            reasons.append(f"grader errors: {len(self.grader_errors)} grade(s) came back with an error "
                           f"(e.g. {self.grader_errors[0]})")
        if self.inconsistent:
            reasons.append(f"inconsistent grader: {len(self.inconsistent)}/{self.regraded} payloads graded again got a "
                           f"different grade (e.g. {self.inconsistent[0]})")
        if self.nondet:
            reasons.append(f"nondeterministic: {self.nondet[0]}")
        if self.flaky:
            reasons.append(f"flaky grader: {len(self.flaky)}/{n} tasks graded differently on identical replays (e.g. {self.flaky[0]})")
        if self.leaks:
            lk = self.leaks[0]
            reasons.append(f"leaks: {len(self.leaks)} secret(s) readable by the policy (e.g. task {lk['task_id']}: {lk['where']})")
        # one line each: the trainer's refusal joins them into one line
        report["reasons"] = [re.sub(r"\s*\n\s*", " | ", r) for r in [*report["reasons"], *reasons]]


def _passes_line(key: str, tally: _Tally) -> str:
    task, note = tally.passed[0]
    return f"adversary '{key}' passed {len(tally.passed)}/{tally.tried} tasks (e.g. {task.where}){': ' + note if note else ''}"


def require_env_ok(name: str, env_kwargs: dict[str, Any] | None = None, allow_failing: bool = False, **kwargs: Any) -> GateReport:
    """For the trainer: run the gate; raise EnvQualityError on failure unless allow_failing."""
    report = check_env(name, env_kwargs, **kwargs)
    if not report["ok"] and not allow_failing:
        raise EnvQualityError(report)
    return report
