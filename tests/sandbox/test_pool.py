"""SandboxPool: warm start, per-node cap with back-pressure, dead sandboxes replaced, TTL rule."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from sandbox import PoolExhausted, SandboxDead, SandboxPool
from sandbox_testutil import RUN

FAST = dict(episode_deadline=30.0, grading_time=10.0, health_interval=0.2, labels={"run": RUN})


def test_warm_acquire_is_fast_and_sandboxes_are_fresh(backend_name: str):
    with SandboxPool(backend_name, warm=2, max_live=4, **FAST) as pool:
        assert pool.wait_ready(2, timeout=60)
        warm, started = set(pool._idle), pool.status()["started"]
        sb = pool.acquire(labels={"episode": "w1"})
        # a warm sandbox was handed out, none started for it (benchmarks/sandbox_backends.py times this)
        assert sb in warm and pool.status()["started"] == started and pool.status()["cold_starts"] == 0
        assert sb.labels["episode"] == "w1"
        sb.write_file("state", "episode 1")
        pool.release(sb)
        assert not sb.alive
        # the next episode gets a different, clean sandbox, and the pool refills itself
        sb2 = pool.acquire()
        assert sb2 is not sb and sb2.exec("ls -A").stdout == ""
        assert pool.wait_ready(2, timeout=60)
        sb2.close()
    assert pool.live == 0


def test_ttl_exceeds_deadline_plus_grading():
    with pytest.raises(ValueError, match="must exceed episode deadline"):
        SandboxPool("process", warm=0, episode_deadline=100, grading_time=50, ttl=150)
    with SandboxPool("process", warm=0, max_live=1, episode_deadline=100, grading_time=50, ttl_margin=5,
                     labels={"run": RUN}) as pool:
        assert pool.ttl == 155
        sb = pool.acquire()
        assert 150 < sb.info()["ttl_left"] <= 155  # the clock starts at acquire, not at warm-up
        sb.close()


def test_cap_queues_and_back_pressure():
    with SandboxPool("process", warm=1, max_live=2, max_waiters=1, **FAST) as pool:
        a, b = pool.acquire(), pool.acquire()
        assert pool.live == 2
        t0 = time.monotonic()
        with pytest.raises(PoolExhausted, match="2/2 live"):
            pool.acquire(timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 10  # waited its timeout, then gave up
        # one caller may queue; a second one is refused at once (back-pressure)
        got: list[object] = []
        waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=30)))
        waiter.start()
        deadline = time.monotonic() + 5
        while pool.status()["waiters"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(PoolExhausted, match="queue full"):
            pool.acquire(timeout=30)
        assert time.monotonic() - t0 < 10  # refused at once, not after its 30 s timeout
        a.close()  # frees a slot: the queued caller gets a sandbox
        waiter.join(30)
        assert len(got) == 1 and got[0].exec("echo ok").stdout == "ok\n"  # type: ignore[attr-defined]
        assert pool.live <= 2
        b.close()
        got[0].close()  # type: ignore[attr-defined]


def test_dead_sandboxes_are_replaced():
    with SandboxPool("process", warm=2, max_live=3, **FAST) as pool:
        assert pool.wait_ready(2, timeout=30)
        victims = list(pool._idle)
        for v in victims:  # kill them from outside, as the OOM killer or an admin would
            os.kill(v._ns_init, signal.SIGKILL)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while pool.status().get("dead_replaced", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.status()["dead_replaced"] >= 2
        assert pool.wait_ready(2, timeout=30)
        sb = pool.acquire()
        assert sb not in victims and sb.exec("echo alive").stdout == "alive\n"
        sb.close()
        # a sandbox that dies while idle is skipped by acquire even before a health check
        pool.health_interval = 3600
        assert pool.wait_ready(2, timeout=30)
        for v in list(pool._idle):
            os.kill(v._ns_init, signal.SIGKILL)  # type: ignore[attr-defined]
        time.sleep(0.1)
        sb = pool.acquire(timeout=30)
        assert sb.exec("echo fresh").stdout == "fresh\n"
        sb.close()


def test_async_pool_runs_episodes_concurrently():
    async def main() -> list[str]:
        pool = SandboxPool("process", warm=4, max_live=4, **FAST)
        try:
            await pool.await_ready(4, timeout=30)

            async def episode(i: int) -> str:
                async with pool.asession(labels={"episode": f"as{i}"}) as sb:
                    r = await sb.aexec(f"sleep 0.3; echo {i}")
                    return r.stdout.strip()

            return await asyncio.gather(*(episode(i) for i in range(8)))
        finally:
            await pool.aclose()

    t0 = time.monotonic()
    assert asyncio.run(main()) == [str(i) for i in range(8)]
    assert time.monotonic() - t0 < 10


def test_closed_pool_refuses_and_closes_its_sandboxes():
    pool = SandboxPool("process", warm=1, max_live=2, **FAST)
    sb = pool.acquire()
    pool.close()
    with pytest.raises(SandboxDead):
        sb.exec("true")
    with pytest.raises(Exception, match="closed"):
        pool.acquire()


def test_pool_fork_seeds_warm_sandboxes_from_a_snapshot(backend_name: str):
    with SandboxPool(backend_name, warm=2, max_live=4, **FAST) as pool:
        parent = pool.acquire()
        parent.write_file("prefix.txt", "shared prompt state")
        snap = parent.snapshot()
        assert pool.wait_ready(2, timeout=60)
        kids = [pool.fork(snap, labels={"episode": f"k{i}"}) for i in range(2)]
        kids[0].write_file("prefix.txt", "changed")
        assert kids[1].read_file("prefix.txt") == b"shared prompt state"
        assert parent.read_file("prefix.txt") == b"shared prompt state"
        for sb in (parent, *kids):
            sb.close()
        other = "docker" if backend_name == "process" else "process"
        with pytest.raises(ValueError, match="cannot seed"):
            pool.fork(type(snap)(backend=other, image=None, archive=snap.archive))


HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from sandbox import SandboxPool
pool = SandboxPool("process", warm=0, max_live=4, node_cap=2, episode_deadline=30, grading_time=10,
                   labels={{"run": {run!r}}})
held = [pool.acquire(timeout=30) for _ in range(2)]
print("holding", flush=True)
time.sleep(600)
"""


def test_node_cap_is_shared_across_processes_and_freed_when_a_holder_dies():
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=repo, run=RUN)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"holding"
        with SandboxPool("process", warm=0, max_live=4, node_cap=2, **FAST) as pool:
            with pytest.raises(PoolExhausted, match="node cap 2 reached"):
                pool.acquire(timeout=0.5)
            holder.kill()  # the kernel drops its slot locks; its sandboxes die with it
            holder.wait(10)
            sb = pool.acquire(timeout=20)
            assert sb.exec("echo got a slot").stdout == "got a slot\n"
            sb.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
