"""Fixtures for the envs tests: an isolated registry dir so tests never touch the repo cache."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def isolated_registry(tmp_path, monkeypatch):
    home = tmp_path / "envs-home"
    monkeypatch.setenv("RL_ENVS_HOME", str(home))
    yield home
    from envs import registry

    for name in [n for n, e in registry._ENTRIES.items() if e.source in ("decorator", "file")]:
        registry._ENTRIES.pop(name, None)
