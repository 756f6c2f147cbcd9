"""Shared fixtures: one Ray session for the whole test run (starting Ray costs seconds)."""
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
