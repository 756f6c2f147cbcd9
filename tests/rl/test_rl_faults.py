"""Fault injection over the synchronous and asynchronous loops, on the tiny config, end to end.

Workers Ray restarts (a rollout worker, an environment worker, a grader actor), each SIGKILLed at a
random point, and a grader stalled (SIGSTOP): the run goes on to its last step, each death is one
console line and a metric, and no sample is lost or trained twice. A run that cannot go on (SIGINT, SIGTERM, its learner
SIGKILLed, a full disk during a checkpoint) ends in one line naming the newest whole checkpoint and
the exact command that resumes it, with exit code 130 / 143 / 1, and the resumed runs together
train every step once. The random points come from FAULT_SEED (printed with every failure; set it
to replay one). Cases marked `long` are the rest of the matrix, not run in CI:
`.venv/bin/python -m pytest tests/rl/test_rl_faults.py -m long` (docs/faults.md)."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import psutil
import pytest
import yaml
from typer.testing import CliRunner

from rl.cli import app
from rl.metrics import read_metrics
from rl.run_folder import latest_checkpoint

from tests_rl_config import TINY

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("FAULT_SEED", random.randrange(1 << 30)))
STOP_LINE = re.compile(r"^(?P<what>.+); the run stopped; resume from (?P<tag>step_\d+): "
                       r"rl train --resume (?P<run_dir>\S+)$")


def faulty_config(tmp_path: Path, staleness: int, steps: int, **sections) -> Path:
    """TINY with every group trained (none dropped for agreeing rewards: each step trains its 4 whole
    groups) and room for the shell prompts."""
    tree = {**TINY, "output_dir": str(tmp_path / "runs"), "gate": {"enabled": False},
            "rollout": {**TINY["rollout"], "max_staleness": staleness, "drop_uniform_groups": False,
                        "max_context": 256},
            "train": {"steps": steps, "micro_batches": 1},
            "warmup": {**TINY["warmup"], "steps": 1, "tasks_per_env": 4},
            "eval": {"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False},
            "checkpoint": {"every": 1, "keep": 20}, **sections}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "faults.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def wait_until(condition, what: str, timeout_s: float = 300.0, alive=lambda: True):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        assert alive(), f"the run ended before {what} (FAULT_SEED={SEED})"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (FAULT_SEED={SEED})")


def the_run_dir(tmp_path: Path) -> Path | None:
    runs = list((tmp_path / "runs").glob("*")) if (tmp_path / "runs").exists() else []
    return runs[0] if runs else None


def steps_logged(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir) if m["step"] >= 0]


def stop_if_hung(thread: threading.Thread, tmp_path: Path, join: bool = True) -> None:
    """A run driven from a thread that did not end: its scheduler is killed, so the driver's next call
    raises and the run ends (the test has failed already)."""
    import ray

    run_dir = the_run_dir(tmp_path)
    if thread.is_alive() and run_dir is not None:
        try:
            ray.kill(ray.get_actor(f"scheduler-{run_dir.name}"), no_restart=True)
        except ValueError:  # not started yet, or gone
            pass
    if join:
        thread.join(timeout=300)


def titled_children(root: int) -> list[tuple[psutil.Process, str]]:
    """The processes under `root` with their titles, those still there when read (one may exit meanwhile)."""
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if p.cmdline():
                found.append((p, p.cmdline()[0]))
        except psutil.NoSuchProcess:
            pass
    return found


def ray_processes(root: int, title: str) -> list[psutil.Process]:
    """The processes of Ray actors of class `title` under process `root` (Ray's workers are children
    of its raylet, a child of the driver that started the cluster)."""
    return [p for p, name in titled_children(root) if name.startswith(f"ray::{title}")]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def assert_nothing_lost_or_repeated(run_dir: Path, steps: int) -> None:
    """Every step logged once; every step trained 4 whole groups of 2; no sample logged twice."""
    assert steps_logged(run_dir) == list(range(steps)), f"FAULT_SEED={SEED}"
    recs = records(run_dir)
    uids = [r["uid"] for r in recs]
    assert len(uids) == len(set(uids)), f"a sample was logged twice (FAULT_SEED={SEED})"
    per_step = Counter(r["step"] for r in recs if r["trained"])
    assert per_step == {s: 8 for s in range(steps)}, f"{per_step} (FAULT_SEED={SEED})"
    groups = Counter(r["group"] for r in recs if r["trained"])
    assert set(groups.values()) == {2}, f"a group was trained in part or twice (FAULT_SEED={SEED})"


# -- workers Ray restarts: the run goes on --------------------------------------------------------------
def kill_worker(kind: str, run_dir: Path) -> None:
    import ray

    if kind == "rollout worker":
        worker = ray.get_actor(f"rollout-{run_dir.name}-{random.Random(SEED).randrange(2)}")
        pid = ray.get(worker.ping.remote(), timeout=120)
    else:  # (a restarted environment worker starts its grader anew: wait for it)
        title = "EnvWorker" if kind == "environment worker" else "GraderActor"
        pid = wait_until(lambda: [p.pid for p in ray_processes(os.getpid(), title)], f"a live {kind}")[0]
    os.kill(pid, signal.SIGKILL)


COUNTED = {"rollout worker": "faults/rollout_worker_deaths", "environment worker": "faults/env_worker_deaths",
           "grader actor": "faults/grader_actors_replaced"}


def counted(run_dir: Path, key: str) -> float:
    return sum(m.get(key, 0.0) for m in read_metrics(run_dir) if m["step"] >= 0)


@pytest.mark.parametrize("staleness", [pytest.param(0, marks=pytest.mark.long), 2], ids=["sync", "async"])
def test_killed_workers_are_restarted_and_the_run_goes_on(tmp_path, ray_session, staleness):
    """A grader actor, then a rollout worker and the environment worker in a random order, SIGKILLed each
    at a random moment once the run has counted the death before it (a grader is found dead when the
    pool next calls it, and a restarted environment worker takes its graders along: without the wait
    its death could go unseen). Fails without the scheduler's recovery of a restarting environment
    worker (the run never logs another step: it used to hang) and without the fault lines and metrics."""
    rng = random.Random(SEED)
    # room for three deaths each noticed in turn: a worker killed after the stream's last group was
    # issued goes unseen (an asynchronous run issues ahead; CI saw an 8-step run end first)
    steps = 14
    config = faulty_config(tmp_path, staleness, steps=steps)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=CliRunner().invoke(app, ["train", str(config)])))
    thread.start()
    try:
        run_dir = wait_until(lambda: the_run_dir(tmp_path), "the run folder", alive=thread.is_alive)
        wait_until(lambda: 0 in steps_logged(run_dir), "step 0", alive=thread.is_alive)
        # the grader first: it is found dead only when next called, and an asynchronous run may have
        # graded its last group before a late kill (seen in CI); the other two in a random order
        kinds = ["environment worker", "rollout worker"]
        rng.shuffle(kinds)
        for kind in ["grader actor", *kinds]:
            time.sleep(rng.uniform(0.0, 1.0))
            kill_worker(kind, run_dir)
            wait_until(lambda: counted(run_dir, COUNTED[kind]) >= 1, f"the {kind}'s death counted",
                       alive=thread.is_alive)
        wait_until(lambda: not thread.is_alive(), "the run's end (a hung run never gets there)")
    finally:
        stop_if_hung(thread, tmp_path)
    out = result["out"]
    assert out.exit_code == 0, f"FAULT_SEED={SEED}\n{out.output}"
    assert_nothing_lost_or_repeated(run_dir, steps)
    total = {key: counted(run_dir, key) for key in (*COUNTED.values(), "rollout/failed_groups")}
    fault_lines = [line for line in out.output.splitlines() if "died" in line or "cut off" in line]
    assert total["faults/rollout_worker_deaths"] == 1 and total["faults/env_worker_deaths"] == 1, \
        f"{total} (FAULT_SEED={SEED})\n" + "\n".join(fault_lines)
    assert total["rollout/failed_groups"] == 0, f"{total} (FAULT_SEED={SEED})"
    text = " ".join(out.output.split())  # the console wraps long lines
    assert re.search(r"step \d+: rollout worker [01] died; Ray restarts it", text), text
    assert re.search(r"step \d+: environment worker 0 died; Ray restarts it", text), text
    assert re.search(r"step \d+: \d+ grader actor\(s\) died or hung and were replaced", text), text


def test_a_stalled_grader_is_replaced_and_the_run_goes_on(tmp_path, ray_session):
    """A grader actor stopped (SIGSTOP: alive to the OS and to Ray, answering nothing) at a random moment:
    the pool's timeout replaces it, its grades are retried, the run trains every step with nothing lost,
    says it in one line and counts it; the stopped process does not outlive the run."""
    rng = random.Random(SEED)
    steps = 8
    config = faulty_config(tmp_path, 2, steps=steps, grader={"timeout_s": 3.0, "retries": 1})
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=CliRunner().invoke(app, ["train", str(config)])))
    thread.start()
    stalled = None
    try:
        run_dir = wait_until(lambda: the_run_dir(tmp_path), "the run folder", alive=thread.is_alive)
        wait_until(lambda: 0 in steps_logged(run_dir), "step 0", alive=thread.is_alive)
        time.sleep(rng.uniform(0.0, 1.0))
        stalled = psutil.Process(wait_until(lambda: [p.pid for p in ray_processes(os.getpid(), "GraderActor")],
                                            "a live grader actor")[0])
        stalled.send_signal(signal.SIGSTOP)
        wait_until(lambda: counted(run_dir, COUNTED["grader actor"]) >= 1, "the stalled grader replaced",
                   alive=thread.is_alive)
        wait_until(lambda: not thread.is_alive(), "the run's end (a hung run never gets there)")
    finally:
        stop_if_hung(thread, tmp_path)
        if stalled is not None and stalled.is_running():
            stalled.send_signal(signal.SIGCONT)  # whatever happened, leave nothing stopped behind
    out = result["out"]
    assert out.exit_code == 0, f"FAULT_SEED={SEED}\n{out.output}"
    assert_nothing_lost_or_repeated(run_dir, steps)
    assert counted(run_dir, "rollout/failed_groups") == 0, f"FAULT_SEED={SEED}"
    text = " ".join(out.output.split())
    assert re.search(r"step \d+: \d+ grader actor\(s\) died or hung and were replaced", text), text
    # Ray kills an actor that cannot answer its exit request only after a grace period: bounded, not never
    wait_until(lambda: not stalled.is_running() or stalled.status() == psutil.STATUS_ZOMBIE,
               f"the stalled grader (pid {stalled.pid}) gone after the run", timeout_s=90)


# -- a run that cannot go on: one line, then --resume -----------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 128 MiB tmpfs for the run folder: a real file system that fills up (mounting needs root, as
    CI and this machine have; skipped with the reason elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (root needed): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with filler.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(1, free - leave_bytes))
    return filler


def inode(path: Path) -> int | None:
    return path.stat().st_ino if path.exists() else None


def send(sig: int, driver: int, alive) -> None:
    """A signal to the driver. When the run is this process's own main thread, only once the run's
    handler is in place (before, it would end the test session)."""
    from rl.faults import StopOnSignal

    if driver == os.getpid():
        wait_until(lambda: isinstance(getattr(signal.getsignal(sig), "__self__", None), StopOnSignal),
                   "the run's signal handler", alive=alive)
    os.kill(driver, sig)


def inject(stop: str, run_dir: Path, at: int, rng: random.Random, driver: int, alive) -> None:
    """Stop the run once step `at` is logged, or as soon as it can be (SIGINT during set-up).
    SIGTERM waits for the next checkpoint's folder, to land while it is being written (or just
    after); a full disk leaves half a checkpoint's room for the next step's logs, so the next
    checkpoint is what fails. (A resumed run's step logs still hold the steps the last one logged
    after its checkpoint until it rewinds them, replacing the file.)"""
    if stop == "SIGINT during set-up":
        send(signal.SIGINT, driver, alive)
        return
    before = inode(run_dir / "metrics.jsonl")
    wait_until(lambda: inode(run_dir / "metrics.jsonl") != before and at in steps_logged(run_dir), f"step {at}",
               alive=alive)
    if stop == "SIGTERM":
        wait_until(lambda: (run_dir / "checkpoints" / f"step_{at + 1}").exists(), f"checkpoint {at + 1}", alive=alive)
        send(signal.SIGTERM, driver, alive)
    elif stop == "disk":
        whole = run_dir / "checkpoints" / f"step_{at}"
        # whole and the checkpoints before the kept two removed: a fill that came between the manifest
        # and that removal got back the removed checkpoint's room, and no later checkpoint failed
        wait_until(lambda: (whole / "manifest.json").exists() and all(
            int(p.name[5:]) >= at - 1 for p in (run_dir / "checkpoints").glob("step_*")), f"checkpoint {at}",
            alive=alive)
        fill(run_dir.parents[1], sum(p.stat().st_size for p in whole.rglob("*") if p.is_file()) // 2)
    else:
        time.sleep(rng.uniform(0.0, 1.0))
        if stop == "SIGINT":
            send(signal.SIGINT, driver, alive)
        else:
            learners = ray_processes(driver, "Learner")
            # the titles only for the message: read when it fails (a child may exit while they are read)
            assert learners, \
                f"no learner process under pid {driver}: {sorted({name for _, name in titled_children(driver)})}"
            for learner in learners:
                learner.kill()


def in_this_process(root: Path, args: list[str], fault) -> tuple[int, str]:
    """`rl train ARGS` in this process's main thread, where the run's signal handlers go (the
    session's Ray cluster, no start-up of its own); `fault(driver pid, alive)` in a thread beside it.
    A fault that times out (a hung run) kills the run's scheduler, so the run ends."""
    ended, errors = threading.Event(), []

    def side() -> None:
        try:
            fault(os.getpid(), lambda: not ended.is_set())
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            stop_if_hung(threading.main_thread(), root, join=False)

    helper = threading.Thread(target=side, daemon=True)
    helper.start()
    try:
        result = CliRunner().invoke(app, ["train", *args])
    finally:
        ended.set()
        helper.join(120)
    if errors:
        raise errors[0]
    if result.exception is not None and not isinstance(result.exception, SystemExit):  # the CLI let it through
        return result.exit_code, result.output + "".join(traceback.format_exception(result.exception))
    return result.exit_code, result.output


class Segment:
    """`rl train` in a process of its own, its output collected."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "RAY_memory_monitor_refresh_ms": "0"}  # another process's memory is not this run's
        self.proc = subprocess.Popen([sys.executable, "-m", "rl.cli", "train", *args], cwd=str(REPO), env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def finish(self, timeout_s: float = 600.0) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.reader.join(30)
        return rc, "".join(self.lines)


def in_a_process_of_its_own(root: Path, args: list[str], fault) -> tuple[int, str]:
    run = Segment(*args)
    try:
        fault(run.proc.pid, lambda: run.proc.poll() is None)
    finally:
        rc, output = run.finish()
    return rc, output


def assert_stop_line(output: str, run_dir: Path, what: str) -> str:
    """The output ends in the one stop line, no traceback before it; it names the newest whole
    checkpoint, which resume will take. Returns the checkpoint's tag."""
    assert "Traceback" not in output, output
    last = [line for line in output.splitlines() if line.strip()][-1]
    match = STOP_LINE.match(last)
    assert match, f"not a stop line: {last!r} (FAULT_SEED={SEED})\n{output}"
    assert re.fullmatch(what, match["what"]), f"{match['what']!r} (FAULT_SEED={SEED})"
    assert match["run_dir"] == str(run_dir)
    assert match["tag"] == latest_checkpoint(run_dir)[0], f"{last} (FAULT_SEED={SEED})"
    return match["tag"]


def stop_and_resume(disk: Path, staleness: int, stops: list[str], driver=in_this_process) -> None:
    """A run stopped once for each of `stops`, each at a random step, resumed after each, then resumed
    to its end: every stop is its one line and exit code, and the resumed runs together train every
    step once, no sample twice."""
    rng = random.Random(SEED)
    steps = 2 * len(stops) + 2
    # one rollout worker: a resumed run starts faster (the stops do not need two)
    config = faulty_config(disk, staleness, steps=steps, checkpoint={"every": 1, "keep": 2},
                           rollout={**TINY["rollout"], "num_workers": 1, "max_staleness": staleness,
                                    "drop_uniform_groups": False, "max_context": 256})
    expected = {"SIGINT": (130, r"interrupted \(SIGINT\) at step \d+"),
                "SIGINT during set-up": (130, r"interrupted \(SIGINT\) during set-up"),
                "SIGTERM": (143, r"terminated \(SIGTERM\) at step \d+"),
                "learner": (1, r"the learner \(rank 0\) died at step \d+: its process \(pid \d+\) exited "
                               r"unexpectedly \(killed, or it crashed\)"),
                "disk": (1, rf"checkpoint step_\d+ failed: no space left on device on {re.escape(str(disk))} "
                            rf"\(\d+ MB free\)")}
    done = 0
    for stop in stops:
        args = [str(config)] if the_run_dir(disk) is None else ["--resume", str(the_run_dir(disk))]
        at = done + rng.randrange(2)
        rc, output = driver(disk, args, lambda pid, alive: inject(
            stop, wait_until(lambda: the_run_dir(disk), "the run folder", alive=alive), at, rng, pid, alive))
        run_dir = the_run_dir(disk)
        assert rc == expected[stop][0], f"{stop}: exit {rc} (FAULT_SEED={SEED})\n{output}"
        if driver is in_this_process:  # the session's cluster outlives the run: it gave back every name
            import ray

            assert not [n for n in ray.util.list_named_actors() if run_dir.name in n], f"FAULT_SEED={SEED}"
        if stop == "disk":
            (disk / "filler").unlink()
            assert not [p for p in (run_dir / "checkpoints").glob("step_*") if not (p / "manifest.json").exists()], \
                "the failed checkpoint's partial folder is left"
        done = int(assert_stop_line(output, run_dir, expected[stop][1])[5:]) + 1
    rc, output = driver(disk, ["--resume", str(run_dir)], lambda pid, alive: None)
    assert rc == 0, f"FAULT_SEED={SEED}\n{output}"
    assert f"continuing at step {done}" in output, output
    assert_nothing_lost_or_repeated(run_dir, steps)


def test_a_stopped_run_ends_in_one_line_and_resumes(small_disk, ray_session):
    """A synchronous run terminated (SIGTERM) while a checkpoint is being written, its learner
    SIGKILLed, its disk filled before a checkpoint, interrupted (SIGINT) while it sets up again,
    resumed after each: each stop ends in the one line with its exit code (before: Ray's SIGABRT, a
    69-line ActorDiedError, torch's `unexpected pos` traceback, silence), and the resumed runs
    together train every step once. The disk is a real one (a tmpfs) that fills up."""
    stop_and_resume(small_disk, 0, ["SIGTERM", "learner", "disk", "SIGINT during set-up"])


@pytest.mark.long
def test_a_stopped_asynchronous_run_ends_in_one_line_and_resumes(small_disk, ray_session):
    stop_and_resume(small_disk, 2, ["disk", "SIGINT", "learner", "SIGTERM"])


@pytest.mark.long
@pytest.mark.parametrize("staleness", [0, 1], ids=["sync", "async"])
def test_a_stopped_run_in_a_process_of_its_own_exits_with_its_code(small_disk, staleness):
    """The same through `python -m rl.cli` in a process of its own: the process's exit code, Ray's
    own SIGTERM handler in that process replaced."""
    stop_and_resume(small_disk, staleness, ["SIGINT", "learner", "SIGTERM"], driver=in_a_process_of_its_own)
