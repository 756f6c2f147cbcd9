"""Per-sandbox cgroups for the process backend (v1 and v2): memory, pids, cpu.

RLIMIT_NPROC does not bind root, and a root-mapped user namespace stays exempt, so a
pids cgroup is what stops a fork bomb; the memory cgroup also charges the size-limited
tmpfs work dir, and `oom_kill` tells an out-of-memory kill apart from other SIGKILLs.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "rl-sb-"


def _self_paths() -> dict[str, str]:
    """controller -> this process's cgroup path ('' key for the v2 unified hierarchy)."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    except OSError:
        pass
    return out


def _is_v2() -> bool:
    return (ROOT / "cgroup.controllers").exists()


class Cgroup:
    """A cgroup (one dir per v1 controller, or one v2 dir) for one sandbox."""

    def __init__(self, name: str, dirs: list[Path], v2: bool) -> None:
        self.name, self.dirs, self.v2 = name, dirs, v2

    @classmethod
    def create(cls, name: str, memory_mb: int, pids: int, cpus: float) -> "Cgroup | None":
        """Create and configure; None when cgroups are not writable here (or
        RL_SANDBOX_NO_CGROUP=1, to exercise the rlimit fallback)."""
        if os.environ.get("RL_SANDBOX_NO_CGROUP") == "1":
            return None
        paths = _self_paths()
        dirs: list[Path] = []
        cg = cls(name, dirs, _is_v2())
        try:
            if cg.v2:
                d = ROOT / paths.get("", "/").lstrip("/") / (PREFIX + name)
                d.mkdir()
                dirs.append(d)
                cg._set(d, "memory.max", str(memory_mb << 20))
                cg._set(d, "memory.swap.max", "0", optional=True)
                cg._set(d, "pids.max", str(pids))
                cg._set(d, "cpu.max", f"{int(cpus * 100000)} 100000", optional=True)
                return cg
            for ctrl in ("memory", "pids", "cpu"):
                base = ROOT / ctrl
                if not base.is_dir():
                    if ctrl == "cpu":
                        continue
                    raise OSError(f"no {ctrl} cgroup controller mounted")
                d = base / paths.get(ctrl, "/").lstrip("/") / (PREFIX + name)
                d.mkdir()
                dirs.append(d)
                if ctrl == "memory":
                    cg._set(d, "memory.limit_in_bytes", str(memory_mb << 20))
                    cg._set(d, "memory.memsw.limit_in_bytes", str(memory_mb << 20), optional=True)
                    cg._set(d, "memory.swappiness", "0", optional=True)
                elif ctrl == "pids":
                    cg._set(d, "pids.max", str(pids))
                else:
                    cg._set(d, "cpu.cfs_period_us", "100000", optional=True)
                    cg._set(d, "cpu.cfs_quota_us", str(int(cpus * 100000)), optional=True)
            return cg
        except OSError:
            cg.remove()
            return None

    @staticmethod
    def _set(d: Path, key: str, value: str, optional: bool = False) -> None:
        try:
            (d / key).write_text(value)
        except OSError:
            if not optional:
                raise

    def procs_files(self) -> list[str]:
        """The files a process writes its pid to to join (one per controller hierarchy on v1)."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return out

    def oom_kills(self) -> int:
        for d in self.dirs:
            for key in ("memory.oom_control", "memory.events"):
                try:
                    for line in (d / key).read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == "oom_kill":
                            return int(v)
                except OSError:
                    continue
        return 0

    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every process in the cgroup until it is empty (a fork bomb races us)."""
        if self.v2:
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
            except OSError:
                pass
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pids = self.pids()
            if not pids:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.005)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)  # tasks still exiting


def find_stale(names_alive: set[str]) -> list[Path]:
    """Sandbox cgroup dirs of ours whose sandbox is not in `names_alive`."""
    paths = _self_paths()
    found: list[Path] = []
    ctrls = [""] if _is_v2() else ["memory", "pids", "cpu"]
    for ctrl in ctrls:
        base = ROOT / ctrl / paths.get(ctrl, "/").lstrip("/") if ctrl else ROOT / paths.get("", "/").lstrip("/")
        try:
            for d in base.iterdir():
                if d.name.startswith(PREFIX) and d.name[len(PREFIX):] not in names_alive:
                    found.append(d)
        except OSError:
            continue
    return found
