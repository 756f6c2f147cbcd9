"""Fixtures for the envs tests: an isolated registry dir so tests never touch the repo cache."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# pytest puts tests/ on sys.path, where tests/envs would shadow the real `envs` package as a
# namespace package: put the repository root first and drop a shadow that was imported.
_ROOT = str(Path(__file__).resolve().parents[2])
if sys.path[:1] != [_ROOT]:
    sys.path.insert(0, _ROOT)
if "envs" in sys.modules and getattr(sys.modules["envs"], "__file__", None) is None:
    del sys.modules["envs"]


@pytest.fixture(autouse=True)
def isolated_registry(tmp_path, monkeypatch):
    home = tmp_path / "envs-home"
    monkeypatch.setenv("RL_ENVS_HOME", str(home))
    yield home
    from envs import registry

    for name in [n for n, e in registry._ENTRIES.items() if e.source in ("decorator", "file")]:
        registry._ENTRIES.pop(name, None)
