"""Caps on live sandboxes: per node, shared by every process on it (Ray workers, drivers), and
per process, shared by the pools of several sandbox specs.
"""
from __future__ import annotations

import fcntl
import os
import random
import threading
from pathlib import Path


class NodeSlots:
    """N lock files; holding an exclusive flock on one is holding a slot. The kernel drops the
    lock when its holder dies, so a crashed process never leaks slots."""

    def __init__(self, n: int, directory: Path) -> None:
        if n < 1:
            raise ValueError(f"node cap must be >= 1, got {n}")
        self.n = n
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def try_take(self) -> int | None:
        """An fd holding a free slot, or None when all n are held (no waiting)."""
        order = list(range(self.n))
        random.shuffle(order)  # spread contention between processes
        for i in order:
            fd = os.open(self.dir / f"slot-{i}", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                os.close(fd)
        return None

    @staticmethod
    def give(fd: int) -> None:
        os.close(fd)  # closing the fd releases the lock

    def held(self) -> int:
        """How many slots are held node-wide right now."""
        n = 0
        for i in range(self.n):
            fd = os.open(self.dir / f"slot-{i}", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                n += 1
            finally:
                os.close(fd)
        return n


class SharedCap:
    """A cap on the live sandboxes of several pools in one process (one pool per sandbox spec).

    Warm starts yield to callers that wait: while one waits, `try_take(warm=True)` refuses,
    and the pools' owner closes idle sandboxes of other pools to make room (see SandboxPools).
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"sandbox cap must be >= 1, got {n}")
        self.n = n
        self.held = 0
        self.waiting = 0
        self.cv = threading.Condition()

    def try_take(self, warm: bool = False) -> bool:
        with self.cv:
            if self.held >= self.n or (warm and self.waiting):
                return False
            self.held += 1
            self.cv.notify_all()
            return True

    def give(self) -> None:
        with self.cv:
            self.held -= 1
            self.cv.notify_all()

    def wait_for_room(self, delta: int) -> None:
        """A caller starts (+1) or stops (-1) waiting for room."""
        with self.cv:
            self.waiting += delta
            self.cv.notify_all()

    def short(self) -> bool:
        """Someone waits and nothing is free: idle sandboxes should make room."""
        return self.waiting > 0 and self.held >= self.n
