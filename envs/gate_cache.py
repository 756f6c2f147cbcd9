"""Quality-gate reports kept by what they depend on, so a run re-checks only what changed.

A report is found again only under the same key: the environment's name and kwargs; the content of
every file its kwargs name (data files, corpora); its task set (every row of the splits checked);
the gate's settings (tasks per split, replays, seed, splits) and the grader's version; the source of
every module of the `envs` and `sandbox` packages and of the environment's and its grader's classes
(a user's file too); and the Python version and every installed package's version. Any code or data
change gives a new key, so a stale report is never used. Only passing reports are kept: a failure
(perhaps a grader timing out on a loaded machine) is checked again next time.

Entries are JSON files in <registry dir>/gate/, one per key, written atomically."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

import envs
import sandbox
from envs.base import Environment

_PACKAGES = (envs, sandbox)  # the gate, the graders' helpers and the sandboxes: every module counts


def _digest_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _platform_digest() -> str:
    """The packages' own source (on disk, loaded or not), Python's version, every installed distribution."""
    files = [p for pkg in _PACKAGES for p in Path(pkg.__file__).parent.rglob("*.py")]
    installed = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    return hashlib.sha256((_digest_files(files) + sys.version + "\n".join(installed)).encode()).hexdigest()


def _class_files(*classes: type) -> list[Path]:
    """The files of every module in the classes' MROs (a user's environment file, its base classes)."""
    out = set()
    for cls in classes:
        for klass in cls.__mro__:
            path = getattr(sys.modules.get(klass.__module__), "__file__", None)
            if path and os.path.isfile(path):
                out.add(Path(path))
    return sorted(out)


def _named_files(value: Any) -> list[Path]:
    """Files a kwargs value names (a data file, every file under a data folder)."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _named_files(v)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _named_files(v)]
    if not isinstance(value, str) or not value or len(value) > 4096:
        return []
    path = Path(os.path.expanduser(value))
    try:
        if path.is_file():
            return [path]
        if path.is_dir():
            return sorted(p for p in path.rglob("*") if p.is_file())
    except OSError:
        pass
    return []


def cache_key(name: str, env_kwargs: dict[str, Any], env: Environment, settings: dict[str, Any]) -> str:
    """The key a report of `env` (built from name and kwargs) is kept under."""
    tasks = hashlib.sha256()
    for split in settings["splits"]:
        for row in env.dataset(split):
            tasks.update(json.dumps(row, sort_keys=True, default=str).encode())
    parts = {"name": name, "kwargs": json.dumps(env_kwargs, sort_keys=True, default=str),
             "files": _digest_files(_named_files(env_kwargs)), "tasks": tasks.hexdigest(),
             "settings": json.dumps(settings, sort_keys=True), "grader": env.grader.full_version,
             "code": _digest_files(_class_files(type(env), type(env.grader))), "platform": _platform_digest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class GateCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            report = json.loads((self.root / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        return report if isinstance(report, dict) and report.get("ok") else None

    def put(self, key: str, report: dict[str, Any]) -> None:
        """Keep a passing report; an unwritable cache folder is skipped (the gate's verdict stands)."""
        if not report.get("ok"):
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(report, default=str))
            tmp.replace(self.root / f"{key}.json")
        except OSError:
            pass


def default_cache() -> GateCache:
    from envs.registry import registry_dir

    return GateCache(registry_dir() / "gate")
