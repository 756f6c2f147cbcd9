"""One warm pool per sandbox spec, all under one cap: each environment's episodes get sandboxes
of the image, limits and lifetime it declared."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping

from ._slots import SharedCap
from .base import Sandbox, SandboxError, SandboxLimits, run_blocking
from .factory import prepare
from .pool import SandboxPool
from .spec import EPISODE_TIMEOUT, GRADING_TIME, TTL_MARGIN, SandboxSpec


class SandboxPools:
    """Warm pools keyed by SandboxSpec, started on a spec's first acquire.

    max_live caps the live sandboxes of all pools together. A caller waiting for room there
    makes idle sandboxes of other pools close, and warm refills wait until it is served, so one
    spec's warm sandboxes never starve another spec's episodes. Other keyword arguments go to
    each SandboxPool (max_waiters, health_interval, node_cap, ...).
    """

    def __init__(self, backend: str = "auto", *, warm: int = 4, max_live: int = 32,
                 grading_time: float = GRADING_TIME, ttl_margin: float = TTL_MARGIN,
                 labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
                 **pool_kwargs: Any) -> None:
        self.backend = backend
        self.warm, self.max_live = warm, max_live
        self.grading_time, self.ttl_margin = grading_time, ttl_margin
        self.labels, self.env = dict(labels or {}), dict(env or {})
        self._pool_kwargs = pool_kwargs
        self._cap = SharedCap(max_live)
        self._by_spec: dict[SandboxSpec, SandboxPool] = {}
        # specs that resolve to the same backend, image, limits and deadline share one pool
        self._by_key: dict[tuple[str, str | None, SandboxLimits, float], SandboxPool] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._reclaimer = threading.Thread(target=self._reclaim, name="sandbox-pools-reclaim", daemon=True)
        self._reclaimer.start()

    def pool(self, spec: SandboxSpec | None = None) -> SandboxPool:
        """The pool of a spec (None: the default sandbox), started on first use; building the
        spec's image, when it names a Dockerfile whose image is absent, happens here."""
        spec = spec or SandboxSpec()
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox pools are closed")
            pool = self._by_spec.get(spec)
            if pool is None:
                kind, image, limits = prepare(spec, self.backend)
                deadline = spec.episode_timeout or EPISODE_TIMEOUT
                key = (kind, image, limits, deadline)
                pool = self._by_key.get(key)
                if pool is None:
                    pool = SandboxPool(kind, image, limits, warm=self.warm, max_live=self.max_live,
                                       episode_deadline=deadline, grading_time=self.grading_time,
                                       ttl_margin=self.ttl_margin, labels=self.labels, env=self.env,
                                       shared_cap=self._cap, **self._pool_kwargs)
                    self._by_key[key] = pool
                self._by_spec[spec] = pool
            return pool

    def acquire(self, spec: SandboxSpec | None = None, timeout: float | None = None,
                labels: Mapping[str, str] | None = None) -> Sandbox:
        """A fresh sandbox of `spec` for one episode (close it to end the episode)."""
        return self.pool(spec).acquire(timeout, labels)

    async def aacquire(self, spec: SandboxSpec | None = None, timeout: float | None = None,
                       labels: Mapping[str, str] | None = None) -> Sandbox:
        return await run_blocking(self.acquire, spec, timeout, labels)

    @property
    def live(self) -> int:
        return self._cap.held

    def status(self) -> dict[str, Any]:
        with self._lock:
            pools = list(self._by_key.items())
        return {"live": self._cap.held, "max_live": self.max_live, "waiting": self._cap.waiting,
                "pools": [{"backend": kind, "image": image, "limits": dataclasses.asdict(limits),
                           "episode_deadline": deadline, **pool.status()}
                          for (kind, image, limits, deadline), pool in pools]}

    def _reclaim(self) -> None:
        """While a caller waits for room under the cap, close idle sandboxes of the other pools."""
        cap = self._cap
        while True:
            with cap.cv:
                cap.cv.wait_for(lambda: self._closed or cap.short(), timeout=1.0)
                if self._closed:
                    return
                if not cap.short():
                    continue
            with self._lock:
                pools = sorted(self._by_key.values(), key=lambda p: p.status()["idle"], reverse=True)
            if not any(p.shed_idle() for p in pools):
                with cap.cv:  # every sandbox is in an episode: wait for one to end
                    cap.cv.wait(0.2)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools = list(self._by_key.values())
        with self._cap.cv:
            self._cap.cv.notify_all()
        for pool in pools:
            pool.close()
        self._reclaimer.join(timeout=5)

    def __enter__(self) -> "SandboxPools":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def aclose(self) -> None:
        await run_blocking(self.close)
