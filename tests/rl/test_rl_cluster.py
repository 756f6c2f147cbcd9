"""`ray.address`: a run joins an existing (here: simulated two-node) cluster instead of starting one. The
learner and the rollout workers are kept on the node the driver is not on (custom resources), so the
tokenizer reaches them and their checkpoint files come back through Ray, not through a path; the
checkpoints also go to a local S3-compatible server (checkpoint.dir), from which a run folder that lost
its own checkpoints resumes."""
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests_rl_config import TINY

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import subprocess, sys
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=2, resources={"far": 4})
try:
    rc = 0
    for args in sys.argv[2:]:
        rc = rc or subprocess.call([sys.argv[1], *args.split("|"), "ray.address=" + cluster.address])
finally:
    cluster.shutdown()
sys.exit(rc)
"""


@pytest.fixture
def s3_server():
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    import s3fs
    import urllib.request

    # moto's buckets live in the process, not the server: another test's server left its own behind
    urllib.request.urlopen(urllib.request.Request(env["AWS_ENDPOINT_URL_S3"] + "/moto-api/reset", method="POST"))
    s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL_S3"], key="test", secret="test").mkdir("ckpts")
    yield env
    server.stop()


def test_train_joins_a_cluster_whose_learner_shares_no_path_with_the_driver(tmp_path, s3_server):
    tree = {**TINY, "output_dir": str(tmp_path / "runs"), "train": {"steps": 2},
            "checkpoint": {"every": 1, "keep": 2, "dir": "s3://ckpts/runs"},
            "resources": {"learner_resources": {"far": 1}, "rollout_resources": {"far": 1}},
            "eval": {"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False}}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tree))
    rl = str(Path(sys.executable).with_name("rl"))

    def in_cluster(*runs: str) -> None:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, rl, *runs], capture_output=True, text=True,
                              timeout=900, cwd=REPO, env={**os.environ, **s3_server})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    in_cluster(f"train|{config}")
    run_dir = next((tmp_path / "runs").iterdir())
    ckpt = run_dir / "checkpoints" / "step_1"
    assert (ckpt / "hf" / "config.json").exists() and (ckpt / "mp_rank_00_model_states.pt").exists()
    import s3fs

    s3 = s3fs.S3FileSystem(endpoint_url=s3_server["AWS_ENDPOINT_URL_S3"], key="test", secret="test")
    assert s3.cat_file(f"ckpts/runs/{run_dir.name}/latest") == b"step_1"
    # resumed twice: from the run folder (files sent back out to the learner's node), then with the
    # run folder's checkpoints gone, from the bucket
    in_cluster(f"train|--resume|{run_dir}|train.steps=3")
    assert (run_dir / "checkpoints" / "step_2" / "manifest.json").exists()
    shutil.rmtree(run_dir / "checkpoints")
    in_cluster(f"train|--resume|{run_dir}|train.steps=4")
    steps = [json_step for json_step in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step": 3' in json_step]
    assert steps and (run_dir / "checkpoints" / "step_3" / "manifest.json").exists()


def test_joining_a_cluster_without_its_token_is_one_line(tmp_path):
    """Ray retries for twenty seconds, printing a warning each time, then raises a chain of tracebacks;
    `rl train` says once what is missing and how to give it."""
    import secrets

    from docker_cluster import HEAD

    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **token})
    try:
        address = head.stdout.readline().strip()
        tree = {**TINY, "output_dir": str(tmp_path / "runs"), "gate": {"enabled": False}}
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump(tree))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        proc = subprocess.run([str(Path(sys.executable).with_name("rl")), "train", str(config),
                               f"ray.address={address}"], capture_output=True, text=True, timeout=300, env=env)
    finally:
        head.stdin.close()
        head.wait(120)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip() and "run folder" not in line]
    assert proc.returncode != 0
    assert [line for line in lines if "RAY_AUTH_TOKEN" in line], lines
    assert len(lines) <= 3, lines  # the run folder's line aside: Ray's connect line, ours


JOB_HEAD = """
import sys
import time
from ray.cluster_utils import Cluster

dashboard, agent = int(sys.argv[1]), int(sys.argv[2])
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 2, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dashboard,
    "dashboard_agent_listen_port": agent})
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes it
cluster.shutdown()
"""


def test_a_run_submitted_as_a_ray_job(tmp_path):
    """`ray job submit --working-dir DIR -- rl train CONFIG` against a head node with the job server (Ray's
    [default] extra): the entrypoint is the driver, on the head (`ray.address: auto`), its config shipped in
    the job's working directory."""
    pytest.importorskip("aiohttp_cors")  # ray[default]
    from docker_cluster import free_port

    dashboard, agent = free_port(), free_port()
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}"}  # as a node image puts `rl` on the PATH
    head = subprocess.Popen([sys.executable, "-c", JOB_HEAD, str(dashboard), str(agent)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert head.stdout.readline().strip()
        job_dir = tmp_path / "job"
        job_dir.mkdir()
        tree = {**TINY, "output_dir": str(tmp_path / "runs"), "train": {"steps": 1}, "gate": {"enabled": False},
                "eval": {"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False}, "ray": {"address": "auto"}}
        (job_dir / "c.yaml").write_text(yaml.safe_dump(tree))
        submit = [str(Path(venv_bin) / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dashboard}",
                  "--working-dir", str(job_dir), "--", "rl", "train", "c.yaml"]
        deadline = time.monotonic() + 120
        while True:  # the head's job agent takes a while to answer on a busy machine
            proc = subprocess.run(submit, capture_output=True, text=True, timeout=900, env=env)
            if "No available agent" not in proc.stdout + proc.stderr or time.monotonic() > deadline:
                break
            time.sleep(5)
    finally:
        head.stdin.close()
        head.wait(120)
    assert proc.returncode == 0 and "succeeded" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    assert (run_dir / "checkpoints" / "step_0" / "manifest.json").exists()
