"""Placement by the `resources` section (rl.placement): the plan alone, then in a Ray test cluster
whose node declares 2 (fake) GPUs: actors land where the config says, and a config asking for
more GPUs than the cluster has is refused at start in one line naming the section."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rl.config import ConfigError, ResourcesConfig, validate
from rl.placement import plan_placement
from tests_rl_config import TINY

REPO = Path(__file__).resolve().parents[2]


def test_cpu_default_reserves_nothing():
    plan = plan_placement(ResourcesConfig(), num_workers=2, worker_cpus=0.5)
    assert plan.bundles == () and plan.gpus == 0
    assert all(s.num_gpus == 0 and s.bundle is None for s in (*plan.learner, *plan.rollout))


def test_cpu_learner_ranks_share_the_learners_cpus(ray_session):
    from rl.errors import RunRefused
    from rl.placement import check_cluster

    plan = plan_placement(ResourcesConfig(learner_ranks=2), num_workers=2, worker_cpus=0.5)
    assert [(s.num_gpus, s.num_cpus, s.bundle) for s in plan.learner] == [(0.0, 0.25, None), (0.0, 0.25, None)]
    check_cluster(plan, 0.25)  # 1.75 CPUs of the test cluster's 2
    with pytest.raises(RunRefused, match=r"resources: the run's actors ask for 2.75 CPUs \(learner_gpus=0, 4 "
                                         r"rollout worker\(s\).*the Ray cluster has 2: lower rollout.num_workers"):
        check_cluster(plan_placement(ResourcesConfig(), num_workers=4, worker_cpus=0.5), 0.25)


def test_separate_gpus_pack_fractional_workers():
    plan = plan_placement(ResourcesConfig(learner_gpus=1, rollout_gpus=0.5), num_workers=3, worker_cpus=0.5)
    assert plan.bundles == ({"GPU": 1.0, "CPU": 0.5}, {"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0, "CPU": 0.5})
    assert [(s.num_gpus, s.bundle) for s in plan.learner] == [(1.0, 0)]
    assert [(s.num_gpus, s.bundle) for s in plan.rollout] == [(0.5, 1), (0.5, 1), (0.5, 2)]
    whole = plan_placement(ResourcesConfig(learner_gpus=1, rollout_gpus=2), num_workers=2, worker_cpus=1)
    assert whole.gpus == 5 and [s.bundle for s in whole.rollout] == [1, 2]
    evaluation = plan_placement(ResourcesConfig(learner_gpus=1, rollout_gpus=1), 2, 1, with_learner=False)
    assert evaluation.gpus == 2


def test_colocated_workers_share_the_learners_gpus():
    plan = plan_placement(ResourcesConfig(learner_gpus=2, colocate=True), num_workers=3, worker_cpus=0.5)
    assert plan.gpus == 2
    assert [(s.num_gpus, s.bundle) for s in plan.learner] == [(0.5, 0), (0.5, 1)]
    assert [s.bundle for s in plan.rollout] == [0, 1, 0]
    for b in range(2):  # the shares on one GPU never exceed it (Ray counts to 1e-4)
        assert sum(s.num_gpus for s in (*plan.learner, *plan.rollout) if s.bundle == b) <= 1.0


@pytest.mark.parametrize("resources, message", [
    ({"colocate": True}, "config error: 'resources': colocate=true shares the learner's GPUs"),
    ({"learner_gpus": 1, "colocate": True, "rollout_gpus": 1}, "rollout_gpus must be 0"),
    ({"rollout_gpus": 1.5}, "rollout_gpus=1.5: above 1, a worker takes whole GPUs"),
    ({"learner_gpus": -1}, "config error: 'resources.learner_gpus'"),
])
def test_incoherent_resources_are_refused(resources, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate({**TINY, "resources": resources})


PROBE = """
import json, os, sys
import ray
from ray.cluster_utils import Cluster
from rl.config import ResourcesConfig
from rl.placement import Placement, plan_placement

@ray.remote
class Probe:
    def where(self):
        return {"gpus": [str(g) for g in ray.get_gpu_ids()], "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "node": ray.get_runtime_context().get_node_id()}

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False})
ray.init(address=cluster.address, log_to_driver=False)
out = {}
try:
    for name, res in json.loads(sys.argv[1]).items():
        placement = Placement(plan_placement(ResourcesConfig(**res), num_workers=3, worker_cpus=0.5))
        actors = [Probe.options(**placement.options(s)).remote() for s in (*placement.plan.learner, *placement.plan.rollout)]
        out[name] = ray.get([a.where.remote() for a in actors])
        for a in actors:
            ray.kill(a)
        placement.release()
finally:
    ray.shutdown()
    cluster.shutdown()
print(json.dumps(out))
"""


def test_actors_land_on_the_gpus_the_config_gives_them():
    configs = {"cpu": {}, "separate": {"learner_gpus": 1, "rollout_gpus": 0.33},
               "colocated": {"learner_gpus": 2, "colocate": True}}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(configs)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(a["gpus"] == [] for a in found["cpu"])  # CPU actors see no GPU
    learner, *workers = found["separate"]
    assert len(learner["gpus"]) == 1 and learner["visible"] == learner["gpus"][0]
    assert {w["gpus"][0] for w in workers} == {"0", "1"} - set(learner["gpus"])  # 3 workers on the other GPU
    learner0, learner1, *workers = found["colocated"]
    assert learner0["gpus"] != learner1["gpus"]
    assert [w["gpus"] for w in workers] == [learner0["gpus"], learner1["gpus"], learner0["gpus"]]


TOO_MANY = """
import os, subprocess, sys
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
try:
    proc = subprocess.run([sys.argv[1], "train", sys.argv[2], "ray.address=" + cluster.address],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})
finally:
    cluster.shutdown()
print(proc.returncode)
print(proc.stdout)  # the CLI's own lines (Ray logs to stderr)
"""


def test_asking_more_gpus_than_the_cluster_has_fails_at_start_in_one_line(tmp_path):
    tree = {**TINY, "output_dir": str(tmp_path / "runs"), "resources": {"learner_gpus": 1, "rollout_gpus": 1}}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tree))
    rl = str(Path(sys.executable).with_name("rl"))
    proc = subprocess.run([sys.executable, "-c", TOO_MANY, rl, str(config)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, *lines = proc.stdout.strip().splitlines()
    said = [line for line in lines if line.strip() and not line.startswith("run folder")]
    assert int(code) != 0
    assert said == ["error: resources: the config asks for 3 GPUs (learner_gpus=1, 2 rollout worker(s) x "
                    "rollout_gpus=1.0), the Ray cluster has 2"], lines
    assert not (next((tmp_path / "runs").iterdir()) / "gate.json").exists()  # refused before the quality gate


def test_a_role_asking_for_a_resource_no_node_offers_is_refused_in_one_line(ray_session):
    """Actors asking for a custom resource the cluster lacks would wait forever; the run refuses at start."""
    from rl.errors import RunRefused
    from rl.placement import check_custom_resources

    with pytest.raises(RunRefused, match=r"^resources.learner_resources: 2 actor\(s\) x learner_node=1 need 2, the "
                                         r"Ray cluster offers 0 \(start nodes with ray start --resources"):
        check_custom_resources({"learner": {"learner_node": 1.0}, "rollout": {}, "env": {}},
                               {"learner": 2, "rollout": 2, "env": 1})
    check_custom_resources({"learner": {"CPU": 0.5}, "rollout": {}, "env": {}}, {"learner": 2, "rollout": 2, "env": 1})
