"""A cap on live sandboxes per node, shared by every process on it (Ray workers, drivers).

N lock files; holding an exclusive flock on one is holding a slot. The kernel drops the
lock when its holder dies, so a crashed process never leaks slots.
"""
from __future__ import annotations

import fcntl
import os
import random
from pathlib import Path


class NodeSlots:
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
