"""The Environment API: gymnasium-style reset/step over multi-turn text, tools, grading.

An episode: reset() gives the system and user messages; each step() takes one assistant
turn. A turn with a tool call runs the tool (usually in the episode's sandbox) and returns
its result as the next observation; a turn without one is the final answer and ends the
episode. After the episode, grade_request() captures what the grader needs.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import datasets

from envs.data import SPLITS, normalise_splits
from envs.grades import Grade, Grader, GradeRequest
from envs.toolcall import ParsedTurn, check_arguments, parse_turn, split_reasoning
from kimi_vocab.effort import EFFORT_LEVELS as EFFORTS
from sandbox import SandboxSpec, open_sandbox

if TYPE_CHECKING:
    from envs.adversaries import Adversary


@dataclass
class Tool:
    """One tool: an OpenAI-style function schema and the method that runs it."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[..., str]  # called as run(**arguments) -> observation text

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def bash_tool(env: "Environment", timeout_s: float = 10.0, max_chars: int = 2000) -> Tool:
    """A `bash` tool running a shell command in the episode's sandbox."""

    def run(command: str) -> str:
        result = env.sandbox.exec(command, timeout=timeout_s)
        out = (result.stdout or "") + (result.stderr or "")
        out = out if len(out) <= max_chars else out[:max_chars] + "\n[output truncated]"
        status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
        return f"{out.rstrip()}\n[{status}]".lstrip("\n")

    return Tool(
        name="bash",
        description="Run a shell command in your working directory and return its output.",
        parameters={
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the shell command"}},
            "required": ["command"],
            "additionalProperties": False,
        },
        run=run,
    )


class Environment:
    """Base class. Subclasses set `name` and `domain` and implement `make_grader`, `build_tasks`,
    `prompt`, `reference_actions_for` and `grade_payload`; tool users add `make_tools`, sandboxed
    ones set `needs_sandbox = True` and implement `setup` (and `leak_probes`), and may declare the
    sandbox they need in `sandbox_spec` (image, limits, network, time limits)."""

    name: ClassVar[str] = ""
    domain: ClassVar[str] = ""
    system_prompt: str = "You are a helpful assistant."
    max_turns: int = 1
    needs_sandbox: bool = False
    sandbox_spec: SandboxSpec = SandboxSpec()  # the constructor's `sandbox` (a run config's) overrides fields
    heldout_fraction: float = 0.2  # used only when build_tasks returns one unsplit set
    # Each task has exactly one right answer: the quality gate fails an environment whose grader
    # accepts a near miss of the reference answer. Set False where tasks accept several answers
    # (programs, free text): near misses that pass are then reported, not failed.
    single_answer: bool = True
    # The grader reads the answer out of free prose (a chat model's own style): words after the
    # answer are expected, so the gate reports rather than fails an answer with text appended.
    answer_in_prose: bool = False

    def __init__(self, sandbox_backend: str = "auto", max_turns: int | None = None,
                 sandbox: SandboxSpec | Mapping[str, Any] | None = None) -> None:
        self.sandbox_backend = sandbox_backend
        self.sandbox_spec = self.sandbox_spec.merged(sandbox)
        if max_turns is not None:
            self.max_turns = int(max_turns)
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self.grader: Grader = self.make_grader()
        self._splits: dict[str, datasets.Dataset] | None = None
        self._index: dict[str, tuple[str, int]] | None = None
        self._sandbox: Any = None
        self._owns_sandbox = False
        self._task: dict[str, Any] | None = None
        self._reset_episode()

    # ---- what an environment author implements -------------------------------------------
    def make_grader(self) -> Grader:
        raise NotImplementedError(f"{type(self).__name__} must implement make_grader()")

    def build_tasks(self) -> Any:
        """Return a list of task dicts, a Dataset, or {"train": ..., "heldout": ...}."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_tasks()")

    def prompt(self, task: dict[str, Any]) -> str:
        raise NotImplementedError(f"{type(self).__name__} must implement prompt()")

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} must implement reference_actions_for()")

    def grade_payload(self, task: dict[str, Any], final_answer: str | None) -> dict[str, Any]:
        """Plain data the grader needs. Read sandbox state here; never include the policy's sandbox."""
        return {"task": dict(task), "answer": final_answer}

    def make_tools(self) -> list[Tool]:
        return []

    def setup(self, task: dict[str, Any], sandbox: Any) -> None:
        """Prepare the episode sandbox (write the task's visible files). Never write answers or tests."""

    def leak_probes(self, task: dict[str, Any]) -> list[str]:
        """Strings that must never be readable inside the sandbox (hidden tests, answer files)."""
        return []

    @classmethod
    def domains(cls, **kwargs: Any) -> dict[str, dict[str, Any]]:
        """The domains this class declares, a family under its registered name: {member: the constructor
        kwargs that make it}, reached as `NAME:member` (`math:add-9x2`). `kwargs` are a config entry's (a
        dataset family finds its subsets in the files they name). Empty: the class is one domain."""
        return {}

    def gate_adversaries(self, builtin: list[Adversary]) -> list[Adversary]:
        """The adversaries the quality gate runs on this environment: the built-in ones, plus any of
        your own (`return [*builtin, MyCheat()]`). Every name that ran is listed in the report."""
        return builtin

    # ---- the API used by the trainer --------------------------------------------------------
    @property
    def tools(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self._tools()]

    def dataset(self, split: str = "train") -> datasets.Dataset:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return self._get_splits()[split]

    def share_tasks_of(self, other: "Environment") -> None:
        """Use another instance's task set (same class and arguments) instead of building it again:
        a worker holding one instance per live episode would otherwise build it once per instance."""
        if type(other) is not type(self):
            raise TypeError(f"share_tasks_of: {type(other).__name__} is not a {type(self).__name__}")
        self._splits, self._index = other._get_splits(), other._get_index()

    def task(self, task_id: str) -> dict[str, Any]:
        index = self._get_index()
        if task_id not in index:
            raise KeyError(f"{self.name}: no task with task_id {task_id!r}")
        split, row = index[task_id]
        return dict(self._get_splits()[split][row])

    def reference_actions(self, task_id: str) -> list[str]:
        return list(self.reference_actions_for(self.task(task_id)))

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[list[dict[str, str]], dict[str, Any]]:
        options = dict(options or {})
        effort = options.get("effort", "medium")
        if effort not in EFFORTS:
            raise ValueError(f"unknown effort {effort!r}; expected one of {EFFORTS}")
        split = options.get("split", "train")
        rng = random.Random(seed)
        if options.get("task_id") is not None:
            task = self.task(str(options["task_id"]))
        else:
            ds = self.dataset(split)
            task = dict(ds[rng.randrange(len(ds))])
        self._release_sandbox()
        self._reset_episode()
        self._task = task
        self._effort = effort
        self._seed = seed
        started = time.perf_counter()
        if self.needs_sandbox:
            sb = options.get("sandbox")
            if sb is None:
                self._open_own_sandbox(task)
            else:
                self._sandbox = sb
                self.setup(task, sb)
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self.prompt(task)},
        ]
        self._messages = list(messages)
        info = {
            "env": self.name,
            "task_id": task["task_id"],
            "effort": effort,
            "seed": seed,
            "max_turns": self.max_turns,
            "tools": [t.name for t in self._tools()],
            "reset_s": time.perf_counter() - started,
        }
        return messages, info

    def step(self, action: str) -> tuple[str | None, float, bool, bool, dict[str, Any]]:
        """One assistant turn. Reward here is 0.0: the episode's reward comes from its Grade."""
        if self._task is None:
            raise RuntimeError(f"{self.name}: step() called before reset()")
        if self._done:
            raise RuntimeError(f"{self.name}: step() called after the episode ended; call reset()")
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        self._turns += 1
        self._messages.append({"role": "assistant", "content": action})
        started = time.perf_counter()
        # the final answer is what follows the turn's reasoning: an answer inside it is never graded
        if self._tools():
            parsed = parse_turn(action)
        else:
            reasoning, rest = split_reasoning(action)
            parsed = ParsedTurn(text=rest, reasoning=reasoning)
        info: dict[str, Any] = {"turn": self._turns, "task_id": self._task["task_id"]}
        if not parsed.wants_tool:
            self._final_answer = parsed.text
            self._done = True
            info.update(final=True, step_s=time.perf_counter() - started)
            return None, 0.0, True, False, info
        observation = self._run_tool(parsed)
        info.update(tool=parsed.call.name if parsed.call else None, tool_error=parsed.error is not None or observation.startswith("error:"))
        self._messages.append({"role": "tool", "content": observation})
        info["step_s"] = time.perf_counter() - started
        if self._turns >= self.max_turns:
            self._done = True
            self._truncated = True
            info["final"] = True
            return None, 0.0, False, True, info
        return observation, 0.0, False, False, info

    def truncate(self) -> None:
        """End the episode now (the policy ran out of tokens or context, perhaps mid tool call):
        it is graded as truncated, with no final answer, on the sandbox state as it stands."""
        if self._task is None:
            raise RuntimeError(f"{self.name}: truncate() called before reset()")
        if not self._done:
            self._done = True
            self._truncated = True

    def grade_request(self) -> GradeRequest:
        """What the grader needs. An episode still running (cut off by its token budget) is ended
        first, as truncated: see truncate()."""
        if self._task is None:
            raise RuntimeError(f"{self.name}: grade_request() needs an episode: call reset() and step()")
        self.truncate()
        payload = self.grade_payload(self._task, self._final_answer)
        payload.setdefault("truncated", self._truncated)
        payload.setdefault("turns", self._turns)
        return GradeRequest(env=self.name, task_id=self._task["task_id"], grader=self.grader, payload=payload, effort=self._effort)

    def grade(self) -> Grade:
        """Grade the finished episode in this process (no timeout; the grader service adds those)."""
        return self.grader(self.grade_request().payload)

    def close(self) -> None:
        self._release_sandbox()
        self._task = None

    # ---- helpers -----------------------------------------------------------------------------
    @property
    def sandbox(self) -> Any:
        if self._sandbox is None:
            raise RuntimeError(f"{self.name}: no sandbox in this episode (needs_sandbox={self.needs_sandbox})")
        return self._sandbox

    @property
    def messages(self) -> list[dict[str, str]]:
        return list(self._messages)

    @property
    def done(self) -> bool:
        return self._done

    @property
    def final_answer(self) -> str | None:
        """The episode's final answer text (None while running, or when it ended without one)."""
        return self._final_answer

    def _tools(self) -> list[Tool]:
        if not hasattr(self, "_tool_list"):
            self._tool_list = self.make_tools()
        return self._tool_list

    def _run_tool(self, parsed: ParsedTurn) -> str:
        if parsed.error is not None:
            return f"error: {parsed.error}"
        call = parsed.call
        assert call is not None
        tools = {t.name: t for t in self._tools()}
        tool = tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; available: {sorted(tools)}"
        problem = check_arguments(tool.parameters, call.arguments)
        if problem is not None:
            return f"error: bad arguments for {call.name}: {problem}"
        try:
            return str(tool.run(**call.arguments))
        except Exception as exc:  # noqa: BLE001 - a failing tool is an observation, not a crash
            return f"error: tool {call.name} failed: {type(exc).__name__}: {exc}"

    def _get_splits(self) -> dict[str, datasets.Dataset]:
        if self._splits is None:
            self._splits = normalise_splits(self.build_tasks(), self.heldout_fraction, salt=self.name)
            for split, ds in self._splits.items():
                if "task_id" not in ds.column_names:
                    raise ValueError(f"{self.name}: the {split} split has no 'task_id' column")
        return self._splits

    def _get_index(self) -> dict[str, tuple[str, int]]:
        if self._index is None:
            self._index = {}
            for split, ds in self._get_splits().items():
                for row, tid in enumerate(ds["task_id"]):
                    if tid in self._index:
                        raise ValueError(f"{self.name}: task_id {tid!r} appears in more than one split")
                    self._index[tid] = (split, row)
        return self._index

    def _reset_episode(self) -> None:
        self._messages: list[dict[str, str]] = []
        self._turns = 0
        self._done = False
        self._truncated = False
        self._final_answer: str | None = None
        self._effort = "medium"
        self._seed: int | None = None

    def _open_own_sandbox(self, task: dict[str, Any], attempts: int = 3) -> None:
        """Open and set up a sandbox for this episode; a sandbox that fails to start is retried."""
        for attempt in range(attempts):
            try:
                self._sandbox = open_sandbox(backend=self.sandbox_backend, spec=self.sandbox_spec,
                                             labels={"env": self.name, "task": task["task_id"]})
                self._owns_sandbox = True
                self.setup(task, self._sandbox)
                return
            except Exception as exc:  # noqa: BLE001 - start-up failures are infrastructure, retry them
                self._release_sandbox()
                if attempt == attempts - 1:
                    raise RuntimeError(f"{self.name}: could not start the episode sandbox ({attempts} tries): "
                                       f"{type(exc).__name__}: {exc}") from exc
                time.sleep(0.05 * (attempt + 1))

    def _release_sandbox(self) -> None:
        if self._sandbox is not None and self._owns_sandbox:
            try:
                self._sandbox.close()
            except Exception:  # noqa: BLE001 - closing a dead sandbox must not mask the episode
                pass
        self._sandbox = None
        self._owns_sandbox = False

    def __del__(self) -> None:  # an env dropped mid-episode still frees its sandbox
        try:
            self._release_sandbox()
        except Exception:  # noqa: BLE001
            pass
