"""A run on a cluster whose nodes share no filesystem (tests/rl/docker_cluster.py: the driver on this
host, the learner and the rollout workers in containers): the repository's environments and one a user
registered from a file of their own, checkpoints back to the driver's run folder and up to an S3 server;
the rollout workers' node killed mid-run (the run waits, then goes on when a node comes), the learner's
node killed (the run stops in one line) and the run resumed on a new node. Nothing lost or trained twice."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from docker_cluster import REPO, DockerCluster
from test_rl_cluster import s3_server  # noqa: F401  (a fixture)

USER_ENV = '''
from envs.domains.math import MathEnv


class DoublesEnv(MathEnv):
    """A user's environment, in a file no other node has."""

    name = "doubles"
'''


@pytest.fixture
def cluster(docker_image):
    c = DockerCluster(docker_image, f"rl-test-node-{os.getpid()}")
    try:
        yield c
    finally:
        c.shutdown()


def wait_for(predicate, what: str, timeout_s: float = 600.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.5)


def test_a_run_survives_lost_nodes_on_a_cluster_without_a_shared_filesystem(tmp_path, cluster, s3_server):
    env_home = tmp_path / "envs_home"
    (tmp_path / "user_env.py").write_text(USER_ENV)
    env = {**os.environ, **s3_server, "RL_ENVS_HOME": str(env_home), **cluster.auth_env}
    rl = str(Path(sys.executable).with_name("rl"))
    subprocess.run([rl, "env", "register", f"{tmp_path / 'user_env.py'}:DoublesEnv"], env=env, check=True,
                   capture_output=True)
    math = {"max_operand": 9, "n_train": 40, "n_heldout": 8}
    config = {
        "name": "cluster", "output_dir": str(tmp_path / "runs"), "model": {"preset": "toy", "vocab_size": 320},
        "envs": [{"name": "math", "kwargs": math}, {"name": "lookup", "kwargs": {"n_train": 40, "n_heldout": 8}},
                 {"name": "doubles", "kwargs": math}],
        "effort": {"budgets": {"low": 8, "medium": 12, "high": 16, "max": 24}},
        "rollout": {"num_workers": 2, "groups_per_step": 4, "group_size": 2, "max_context": 256},
        "train": {"steps": 6}, "warmup": {"steps": 2, "batch_size": 8, "tasks_per_env": 12},
        "eval": {"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False},
        "checkpoint": {"every": 1, "keep": 2, "dir": "s3://ckpts/runs"},
        "logging": {"wandb_mode": "disabled", "progress": False}, "gate": {"enabled": False},
        "resources": {"learner_resources": {"learner_node": 1}, "rollout_resources": {"rollout_node": 1}},
        "ray": {"address": cluster.address},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    learner_node = cluster.add_node({"learner_node": 1})
    rollout_node = cluster.add_node({"rollout_node": 2})
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen([rl, "train", str(tmp_path / "c.yaml")], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO)
    try:
        runs = tmp_path / "runs"

        def checkpoint(step: int) -> bool:
            found = list(runs.glob(f"*/checkpoints/step_{step}/manifest.json")) if runs.exists() else []
            return bool(found)

        # the rollout workers' node dies: they wait for room on another node, then go on there
        wait_for(lambda: checkpoint(1), "checkpoint step_1", proc=proc)
        cluster.kill(rollout_node)
        # no node has room for them: the run waits, and says so, until one joins
        wait_for(lambda: "to come back" in (tmp_path / "run.log").read_text(), "a line saying the run waits",
                 timeout_s=120, proc=proc)
        cluster.add_node({"rollout_node": 2})
        # the learner's node dies: the run stops in one line, naming the checkpoint to resume from
        wait_for(lambda: checkpoint(3), "checkpoint step_3", proc=proc)
        cluster.kill(learner_node)
        assert proc.wait(timeout=600) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    output = (tmp_path / "run.log").read_text()
    run_dir = next(runs.iterdir())
    assert f"rl train --resume {run_dir}" in output, output[-3000:]
    cluster.add_node({"learner_node": 1})
    resumed = subprocess.run([rl, "train", "--resume", str(run_dir)], env=env, capture_output=True, text=True,
                             timeout=900, cwd=REPO)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["step"] >= 0] == list(range(6))
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    uids = [r["uid"] for r in records]
    assert len(uids) == len(set(uids)), "a sample was logged twice"
    trained = Counter(r["group"] for r in records if r["trained"])
    assert set(trained.values()) <= {2}, "a group was trained in part or twice"
    assert {r["env"] for r in records} == {"math", "lookup", "doubles"}  # the user's file reached the nodes
    assert (run_dir / "checkpoints" / "step_5" / "manifest.json").exists()
