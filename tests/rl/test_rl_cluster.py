"""`ray.address`: a run joins an existing (here: simulated two-node) cluster instead of starting one."""
import subprocess
import sys
from pathlib import Path

import yaml

from tests_rl_config import TINY

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import subprocess, sys
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
try:
    rc = subprocess.call([sys.argv[1], "train", sys.argv[2], "ray.address=" + cluster.address])
finally:
    cluster.shutdown()
sys.exit(rc)
"""


def test_train_joins_an_existing_two_node_cluster(tmp_path):
    tree = {**TINY, "output_dir": str(tmp_path / "runs"), "train": {"steps": 1},
            "eval": {"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False}}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tree))
    rl = str(Path(sys.executable).with_name("rl"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, rl, str(config)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    assert (run_dir / "checkpoints" / "step_0" / "hf" / "config.json").exists()
