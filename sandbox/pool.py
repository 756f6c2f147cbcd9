"""A pool of warm sandboxes: started ahead of demand, capped per node, health-checked.

A sandbox is never reused across episodes (state must not leak between them): acquire()
hands out a fresh warm one, and closing it (release() or sb.close()) frees its slot,
which the filler refills in the background.

The TTL of a checked-out sandbox starts at acquire() and is always episode deadline +
grading time + a margin: a TTL equal to the rollout deadline kills sandboxes while
their episode is being graded.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from typing import Any, Iterator, Mapping, AsyncIterator

from ._slots import NodeSlots, SharedCap
from .base import Sandbox, SandboxError, SandboxLimits, Snapshot, run_blocking
from .factory import open_sandbox, resolve_backend
from .owner import STATE_ROOT


class PoolExhausted(SandboxError):
    """No sandbox could be handed out in time (the per-node cap is reached: back-pressure)."""


class SandboxPool:
    """Warm sandboxes for one backend/image/limits.

    warm: idle sandboxes kept ready; max_live: cap on this pool's live sandboxes
    (idle + in use + starting); node_cap: cap shared by all pools and processes on the
    node; shared_cap: cap shared with other pools of this process (SandboxPools);
    max_waiters: callers allowed to queue before acquire() fails fast;
    episode_deadline + grading_time (+ ttl_margin, or an explicit ttl above them): the
    lifetime each acquired sandbox gets; health_interval: seconds between health checks
    of idle sandboxes (dead ones are replaced).
    """

    def __init__(self, backend: str = "auto", image: str | None = None, limits: SandboxLimits | None = None, *,
                 warm: int = 4, max_live: int = 32, episode_deadline: float = 600.0, grading_time: float = 120.0,
                 ttl_margin: float = 60.0, ttl: float | None = None, max_waiters: int | None = None,
                 health_interval: float = 5.0, labels: Mapping[str, str] | None = None,
                 env: Mapping[str, str] | None = None, start_parallelism: int = 2,
                 node_cap: int | None = None, shared_cap: SharedCap | None = None) -> None:
        if warm < 0 or max_live < 1 or warm > max_live:
            raise ValueError(f"need 0 <= warm <= max_live and max_live >= 1, got warm={warm} max_live={max_live}")
        floor = episode_deadline + grading_time
        if ttl is None:
            ttl = floor + ttl_margin
        if ttl <= floor:
            raise ValueError(f"sandbox ttl {ttl}s must exceed episode deadline + grading time ({floor}s)")
        self.backend = resolve_backend(backend, image)
        self.image = image
        self.ttl = float(ttl)
        self.limits = (limits or SandboxLimits()).with_(ttl=self.ttl)
        self.warm, self.max_live, self.max_waiters = warm, max_live, max_waiters
        self.health_interval = health_interval
        self.labels = dict(labels or {})
        self.env = dict(env or {})
        # max_live caps this pool; node_cap (or RL_SANDBOX_NODE_CAP) caps every pool and
        # process on the node together
        node_cap = node_cap if node_cap is not None else int(os.environ.get("RL_SANDBOX_NODE_CAP", "0")) or None
        self._slots = NodeSlots(node_cap, STATE_ROOT / "node-slots" / str(node_cap)) if node_cap else None
        self._shared = shared_cap
        self._slot_fd: dict[int, int] = {}  # id(sandbox) -> its reservation (node slot fd, -1 without a node cap)
        self._idle: collections.deque[Sandbox] = collections.deque()
        self._busy: set[Sandbox] = set()
        self._starting = 0
        self._waiters = 0
        self._cv = threading.Condition()
        self._closed = False
        self.stats: dict[str, int] = dict.fromkeys(
            ("started", "start_failures", "cold_starts", "acquired", "dead_replaced", "timeouts", "rejected"), 0)
        self._last_error: str | None = None
        self._threads = [threading.Thread(target=self._filler, name=f"sandbox-pool-fill{i}", daemon=True)
                         for i in range(max(1, start_parallelism))]
        self._threads.append(threading.Thread(target=self._health, name="sandbox-pool-health", daemon=True))
        for t in self._threads:
            t.start()

    # -- counts -----------------------------------------------------------------
    @property
    def live(self) -> int:
        return len(self._idle) + len(self._busy) + self._starting

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {"idle": len(self._idle), "busy": len(self._busy), "starting": self._starting,
                    "waiters": self._waiters, "max_live": self.max_live, "warm": self.warm, "ttl": self.ttl,
                    "last_error": self._last_error, **self.stats}

    # -- starting ---------------------------------------------------------------
    def _take_slot(self, warm: bool = False) -> int | None:
        """Reserve room for one more sandbox under the shared and node caps: a node slot fd (-1
        when there is no node cap), or None when a cap is reached."""
        if self._shared is not None and not self._shared.try_take(warm):
            return None
        fd = -1 if self._slots is None else self._slots.try_take()
        if fd is None and self._shared is not None:
            self._shared.give()
        return fd

    def _give_slot(self, slot: int) -> None:
        if slot >= 0:
            NodeSlots.give(slot)
        if self._shared is not None:
            self._shared.give()

    def _new(self, slot: int) -> Sandbox:
        try:
            sb = open_sandbox(self.backend, self.image, self.limits, self.labels, self.env)
        except BaseException:
            self._give_slot(slot)
            raise
        self._slot_fd[id(sb)] = slot
        sb.add_close_callback(self._on_closed)
        return sb

    def _filler(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not (len(self._idle) + self._starting < self.warm and self.live < self.max_live):
                    self._cv.wait(1.0)
                if self._closed:
                    return
                slot = self._take_slot(warm=True)
                if slot is None:  # a cap is reached: other pools and processes free room without telling us
                    self._cv.wait(0.2)
                    continue
                self._starting += 1
            sb = None
            try:
                sb = self._new(slot)
                self.stats["started"] += 1
            except Exception as e:
                self._last_error = str(e)
                self.stats["start_failures"] += 1
            with self._cv:
                self._starting -= 1
                if sb is not None and not self._closed:
                    self._idle.append(sb)
                self._cv.notify_all()
            if sb is not None and self._closed:
                sb.close()
            if sb is None:
                time.sleep(1.0)  # do not spin on a broken backend

    def _on_closed(self, sb: Sandbox) -> None:
        slot = self._slot_fd.pop(id(sb), None)
        if slot is not None:
            self._give_slot(slot)
        with self._cv:
            self._busy.discard(sb)
            try:
                self._idle.remove(sb)
            except ValueError:
                pass
            self._cv.notify_all()

    # -- handing out ------------------------------------------------------------
    def acquire(self, timeout: float | None = None, labels: Mapping[str, str] | None = None) -> Sandbox:
        """A fresh sandbox for one episode; blocks while the node is at its cap.

        Raises PoolExhausted after `timeout` seconds, or at once when `max_waiters`
        callers are already queued (back-pressure to the scheduler).
        """
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            sb, slot = self._take(end, timeout)
            if sb is None:  # a slot is free but nothing is warm: cold start in this thread
                try:
                    sb = self._new(slot)
                    self.stats["cold_starts"] += 1
                finally:
                    with self._cv:
                        self._starting -= 1
                        if sb is not None:
                            self._busy.add(sb)
                        self._cv.notify_all()
            try:
                # the TTL clock starts now; a dead agent fails the write (EPIPE). Not waiting
                # for the ack keeps warm start-to-ready at a pipe write.
                if not sb.alive:
                    raise SandboxError("died while idle")
                sb.set_deadline(self.ttl, wait=False)
            except Exception:
                self.stats["dead_replaced"] += 1
                sb.close()
                continue
            sb.labels.update(labels or {})
            self.stats["acquired"] += 1
            return sb

    def _take(self, end: float | None, timeout: float | None) -> tuple[Sandbox | None, int]:
        """Pop a warm sandbox (marked busy), or reserve a start (None, node slot fd), or raise."""
        with self._cv:
            if self._closed:
                raise SandboxError("sandbox pool is closed")
            if self.max_waiters is not None and self._waiters >= self.max_waiters and not self._idle:
                self.stats["rejected"] += 1
                raise PoolExhausted(f"sandbox pool queue full: {self._waiters} waiting, {self.live}/{self.max_live} live")
            self._waiters += 1
            waiting_for_room = False  # counted in the shared cap, so warm starts elsewhere yield
            try:
                while True:
                    if self._idle:
                        sb = self._idle.popleft()
                        self._busy.add(sb)
                        return sb, -1
                    node_full = False
                    if self.live < self.max_live:
                        slot = self._take_slot()
                        if slot is not None:
                            self._starting += 1
                            return None, slot
                        node_full = True
                        if self._shared is not None and not waiting_for_room:
                            waiting_for_room = True
                            self._shared.wait_for_room(+1)
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        self.stats["timeouts"] += 1
                        raise PoolExhausted(f"no sandbox free within {timeout}s: {self._full_reason(node_full)}")
                    # poll while a cap is reached: other pools and processes free room without telling us
                    self._cv.wait(min(left if left is not None else 1.0, 0.2 if node_full else 1.0))
                    if self._closed:
                        raise SandboxError("sandbox pool is closed")
            finally:
                self._waiters -= 1
                if waiting_for_room:
                    self._shared.wait_for_room(-1)  # type: ignore[union-attr]

    def _full_reason(self, cap_reached: bool) -> str:
        if cap_reached and self._shared is not None and self._shared.held >= self._shared.n:
            return f"cap of {self._shared.n} shared by the pools reached"
        if cap_reached and self._slots is not None:
            return f"node cap {self._slots.n} reached"
        return f"{self.live}/{self.max_live} live"

    def fork(self, snap: Snapshot, timeout: float | None = None, labels: Mapping[str, str] | None = None) -> Sandbox:
        """A sandbox whose work dir starts as `snap`, made from a warm one: the fast way to
        fork a GRPO group (no container start on the critical path)."""
        if snap.backend != self.backend:
            raise ValueError(f"snapshot of a {snap.backend} sandbox cannot seed a {self.backend} pool")
        sb = self.acquire(timeout, labels)
        try:
            if snap.image is not None and sb.image is not None and snap.image != sb.image:
                raise ValueError(f"snapshot image {snap.image!r} differs from the pool's {sb.image!r}")
            sb.put_archive(sb.workdir, snap.archive)
        except BaseException:
            sb.close()
            raise
        return sb

    async def afork(self, snap: Snapshot, timeout: float | None = None,
                    labels: Mapping[str, str] | None = None) -> Sandbox:
        return await run_blocking(self.fork, snap, timeout, labels)

    def release(self, sb: Sandbox) -> None:
        """End of episode: destroy the sandbox (its slot is refilled with a fresh one)."""
        sb.close()

    @contextlib.contextmanager
    def session(self, timeout: float | None = None, labels: Mapping[str, str] | None = None) -> Iterator[Sandbox]:
        sb = self.acquire(timeout, labels)
        try:
            yield sb
        finally:
            self.release(sb)

    # -- health -----------------------------------------------------------------
    def _health(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed, timeout=self.health_interval)
                if self._closed:
                    return
                idle = list(self._idle)
            for sb in idle:
                self.check(sb)

    def shed_idle(self) -> bool:
        """Close one idle sandbox (room for another pool under a shared cap); False when none is idle."""
        with self._cv:
            if not self._idle:
                return False
            sb = self._idle.popleft()
        sb.close()
        return True

    def check(self, sb: Sandbox) -> bool:
        """Health-check one idle sandbox, refreshing its idle TTL; dead ones are replaced."""
        try:
            sb.set_deadline(self.ttl)
            return True
        except Exception:
            self.stats["dead_replaced"] += 1
            sb.close()  # its close callback frees the slot; the filler starts a fresh one
            return False

    def check_all(self) -> int:
        """Check every idle sandbox now; returns how many were dead."""
        return sum(not self.check(sb) for sb in list(self._idle))

    def wait_ready(self, n: int | None = None, timeout: float = 60.0) -> bool:
        """Block until `n` (default: warm) idle sandboxes are ready."""
        n = self.warm if n is None else n
        with self._cv:
            return self._cv.wait_for(lambda: len(self._idle) >= n or self._closed, timeout=timeout)

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            sbs = list(self._idle) + list(self._busy)
            self._idle.clear()
            self._cv.notify_all()
        for sb in sbs:
            sb.close()
        for t in self._threads:
            t.join(timeout=30)
        with self._cv:  # a start that finished after we looked
            sbs = list(self._idle) + list(self._busy)
            self._idle.clear()
        for sb in sbs:
            sb.close()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- async twins ------------------------------------------------------------
    async def aacquire(self, timeout: float | None = None, labels: Mapping[str, str] | None = None) -> Sandbox:
        return await run_blocking(self.acquire, timeout, labels)

    async def arelease(self, sb: Sandbox) -> None:
        await run_blocking(self.release, sb)

    @contextlib.asynccontextmanager
    async def asession(self, timeout: float | None = None,
                       labels: Mapping[str, str] | None = None) -> AsyncIterator[Sandbox]:
        sb = await self.aacquire(timeout, labels)
        try:
            yield sb
        finally:
            await self.arelease(sb)

    async def aclose(self) -> None:
        await run_blocking(self.close)

    async def await_ready(self, n: int | None = None, timeout: float = 60.0) -> bool:
        return await run_blocking(self.wait_ready, n, timeout)
