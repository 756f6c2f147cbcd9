"""The sandbox an environment runs in, from the run config: a bad `sandbox:` entry is a one-line
config error, a good one reaches the environment, and a short training run on the Docker backend
runs every episode in a container of the spec the config gave (built offline by the pool)."""
from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest
import yaml

from rl.cluster import env_kwargs
from rl.config import ConfigError, validate

from tests_rl_config import TINY


def test_a_bad_sandbox_entry_is_a_one_line_config_error():
    for bad, message in [({"memroy_mb": 512}, "unknown key 'memroy_mb'"), ({"pids": -1}, "'pids' must be > 0"),
                         ({"network": "on"}, "'network' must be bool")]:
        with pytest.raises(ConfigError) as info:
            validate({"envs": [{"name": "shell", "sandbox": bad}]})
        text = str(info.value)
        assert text.startswith("config error: 'envs.0.sandbox'") and message in text and "\n" not in text


def test_the_config_entry_overrides_the_environment_s_sandbox():
    import envs

    cfg = validate({"envs": [{"name": "shell", "sandbox": {"memory_mb": 384, "network": True}}, {"name": "math"}],
                    "sandbox_backend": "process"})
    shell = envs.make("shell", **env_kwargs(cfg, "shell"))
    assert shell.sandbox_spec.memory_mb == 384 and shell.sandbox_spec.network is True
    assert "sandbox" not in env_kwargs(cfg, "math")


class ContainerCreations:
    """Every sandbox container the Docker daemon creates while this is open: its labels and image,
    and its memory limit and network mode read at once (warm ones live until an episode takes them)."""

    def __init__(self) -> None:
        from sandbox.docker_backend import docker_client

        self.seen: list[dict[str, object]] = []
        self._api = docker_client().api
        self._stream = docker_client().events(decode=True, filters={"type": "container", "event": "create",
                                                                    "label": "rl.sandbox=1"})
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        import docker.errors

        try:
            for event in self._stream:
                record: dict[str, object] = dict(event["Actor"]["Attributes"])
                try:
                    host = self._api.inspect_container(event["Actor"]["ID"])["HostConfig"]
                    record.update(memory=host["Memory"], network=host["NetworkMode"])
                except docker.errors.NotFound:
                    pass  # already used and removed
                self.seen.append(record)
        except Exception:  # the stream was closed
            pass

    def close(self) -> None:
        self._stream.close()
        self._thread.join(timeout=10)


def test_short_run_on_docker_runs_its_episodes_in_the_spec_s_containers(tmp_path: Path, ray_session,
                                                                         docker_image: str):
    import docker.errors

    from rl.trainer import train
    from sandbox import SandboxSpec
    from sandbox.docker_backend import docker_client

    recipe = tmp_path / "image"  # the Dockerfile's directory is its build context
    recipe.mkdir()
    (recipe / "Dockerfile").write_text(f"ARG BASE\nFROM ${{BASE}}\nLABEL rl.test.marker={uuid.uuid4().hex}\n")
    spec = {"dockerfile": str(recipe / "Dockerfile"), "memory_mb": 384}
    tag = SandboxSpec.from_dict(spec).docker_tag()
    name = f"docker-{uuid.uuid4().hex[:6]}"
    config = {**TINY, "name": name, "output_dir": str(tmp_path / "runs"), "sandbox_backend": "docker",
              "envs": [{"name": "shell", "kwargs": {"n_train": 16, "n_heldout": 4}, "sandbox": spec}],
              "rollout": {**TINY["rollout"], "groups_per_step": 2, "drop_uniform_groups": False},
              "train": {"steps": 2, "micro_batches": 1}, "warmup": {"steps": 1, "batch_size": 4, "tasks_per_env": 4},
              "eval": {"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False},
              "gate": {"enabled": False}}
    path = tmp_path / "docker.yaml"
    path.write_text(yaml.safe_dump(config))
    creations = ContainerCreations()
    try:
        train(str(path), [])
    finally:
        creations.close()
        try:
            docker_client().images.remove(tag, force=True)
        except docker.errors.ImageNotFound:
            pass  # the run failed before building it
    run_dir = next((tmp_path / "runs").iterdir())
    samples = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [0, 1] and len(samples) == 2 * 2 * 2
    assert all(s["env"] == "shell" and s["error"] is None for s in samples), samples  # each episode's sandbox worked
    # every episode takes a fresh sandbox, and this run's were all containers of the spec's image and limits
    mine = [c for c in creations.seen if c.get("rl.run") == run_dir.name]
    assert len(mine) >= len(samples), f"{len(mine)} containers for {len(samples)} episodes"
    assert {c["image"] for c in mine} == {tag}
    inspected = [c for c in mine if "memory" in c]
    assert inspected and all(c["memory"] == 384 << 20 and c["network"] == "none" for c in inspected), inspected
