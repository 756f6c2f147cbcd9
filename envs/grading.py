"""Grader service: run graders with per-call timeouts, retries and a result cache.

- `GraderPool`: a pool of Ray actors. A hung grader is killed at its deadline and its actor
  replaced; a crashed actor is replaced; either way the caller gets a failed Grade with a
  clear error instead of a stall. `grade_many` sends the actors chunks of requests, one Ray
  call each; a chunk that fails is graded again one request at a time.
- `LocalGrader`: the same interface in this process (threads): for the quality gate and
  tests without Ray. It cannot survive a grader that kills the process; the pool can.
Both cache successful grades by (grader version, env, task, payload).
"""
from __future__ import annotations

import asyncio
import copy
import queue
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from envs.grades import Grade, Grader, GradeRequest

__all__ = ["Grade", "Grader", "GradeRequest", "GraderPool", "LocalGrader", "default_grader"]


class _GradeCache:
    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self._items: OrderedDict[str, Grade] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Grade | None:
        with self._lock:
            grade = self._items.get(key)
            if grade is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
        out = copy.deepcopy(grade)
        out.details["cached"] = True
        return out

    def put(self, key: str, grade: Grade) -> None:
        if grade.error is not None or self.max_items <= 0:
            return  # failures are never cached: a later attempt may succeed
        with self._lock:
            self._items[key] = copy.deepcopy(grade)
            self._items.move_to_end(key)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)


class _GradingService:
    """Shared front: cache lookup, timeout choice, batch and async helpers."""

    def __init__(self, timeout_s: float | None, retries: int, cache_size: int) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.timeout_s = timeout_s
        self.retries = retries
        self.cache = _GradeCache(cache_size)

    def _timeout_for(self, req: GradeRequest) -> float:
        return float(self.timeout_s if self.timeout_s is not None else getattr(req.grader, "timeout_s", 30.0))

    def grade(self, req: GradeRequest, use_cache: bool = True) -> Grade:
        key = req.cache_key() if use_cache else ""
        if use_cache:
            hit = self.cache.get(key)
            if hit is not None:
                return hit
        grade = self._grade_uncached(req)
        grade.details.setdefault("task_id", req.task_id)
        if use_cache:
            self.cache.put(key, grade)
        return grade

    def grade_many(self, reqs: Iterable[GradeRequest], use_cache: bool = True,
                   stop_on_timeout: bool = False) -> list[Grade]:
        """Grade many requests in parallel. stop_on_timeout: once a grader has timed out, requests
        not yet started are not graded (they get a failed Grade saying so) - one hang is enough
        to know, and every further one would cost a timeout."""
        reqs = list(reqs)
        out: list[Grade | None] = [self.cache.get(r.cache_key()) if use_cache else None for r in reqs]
        todo = [i for i, g in enumerate(out) if g is None]
        for i, grade in zip(todo, self._grade_list([reqs[i] for i in todo], stop_on_timeout)):
            grade.details.setdefault("task_id", reqs[i].task_id)
            if use_cache:
                self.cache.put(reqs[i].cache_key(), grade)
            out[i] = grade
        return out  # type: ignore[return-value]

    def _grade_list(self, reqs: list[GradeRequest], stop_on_timeout: bool) -> list[Grade]:
        """Uncached grades, `_parallelism()` at a time. With stop_on_timeout, once a grader has
        timed out, requests no worker has started yet are skipped (those running finish)."""
        if not reqs:
            return []
        stopped = threading.Event()

        def grade_one(req: GradeRequest) -> Grade:
            if stopped.is_set():  # checked by the worker as it takes the request: none starts after it
                return _skipped(req)
            grade = self._grade_uncached(req)
            if stop_on_timeout and timed_out(grade):
                stopped.set()
            return grade

        with ThreadPoolExecutor(max_workers=max(1, min(len(reqs), self._parallelism()))) as ex:
            return list(ex.map(grade_one, reqs))

    async def agrade(self, req: GradeRequest, use_cache: bool = True) -> Grade:
        return await asyncio.to_thread(self.grade, req, use_cache)

    def _parallelism(self) -> int:
        return 1

    def _grade_uncached(self, req: GradeRequest) -> Grade:
        raise NotImplementedError


def timed_out(grade: Grade) -> bool:
    """The grader (not the program it graded) ran out of time."""
    return grade.error is not None and bool(grade.details.get("timed_out"))


def _skipped(req: GradeRequest) -> Grade:
    return Grade.failed(req.grader_version, "not graded: an earlier grade timed out", skipped=True)


class LocalGrader(_GradingService):
    """Grades in this process; each call runs in a daemon thread so a hung grader times out."""

    def __init__(self, timeout_s: float | None = None, retries: int = 0, cache_size: int = 10_000, parallelism: int = 2) -> None:
        super().__init__(timeout_s, retries, cache_size)
        self.parallelism = parallelism

    def _parallelism(self) -> int:
        return self.parallelism

    def _grade_uncached(self, req: GradeRequest) -> Grade:
        timeout = self._timeout_for(req)
        for _ in range(1 + self.retries):
            box: list[Grade] = []

            def run() -> None:
                try:
                    box.append(req.grader(req.payload))
                except BaseException as exc:  # noqa: BLE001 - sys.exit() in a grader must not look like a hang
                    box.append(Grade.failed(req.grader_version, f"grader crashed: {type(exc).__name__}: {exc}",
                                            task_id=req.task_id))

            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            worker.join(timeout)
            if box:
                return box[0]
            # the thread cannot be killed; it is a daemon and is abandoned
        return Grade.failed(req.grader_version, f"grader timed out after {timeout:g}s ({1 + self.retries} attempt(s))",
                            task_id=req.task_id, timed_out=True)

    def close(self) -> None:
        pass


class GraderPool(_GradingService):
    """A pool of Ray grader actors: pool.grade(req) -> Grade. Needs ray.init() beforehand."""

    def __init__(self, num_actors: int = 2, timeout_s: float | None = None, retries: int = 1,
                 cache_size: int = 10_000, actor_options: dict[str, Any] | None = None,
                 startup_timeout_s: float = 120.0, batch_size: int = 16) -> None:
        super().__init__(timeout_s, retries, cache_size)
        import ray

        if not ray.is_initialized():
            raise RuntimeError("GraderPool needs a running Ray session: call ray.init() first")
        if num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors}")
        self.num_actors = num_actors
        self.batch_size = max(1, batch_size)  # requests per actor call in grade_many
        # num_cpus=0: graders are light and must not starve rollout workers of CPU slots
        self.actor_options = {"num_cpus": 0, **(actor_options or {})}
        self.startup_timeout_s = startup_timeout_s
        self._ready: set[tuple[str, type]] = set()
        self._idle: queue.Queue[Any] = queue.Queue()
        self._all: list[Any] = []
        for _ in range(num_actors):
            self._idle.put(self._spawn())
        self.replaced = 0

    def _spawn(self) -> Any:
        actor = _grader_actor_class().options(**self.actor_options).remote()
        self._all.append(actor)
        return actor

    def _wait_ready(self, actor: Any, grader: Grader) -> None:
        """Wait for a new actor to start and to load the grader's code (unpickling it imports its
        modules), so start-up time never counts against a grade's timeout."""
        import ray

        key = (actor._actor_id.hex(), type(grader))
        if key not in self._ready:
            ray.get(actor.ready.remote(grader), timeout=self.startup_timeout_s)
            self._ready.add(key)

    def _parallelism(self) -> int:
        return self.num_actors

    def _grade_list(self, reqs: list[GradeRequest], stop_on_timeout: bool) -> list[Grade]:
        """Chunks of up to `batch_size` requests, one actor call each (a Ray round trip costs far
        more than a typical grade). A chunk that times out or crashes is graded again one request
        at a time, so a bad payload gets its own timeout, retries and error."""
        results: list[Grade | None] = [None] * len(reqs)
        stop = threading.Event()

        def run(start: int) -> None:
            if stop.is_set():
                return
            chunk = reqs[start:start + self.batch_size]
            for i, grade in enumerate(self._grade_chunk(chunk, stop if stop_on_timeout else None), start):
                results[i] = grade

        starts = list(range(0, len(reqs), self.batch_size))
        if starts:
            with ThreadPoolExecutor(max_workers=min(len(starts), self.num_actors)) as ex:
                list(ex.map(run, starts))
        return [g if g is not None else _skipped(r) for g, r in zip(results, reqs)]

    def _grade_chunk(self, chunk: list[GradeRequest], stop: threading.Event | None) -> list[Grade]:
        """One actor call for the chunk; on failure, one request at a time (stop: set it on a
        grader timeout and skip what is left once it is set)."""
        if len(chunk) > 1:
            batch = self._try_batch(chunk)
            if batch is not None:
                return batch
        out = []
        for req in chunk:
            if stop is not None and stop.is_set():
                out.append(_skipped(req))
                continue
            out.append(self._grade_uncached(req))
            if stop is not None and timed_out(out[-1]):
                stop.set()
        return out

    def _try_batch(self, chunk: list[GradeRequest]) -> list[Grade] | None:
        """The chunk's grades from one actor call, or None when the call timed out or failed."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        actor = self._idle.get()
        failed = False
        try:
            for grader in {type(r.grader): r.grader for r in chunk}.values():
                self._wait_ready(actor, grader)
            ref = actor.grade_batch.remote([(r.grader, r.payload) for r in chunk])
            # the grades run one after another: the longest allowance, plus a tenth of the others'
            # so a chunk of normal grades gets through on a starved machine; a hang shows soon
            timeouts = sorted(self._timeout_for(r) for r in chunk)
            return ray.get(ref, timeout=timeouts[-1] + 0.1 * sum(timeouts[:-1]))
        except (GetTimeoutError, RayActorError):
            failed = True
        except Exception:  # noqa: BLE001 - e.g. one unpicklable grader: the single path says which
            pass
        finally:
            if failed:
                ray.kill(actor, no_restart=True)
                self._all.remove(actor)
                actor = self._spawn()
                self.replaced += 1
            self._idle.put(actor)
        return None

    def _grade_uncached(self, req: GradeRequest) -> Grade:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout = self._timeout_for(req)
        errors: list[str] = []
        for _ in range(1 + self.retries):
            actor = self._idle.get()  # blocks while every actor is busy: back-pressure
            replace = False
            try:
                try:
                    self._wait_ready(actor, req.grader)
                except GetTimeoutError:
                    errors.append(f"crashed (the grader actor did not start within {self.startup_timeout_s:g}s)")
                    replace = True
                    continue
                ref = actor.grade.remote(req.grader, req.payload)
                grade = ray.get(ref, timeout=timeout)
                return grade
            except GetTimeoutError:
                errors.append(f"timed out after {timeout:g}s")
                replace = True
            except RayActorError as exc:
                errors.append(f"crashed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
                replace = True
            except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable grader; retrying will not help
                return Grade.failed(req.grader_version, f"grader call failed: {type(exc).__name__}: {str(exc)[:300]}",
                                    task_id=req.task_id)
            finally:
                if replace:
                    ray.kill(actor, no_restart=True)  # a hung actor would hold its slot forever
                    self._all.remove(actor)
                    actor = self._spawn()
                    self.replaced += 1
                self._idle.put(actor)
        kind = "timed out" if all(e.startswith("timed out") for e in errors) else "crashed"
        return Grade.failed(req.grader_version, f"grader {kind}: " + "; ".join(
            f"attempt {i + 1} {e}" for i, e in enumerate(errors)), task_id=req.task_id, timed_out=kind == "timed out")

    def close(self) -> None:
        import ray

        for actor in self._all:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._all.clear()


_ACTOR_CLASS: Any = None


def _grader_actor_class() -> Any:
    """The Ray actor class, defined lazily so importing envs.grading never needs Ray."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        @ray.remote(max_restarts=0)
        class GraderActor:
            def ready(self, grader: Grader | None = None) -> bool:
                return True  # receiving the grader has imported its modules

            def grade(self, grader: Grader, payload: dict[str, Any]) -> Grade:
                return grader(payload)

            def grade_batch(self, items: list[tuple[Grader, dict[str, Any]]]) -> list[Grade]:
                return [grader(payload) for grader, payload in items]

        _ACTOR_CLASS = GraderActor
    return _ACTOR_CLASS


def default_grader(**kwargs: Any) -> _GradingService:
    """A GraderPool when Ray is running, else a LocalGrader."""
    try:
        import ray

        if ray.is_initialized():
            return GraderPool(**kwargs)
    except ImportError:
        pass
    kwargs.pop("num_actors", None)
    kwargs.pop("actor_options", None)
    return LocalGrader(**kwargs)
