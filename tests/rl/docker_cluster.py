"""A Ray cluster whose worker nodes share no filesystem with the driver: the head on this host (the
driver's node), each worker node a Docker container with its own root filesystem, the project's code
and virtualenv mounted read-only as an image would provide them (and the Python they were built with).
Host networking: the containers reach the head, and the test's S3 server, at 127.0.0.1."""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON_HOME = Path(os.path.realpath(REPO / ".venv" / "bin" / "python")).parents[1]  # the interpreter the venv uses


HEAD = """
import json, sys
from ray.cluster_utils import Cluster

resources = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                       "resources": resources})
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes it
cluster.shutdown()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DockerCluster:
    def __init__(self, image: str, name: str, head_resources: dict[str, float] | None = None) -> None:
        self.image, self.name = image, name
        # one token for every process of the cluster: the head's, the containers' and the driver's
        self.auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        # the head in a process of its own: a process that imported ray already keeps the auth mode it read
        self.head = subprocess.Popen([str(REPO / ".venv" / "bin" / "python"), "-c", HEAD,
                                      json.dumps(head_resources or {})], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, **self.auth_env})
        self.address = self.head.stdout.readline().strip()
        if not self.address:
            raise RuntimeError(f"the head node did not start (rc {self.head.wait(30)})")
        self.nodes: list[str] = []

    def node_env(self) -> dict[str, str]:
        """What a worker node needs to join: the venv on its PATH and the cluster's token."""
        return {"PATH": f"{REPO}/.venv/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/root", **self.auth_env}

    def add_node(self, resources: dict[str, float], cpus: int = 1) -> str:
        """Start a worker-node container; returns its name once Ray counts it alive."""
        name = f"{self.name}-{len(self.nodes)}"
        ports = [free_port() for _ in range(3)]
        env = [arg for k, v in self.node_env().items() for arg in ("-e", f"{k}={v}")]
        subprocess.run(["docker", "run", "-d", "--name", name, "--user", "0", "--network", "host", *env,
                        "-v", f"{PYTHON_HOME}:{PYTHON_HOME}:ro", "-v", f"{REPO}:{REPO}:ro", self.image,
                        "ray", "start", f"--address={self.address}", f"--num-cpus={cpus}",
                        f"--resources={json.dumps(resources)}", "--block", "--disable-usage-stats",
                        f"--dashboard-agent-listen-port={ports[0]}", f"--metrics-export-port={ports[1]}",
                        f"--runtime-env-agent-port={ports[2]}"], check=True, capture_output=True, timeout=60)
        self.nodes.append(name)
        self.wait_for_nodes(1 + sum(self.alive(n) for n in self.nodes))
        return name

    def alive(self, name: str) -> bool:
        out = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", name], capture_output=True, text=True)
        return out.stdout.strip() == "true"

    def kill(self, name: str) -> None:
        """Remove a node's container; returns once Ray no longer counts it alive (until then Ray may
        still place an actor there: a run resumed at once could put its learner on the dead node)."""
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        self.wait_for_nodes(1 + sum(self.alive(n) for n in self.nodes))

    def wait_for_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                 "print(sum(n['Alive'] for n in ray.nodes()))")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", probe, self.address],
                                 capture_output=True, text=True, timeout=120, env={**os.environ, **self.auth_env})
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            time.sleep(1.0)
        raise TimeoutError(f"the cluster did not reach {count} live nodes in {timeout_s:.0f} s")

    def shutdown(self) -> None:
        for name in self.nodes:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        self.head.stdin.close()  # the head process shuts its cluster down and exits
        self.head.wait(120)
