"""Does a process sandbox's start cost depend on the process that starts it? One run.

In a run the environment worker starts every sandbox: a Ray actor with hundreds of MB resident and
~100 threads. A start that forks the owner (a Python preexec_fn keeps subprocess off vfork) copies
its page tables each time. This times start + one exec + close of `--starts` process sandboxes (one
at a time, no warm pool) from this process as it is, then again once it holds `--owner-mb` MB
resident and `--threads` idle threads, and prints the ratio (1.0: the owner's size costs nothing),
with the machine's busy CPU per sandbox from /proc/stat (kernel clean-up included).

    .venv/bin/python benchmarks/sandbox_owner_size.py      # ~10 s; bubblewrap or unshare, no docker
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandbox import SandboxPools, SandboxSpec  # noqa: E402


def busy_jiffies() -> int:
    fields = list(map(int, Path("/proc/stat").read_text().splitlines()[0].split()[1:]))
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def time_starts(n: int) -> tuple[float, float]:
    """(wall ms, machine-busy CPU ms) per start + exec + close."""
    pools = SandboxPools(backend="process", warm=0, max_live=4)
    try:
        pools.acquire(SandboxSpec()).close()  # the pool's own first-use work out of the timing
        busy, began = busy_jiffies(), time.perf_counter()
        for _ in range(n):
            sb = pools.acquire(SandboxSpec())
            sb.exec("true")
            sb.close()
        wall = (time.perf_counter() - began) / n
        time.sleep(1.0)  # namespaces and cgroups are cleaned up after close returns
        return wall * 1e3, (busy_jiffies() - busy) * 1e3 / 100 / n  # USER_HZ = 100
    finally:
        pools.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=30)
    parser.add_argument("--owner-mb", type=int, default=500)
    parser.add_argument("--threads", type=int, default=60)
    args = parser.parse_args()
    small = time_starts(args.starts)
    ballast = bytearray(args.owner_mb << 20)
    for i in range(0, len(ballast), 4096):  # resident, not just reserved
        ballast[i] = 1
    stop = threading.Event()
    for _ in range(args.threads):
        threading.Thread(target=stop.wait, daemon=True).start()
    large = time_starts(args.starts)
    stop.set()
    print(f"owner as started:                 {small[0]:6.1f} ms a sandbox (machine busy {small[1]:5.1f} ms CPU)")
    print(f"owner with {args.owner_mb} MB, {args.threads} threads: {large[0]:6.1f} ms a sandbox "
          f"(machine busy {large[1]:5.1f} ms CPU)")
    print(f"large / small owner: {large[0] / small[0]:.2f}x wall, {large[1] / small[1]:.2f}x CPU")


if __name__ == "__main__":
    main()
