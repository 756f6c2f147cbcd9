"""The driver's telemetry: what the environment workers and the rollout engines report between
steps, and where the run's episodes spent their time; read by rl.trainer each step and at the end."""
from __future__ import annotations

import time

import ray

from rl.rollout.engine_api import EngineStats
from rl.types import EPISODE_PHASES


class EnvHealth:
    """Environment and grader failures per step (from the environment workers' running counts; a
    restarted worker, a new pid, counts from zero again), grader actors replaced, and the sandboxes
    alive now."""

    def __init__(self, env_workers: list) -> None:
        self.env_workers = env_workers
        self.seen: dict[int, tuple[int, dict[str, float]]] = {}  # worker -> (pid, its counts at the last step)

    def metrics(self) -> dict[str, float]:
        out = {"faults/grader_actors_replaced": 0.0}
        live = 0.0
        for i, ref in enumerate([w.health_report.remote() for w in self.env_workers]):
            try:
                h = ray.get(ref)
            except ray.exceptions.RayError:  # restarting: counted at the next step
                continue
            live += h.sandboxes_live
            counts = {"faults/grader_actors_replaced": float(h.graders_replaced)}
            for kind, table in (("env_errors", h.env_errors), ("grade_errors", h.grade_errors),
                                ("grade_timeouts", h.grade_timeouts)):
                counts.update({f"env/{env}/{kind}": float(n) for env, n in table.items()})
            pid, before = self.seen.get(i, (h.pid, {}))
            if pid != h.pid:
                before = {}
            for key, n in counts.items():
                out[key] = out.get(key, 0.0) + n - before.get(key, 0.0)
            self.seen[i] = (h.pid, counts)
        out["env/sandbox_live"] = live
        return out


# the native engine's running totals (EngineStats.extra) the pace reads: host time launching steps,
# host time waiting on the device for their results, time capturing CUDA graphs
PACE_EXTRAS = ("launch_s", "wait_s", "graph_capture_s")

# the end-of-run line's words for rl.types.EPISODE_PHASES
PHASE_WORDS = {"start": "starting", "generate": "generating", "tools": "in tools", "grade": "grading"}


class EpisodeTime:
    """Where the run's episodes spent their wall time, from each step's per-episode means."""

    def __init__(self) -> None:
        self.episodes = 0.0
        self.seconds = dict.fromkeys(EPISODE_PHASES, 0.0)

    def observe(self, metrics: dict[str, float]) -> None:
        n = metrics.get("rollout/episodes", 0.0)
        self.episodes += n
        for phase in EPISODE_PHASES:
            self.seconds[phase] += n * metrics.get(f"rollout/episode_s/{phase}", 0.0)

    def summary(self) -> str | None:
        if not self.episodes:
            return None
        mean = {phase: s / self.episodes for phase, s in self.seconds.items()}
        parts = ", ".join(f"{PHASE_WORDS[p]} {mean[p]:.2f}" for p in EPISODE_PHASES)
        return f"episodes: {sum(mean.values()):.2f} s each on average ({parts})"


class EnginePace:
    """What the rollout engines did since the last call, summed over workers: their idle share
    (forward passes and sampling are busy), forward steps, milliseconds a step (of which launching
    it on the host, and waiting for the device's results), tokens sampled a step (the mean decode
    batch), prompt or environment tokens prefilled, seconds capturing CUDA graphs. Together they say
    whether rollout waits on the engines (busy, big batches) or on the episodes (idle, small
    batches), and an engine on the host (launching) or on the device (waiting)."""

    def __init__(self, workers: list, say) -> None:
        self.workers, self.say = workers, say
        self.said: set[str] = set()  # engine problems already said (each once a run)
        self.first = self.last = self._read()

    def _read(self) -> tuple[float, EngineStats]:
        total = EngineStats()
        for i, ref in enumerate([w.stats.remote() for w in self.workers]):
            try:
                s = ray.get(ref)
            except ray.exceptions.RayError:  # a worker restarting: its share counts as idle
                continue
            for problem in s.problems:  # the workers' own logs do not reach the console
                line = f"rollout worker {i}: {problem}"
                if line not in self.said:
                    self.said.add(line)
                    self.say(line)
            total.problems += s.problems
            total.busy_s += s.busy_s
            total.steps += s.steps
            total.generated_tokens += s.generated_tokens
            total.prefill_tokens += s.prefill_tokens
            for key in PACE_EXTRAS:
                total.extra[key] = total.extra.get(key, 0.0) + s.extra.get(key, 0.0)
        return time.monotonic(), total

    def metrics(self) -> dict[str, float]:
        """The engines' pace since the last call."""
        now = self._read()
        out, self.last = self._between(self.last, now), now
        return out

    def summary(self) -> str | None:
        """One line on the engines' pace over the whole run (to the last `metrics`), or None
        where the engine counts no steps."""
        m = self._between(self.first, self.last)
        if "engine/steps" not in m:
            return None
        line = (f"rollout engines: {m['engine/step_ms']:.1f} ms a step (launching {m['engine/launch_ms']:.1f}, "
                f"waiting on the device {m['engine/wait_ms']:.1f}), {m['engine/tokens_per_step']:.1f} tokens "
                f"sampled a step, idle {m['time/rollout_idle_frac']:.0%} of the run")
        if m["engine/graph_capture_s"]:
            line += f", {m['engine/graph_capture_s']:.1f} s capturing CUDA graphs"
        return line

    def _between(self, earlier: tuple[float, EngineStats], later: tuple[float, EngineStats]) -> dict[str, float]:
        (t0, a), (t1, b) = earlier, later
        # a restarted worker's counters start again at zero: never report a negative interval
        busy, steps = max(0.0, b.busy_s - a.busy_s), max(0, b.steps - a.steps)
        sampled = max(0, b.generated_tokens - a.generated_tokens)
        prefilled = max(0, b.prefill_tokens - a.prefill_tokens)
        out = {"time/rollout_idle_frac": max(0.0, 1.0 - busy / max((t1 - t0) * len(self.workers), 1e-9)),
               "engine/busy_s": busy, "engine/prefill_tokens": float(prefilled),
               "engine/problems": float(len(b.problems))}
        extra = {key: max(0.0, b.extra[key] - a.extra[key]) for key in PACE_EXTRAS}
        if steps:  # the vLLM engine counts no steps of its own
            out.update({"engine/steps": float(steps), "engine/step_ms": 1000 * busy / steps,
                        "engine/tokens_per_step": sampled / steps,
                        "engine/launch_ms": 1000 * extra["launch_s"] / steps,
                        "engine/wait_ms": 1000 * extra["wait_s"] / steps,
                        "engine/graph_capture_s": extra["graph_capture_s"]})
        return out
