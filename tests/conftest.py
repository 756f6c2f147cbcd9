"""Shared fixtures: one Ray session for the whole test run (starting Ray costs seconds), and the
sandbox base image for every test that runs on Docker (sandbox, envs and rl tests alike)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster shared by every test that needs one; shut down at the end."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # our own cluster, never one another process started with `ray start`
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=str(REPO / ".cache" / "ray"),
            configure_logging=False,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def docker_image() -> str:
    """The sandbox base image, built here when absent: no test may rely on an earlier test or run
    having built it. Skips (with the reason) only where no Docker daemon answers; a failed build
    fails. RL_SANDBOX_IMAGE names another tag (a throwaway one checks this fixture without touching
    the shared image), RL_SANDBOX_ROOTFS another rootfs cache."""
    import sandbox
    from sandbox.images import BASE_IMAGE, build_base_image

    if not sandbox.docker_available():
        pytest.skip("no Docker daemon answers (DOCKER_HOST or /var/run/docker.sock); .ci/start-docker.sh starts one")
    return build_base_image(BASE_IMAGE)
