"""How a run stops when it cannot go on: a signal, an actor that died for good, a full disk. It
ends in one line (what happened, where, the newest whole checkpoint and the command that resumes)
and an exit code: 130 for SIGINT, 143 for SIGTERM, 1 for a fault. The faults a run survives are
handled where they happen: workers Ray restarts in rl.rollout.scheduler, grader actors in
envs.grading. docs/faults.md lists each fault and what is guaranteed after it."""
from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Callable

from ray.exceptions import RayActorError, RayTaskError

from rl.errors import RunStopped
from rl.integrity import MANIFEST
from rl.run_folder import CHECKPOINTS, is_checkpoint_dir

SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal, as a shell reports it
SIGNAL_WORDS = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}
# a failed write with less than this left on its file system failed for want of space (torch's
# writer reports ENOSPC only as "unexpected pos ...")
LOW_SPACE_BYTES = 64 << 20


def newest_checkpoint(run_dir: Path) -> str | None:
    """The newest checkpoint whose manifest is written (it is written last, so the checkpoint is
    whole). Its files are not hashed: this is read while the run stops."""
    root = run_dir / CHECKPOINTS
    whole = [p for p in root.glob("step_*") if is_checkpoint_dir(p) and (p / MANIFEST).is_file()]
    return max(whole, key=lambda p: int(p.name[5:])).name if whole else None


def stop_line(run_dir: Path, what: str) -> str:
    """The one line a stopped run ends with."""
    resume = f"rl train --resume {run_dir}"
    last = newest_checkpoint(run_dir)
    if last is None:
        return f"{what}; the run stopped before its first checkpoint: {resume} starts it again"
    return f"{what}; the run stopped; resume from {last}: {resume}"


class StopOnSignal:
    """SIGINT and SIGTERM raise RunStopped in the main thread, so the run unwinds through its
    clean-up and ends in one line. Ray's driver puts its own SIGTERM handler in place (a stack dump,
    then SIGABRT): install again after ray.init. The exception can surface wrapped (raised inside a
    callback of Ray's C code it becomes a SystemError) or be swallowed: `stop` keeps it for the run
    to raise itself. A second signal while the run shuts down raises again, cutting the clean-up
    short. Runs driven from another thread (tests) keep Python's handlers."""

    def __init__(self, line: Callable[[str], str]) -> None:
        self.line = line  # what happened -> the stop line
        self.previous: dict[int, object] = {}
        self.stop: RunStopped | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNAL_EXIT:
            self.previous.setdefault(sig, signal.signal(sig, self._raise))

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def check(self) -> None:
        """Raise the stop a signal asked for (at a safe point, in case it was swallowed)."""
        if self.stop is not None:
            raise self.stop

    def _raise(self, signum: int, frame) -> None:
        self.stop = self.stop or RunStopped(self.line(SIGNAL_WORDS[signum]), SIGNAL_EXIT[signum])
        raise self.stop


def innermost(exc: BaseException) -> BaseException:
    """What a remote call raised, through Ray's RayTaskError wrappers."""
    while isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return exc


def first_line(exc: BaseException) -> str:
    exc = innermost(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def actor_death(exc: BaseException, names: dict[str, str]) -> tuple[str, str] | None:
    """(which actor died, how) when a call of the driver's failed because an actor of the run died:
    the one called, or one whose result the call needed (the learner's weights, passed on to the
    rollout workers); None otherwise. names: actor id (hex) -> its name in the run."""
    death = innermost(exc)
    if not isinstance(death, RayActorError):
        return None
    who = names.get(death.actor_id or "", "an actor of the run")
    text = str(death)
    pid = re.search(r"\bpid: (\d+)", text)
    process = f"its process (pid {pid.group(1)})" if pid else "its process"
    if "killed due to the node running low on memory" in text:  # Ray's memory monitor
        return f"{who} died", f"Ray killed {process}: the node ran low on memory"
    return f"{who} died", f"{process} exited unexpectedly (killed, or it crashed)"


def mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def no_space(exc: BaseException, path: Path) -> str | None:
    """'no space left on device on MOUNT (N MB free)' when a write under `path` failed for want of
    space: ENOSPC anywhere in the error, or almost nothing left on the file system; else None."""
    seen, todo, enospc = set(), [exc], False
    while todo:  # the error, what it wraps (Ray's cause, Python's chain)
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        enospc |= (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if not enospc and free >= LOW_SPACE_BYTES:
        return None
    return f"no space left on device on {mount_point(existing)} ({free >> 20} MB free)"
