"""Sandbox benchmarks: both backends beside the raw docker SDK doing the same work, in one run.

    .venv/bin/python benchmarks/sandbox_backends.py [--episodes 64] [--steps 10] [--execs 300]
                                           [--backends process,docker,raw] [--json out.json]

Measures exec round trip (p50/p99), sandbox start, snapshot, fork, warm pool
start-to-ready, and the throughput of N concurrent episodes of M execs each
(start + execs + close). "raw" is the docker SDK used directly: containers.run with the
same isolation settings, exec_run per command, commit (+ run) for snapshot/fork.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sandbox  # noqa: E402
from sandbox import SandboxLimits, SandboxPool  # noqa: E402

LIMITS = SandboxLimits(memory_mb=512, disk_mb=128, tmp_mb=32, pids=256)
RUN = f"bench-{uuid.uuid4().hex[:6]}"
SEED_FILES = "mkdir -p proj && for i in $(seq 1 50); do head -c 20000 /dev/urandom > proj/f$i; done"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def ms(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(xs, 50) * 1e3, 3), "p99_ms": round(pct(xs, 99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(xs) * 1e3, 3), "n": len(xs)}


# -- our backends -----------------------------------------------------------------
def bench_backend(backend: str, execs: int, starts: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    labels = {"run": RUN, "episode": "bench"}
    res["start"] = ms(timed(lambda: sandbox.open_sandbox(backend, limits=LIMITS, labels=labels).close(), starts))
    with sandbox.open_sandbox(backend, limits=LIMITS, labels=labels) as sb:
        sb.exec(["true"])
        res["exec_true"] = ms(timed(lambda: sb.exec(["true"]), execs))
        res["exec_shell"] = ms(timed(lambda: sb.exec("echo hi"), execs // 2))
        sb.exec(SEED_FILES)
        snaps = []
        res["snapshot_1MB"] = ms(timed(lambda: snaps.append(sb.snapshot()), 10))
        kids: list[sandbox.Sandbox] = []
        res["fork_1MB"] = ms(timed(lambda: kids.append(sb.fork(snaps[-1])), 5))
        for k in kids:
            assert k.exec("ls proj | wc -l").stdout.strip() == "50"
            k.close()
    return res


def bench_pool(backend: str, n: int) -> dict[str, Any]:
    with SandboxPool(backend, limits=LIMITS, warm=4, max_live=8, episode_deadline=60, grading_time=30,
                     labels={"run": RUN}) as pool:
        lat = []
        for _ in range(n):
            pool.wait_ready(4, timeout=120)
            t0 = time.perf_counter()
            sb = pool.acquire()
            sb.exec(["true"])  # ready means it answers
            lat.append(time.perf_counter() - t0)
            sb.close()
        parent = pool.acquire()
        parent.exec(SEED_FILES)
        snap = parent.snapshot()
        forks = []
        for _ in range(n):
            pool.wait_ready(4, timeout=120)
            t0 = time.perf_counter()
            kid = pool.fork(snap)
            forks.append(time.perf_counter() - t0)
            kid.close()
        parent.close()
        acquire_only = []
        for _ in range(n):
            pool.wait_ready(4, timeout=120)
            t0 = time.perf_counter()
            sb = pool.acquire()
            acquire_only.append(time.perf_counter() - t0)
            sb.close()
    return {"acquire_warm": ms(acquire_only), "acquire_plus_first_exec": ms(lat), "fork_1MB_from_warm_pool": ms(forks)}


async def _episodes(backend: str, episodes: int, steps: int) -> list[float]:
    async def episode(i: int) -> float:
        t0 = time.perf_counter()
        sb = await sandbox.aopen_sandbox(backend, limits=LIMITS, labels={"run": RUN, "episode": f"t{i}"})
        try:
            for s in range(steps):
                r = await sb.aexec(f"echo {i}-{s} >> log; tail -n1 log")
                assert r.stdout.strip() == f"{i}-{s}", r
        finally:
            await sb.aclose()
        return time.perf_counter() - t0

    return list(await asyncio.gather(*(episode(i) for i in range(episodes))))


def bench_throughput(backend: str, episodes: int, steps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    per = asyncio.run(_episodes(backend, episodes, steps))
    wall = time.perf_counter() - t0
    return {"episodes": episodes, "steps": steps, "wall_s": round(wall, 2),
            "episodes_per_s": round(episodes / wall, 2), "execs_per_s": round(episodes * steps / wall, 1),
            "episode_p50_s": round(pct(per, 50), 2)}


# -- raw docker SDK doing the same work --------------------------------------------
def bench_raw(execs: int, starts: int, episodes: int, steps: int) -> dict[str, Any]:
    from sandbox.docker_backend import DEFAULT_IMAGE, docker_client, raw_docker_run_kwargs

    client = docker_client()
    kw = raw_docker_run_kwargs(LIMITS)
    kw["labels"] = {**kw["labels"], "rl.run": RUN}
    res: dict[str, Any] = {}

    def start() -> Any:
        return client.containers.run(DEFAULT_IMAGE, ["sleep", "infinity"], **kw)

    def start_ready() -> Any:
        c = start()
        c.exec_run(["true"])  # like our start: returns once a command can run
        return c

    res["start"] = ms(timed(lambda: start_ready().remove(force=True), starts))
    c = start()
    try:
        c.exec_run(["true"])
        res["exec_true"] = ms(timed(lambda: c.exec_run(["true"]), execs))
        res["exec_shell"] = ms(timed(lambda: c.exec_run(["sh", "-c", "echo hi"]), execs // 2))
    finally:
        c.remove(force=True)
    # snapshot/fork the docker way: commit the container (a writable root, since commit
    # does not capture tmpfs), then run a new container from the committed image
    wkw = {k: v for k, v in kw.items() if k not in ("read_only", "tmpfs")}
    c = client.containers.run(DEFAULT_IMAGE, ["sleep", "infinity"], **wkw)
    images: list[Any] = []
    kids: list[Any] = []
    try:
        c.exec_run(["sh", "-c", SEED_FILES.replace("proj", "/tmp/proj")])
        res["snapshot_1MB"] = ms(timed(lambda: images.append(c.commit(repository="rl-bench-snap",
                                                                      tag=uuid.uuid4().hex[:8])), 10))

        def fork() -> None:
            k = client.containers.run(images[-1].id, ["sleep", "infinity"], **wkw)
            k.exec_run(["true"])
            kids.append(k)

        res["fork_1MB"] = ms(timed(fork, 5))
        out = kids[0].exec_run(["sh", "-c", "ls /tmp/proj | wc -l"]).output.decode().strip()
        assert out == "50", out
    finally:
        for k in [c, *kids]:
            k.remove(force=True)
        for im in images:
            try:
                client.images.remove(im.id, force=True)
            except Exception:
                pass

    def episode(i: int) -> float:
        t0 = time.perf_counter()
        k = start()
        try:
            for s in range(steps):
                r = k.exec_run(["sh", "-c", f"echo {i}-{s} >> /work/log; tail -n1 /work/log"])
                assert r.output.decode().strip() == f"{i}-{s}", r
        finally:
            k.remove(force=True)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(episodes) as ex:
        per = list(ex.map(episode, range(episodes)))
    wall = time.perf_counter() - t0
    res["throughput"] = {"episodes": episodes, "steps": steps, "wall_s": round(wall, 2),
                         "episodes_per_s": round(episodes / wall, 2), "execs_per_s": round(episodes * steps / wall, 1),
                         "episode_p50_s": round(pct(per, 50), 2)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--execs", type=int, default=300)
    ap.add_argument("--starts", type=int, default=10)
    ap.add_argument("--backends", default="process,docker,raw")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    wanted = args.backends.split(",")
    if not sandbox.docker_available():
        print("no docker daemon: benchmarking the process backend only", file=sys.stderr)
        wanted = [b for b in wanted if b == "process"]
    results: dict[str, Any] = {"run": RUN, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        for b in wanted:
            print(f"== {b}", file=sys.stderr, flush=True)
            if b == "raw":
                results[b] = bench_raw(args.execs, args.starts, args.episodes, args.steps)
            else:
                r = bench_backend(b, args.execs, args.starts)
                r["pool"] = bench_pool(b, 20)
                r["throughput"] = bench_throughput(b, args.episodes, args.steps)
                results[b] = r
            print(json.dumps({b: results[b]}, indent=1), file=sys.stderr, flush=True)
    finally:
        if sandbox.docker_available():
            from sandbox.docker_backend import gc_docker_sandboxes

            gc_docker_sandboxes(run=RUN)
            from sandbox.docker_backend import docker_client

            for c in docker_client().containers.list(all=True, filters={"label": "rl.id=raw-bench"}):
                c.remove(force=True)
    text = json.dumps(results, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
