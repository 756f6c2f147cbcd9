"""The deployment recipes in deploy/ against the config they run (configs/cluster_gpu.yaml): the KubeRay
RayCluster and RayJob manifests carry the fields KubeRay reads, this Ray's version, token authentication,
and node groups whose GPUs and custom resources hold every learner rank and rollout worker the config
places there; the SLURM script parses and starts nodes with the same resources."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import ray
import yaml

from rl.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "cluster_gpu.yaml"


def start_params_resources(params: dict) -> dict[str, float]:
    """rayStartParams.resources: KubeRay wants a JSON object inside a quoted string."""
    raw = params.get("resources", '"{}"')
    return json.loads(raw.strip('"').replace('\\"', '"'))


def capacity(spec: dict) -> dict[str, float]:
    """Custom resources and GPUs the worker groups offer at their minimum size."""
    total: dict[str, float] = {}
    for group in spec["workerGroupSpecs"]:
        assert {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"} <= group.keys()
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        params = group["rayStartParams"]
        (container,) = group["template"]["spec"]["containers"]
        gpus = int(params.get("num-gpus", 0))
        assert int(container["resources"]["limits"].get("nvidia.com/gpu", 0)) == gpus, group["groupName"]
        offered = {**start_params_resources(params), "GPU": gpus}
        for name, amount in offered.items():
            total[name] = total.get(name, 0.0) + amount * group["minReplicas"]
    return total


def check_cluster_spec(spec: dict) -> None:
    cfg = load_config(CONFIG)
    res, rollout = cfg.resources, cfg.rollout
    assert spec["rayVersion"] == ray.__version__
    assert spec["authOptions"]["mode"] == "token"
    assert "rayStartParams" in spec["headGroupSpec"]
    offered = capacity(spec)
    for name, amount in res.learner_resources.items():
        assert offered.get(name, 0) >= amount * res.ranks, f"{name}: room for {offered.get(name, 0)} learner ranks"
    for name, amount in res.rollout_resources.items():
        assert offered.get(name, 0) >= amount * rollout.num_workers, f"{name}: room for {offered.get(name, 0)} workers"
    assert offered["GPU"] >= res.learner_gpus + res.rollout_gpus * rollout.num_workers


def test_the_ray_cluster_manifest_holds_the_configs_actors():
    manifest = yaml.safe_load((REPO / "deploy" / "kuberay" / "raycluster.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    check_cluster_spec(manifest["spec"])


def test_the_ray_job_runs_the_config_on_such_a_cluster():
    manifest = yaml.safe_load((REPO / "deploy" / "kuberay" / "rayjob.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    spec = manifest["spec"]
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode") and spec["shutdownAfterJobFinishes"] is True
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["rl", "train"] and (REPO / argv[2]).resolve() == CONFIG
    assert isinstance(yaml.safe_load(spec["runtimeEnvYAML"]), dict)
    check_cluster_spec(spec["rayClusterSpec"])


def test_the_slurm_script_parses_and_starts_the_configs_resources():
    script = REPO / "deploy" / "slurm" / "rl_train.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "ray start --head" in text and "RAY_AUTH_TOKEN" in text and "rl train" in text
    default = re.search(r"CONFIG=\$\{1:-([^}]+)\}", text).group(1)
    assert (REPO / default).resolve() == CONFIG
    started = {name for blob in re.findall(r"--resources='(\{[^']*\})'", text) for name in json.loads(blob)}
    cfg = load_config(CONFIG)
    assert set(cfg.resources.learner_resources) | set(cfg.resources.rollout_resources) <= started


@pytest.mark.parametrize("recipe", ["raycluster.yaml", "rayjob.yaml"])
def test_the_image_the_manifests_name_is_the_one_deploy_builds(recipe):
    manifest = yaml.safe_load((REPO / "deploy" / "kuberay" / recipe).read_text())
    images = set(re.findall(r"image: (\S+)", yaml.safe_dump(manifest)))
    assert images == {"kimi-rl:latest"}
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}-" in dockerfile and "-t kimi-rl:latest" in dockerfile
