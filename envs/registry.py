"""Environment registry: built-ins, a decorator, `rl.envs` entry points, and local files.

Local files registered with `register_file("path.py:ClassName")` are remembered in
<registry dir>/registry.json; the last gate result per env is kept in checks.json beside it.
The registry dir is $RL_ENVS_HOME, else the repo's .cache/envs, else ~/.cache/kimi-rl/envs.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from envs.base import Environment

ENTRY_POINT_GROUP = "rl.envs"


@dataclass
class _Entry:
    name: str
    load: Callable[[], type[Environment]]
    source: str  # builtin | decorator | entry_point | file
    target: str  # where the class lives: module:Class or path.py:Class
    defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvSpec:
    name: str
    domain: str
    tools: list[str]
    dataset_sizes: dict[str, int] | None
    last_check: dict[str, Any] | None
    source: str
    target: str
    defaults: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the env could not be loaded or built


_ENTRIES: dict[str, _Entry] = {}

_BUILTINS: list[tuple[str, str, dict[str, Any]]] = [
    ("math", "envs.domains.math:MathEnv", {}),
    ("math-word", "envs.domains.math:MathEnv", {"kind": "word", "max_operand": 30}),
    ("lookup", "envs.domains.lookup:LookupEnv", {}),
    ("lookup-docs", "envs.domains.lookup:LookupEnv", {"kind": "docs"}),
    ("code", "envs.domains.code:CodeEnv", {}),
    ("code-generated", "envs.domains.code:CodeEnv", {"kind": "generated"}),
    ("humaneval", "envs.domains.code:CodeEnv", {"kind": "humaneval"}),
    ("shell", "envs.domains.shell:ShellEnv", {}),
    ("shell-fix-test", "envs.domains.shell:ShellEnv", {"kind": "fix_test"}),
    ("shell-sqlite", "envs.domains.shell:ShellEnv", {"kind": "sqlite"}),
]


def registry_dir() -> Path:
    env = os.environ.get("RL_ENVS_HOME")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[1]
    if (repo / "pyproject.toml").exists():
        return repo / ".cache" / "envs"
    return Path.home() / ".cache" / "kimi-rl" / "envs"


def _import_target(target: str) -> Callable[[], type[Environment]]:
    module, _, attr = target.partition(":")
    return lambda: _check_class(getattr(importlib.import_module(module), attr), target)


def _check_class(obj: Any, where: str) -> type[Environment]:
    if not (inspect.isclass(obj) and issubclass(obj, Environment)):
        raise TypeError(f"{where} is not an envs.Environment subclass (got {obj!r})")
    return obj


def register_env(cls: type[Environment] | None = None, *, name: str | None = None, **defaults: Any) -> Any:
    """Decorator: `@register_env` or `@register_env(name="x", kind="toy")` (defaults become make() kwargs)."""

    def wrap(klass: type[Environment]) -> type[Environment]:
        _check_class(klass, f"{klass.__module__}.{klass.__qualname__}")
        env_name = name or klass.name
        if not env_name:
            raise ValueError(f"{klass.__qualname__} has no `name`; set the class attribute or pass name=")
        _ENTRIES[env_name] = _Entry(env_name, lambda: klass, "decorator", f"{klass.__module__}:{klass.__qualname__}", dict(defaults))
        return klass

    return wrap(cls) if cls is not None else wrap


def unregister(name: str) -> None:
    """Forget a decorator or file registration (files are also removed from registry.json)."""
    _ENTRIES.pop(name, None)
    files = _read_json(registry_dir() / "registry.json")
    if name in files:
        del files[name]
        _write_json(registry_dir() / "registry.json", files)


def load_file_class(spec: str) -> type[Environment]:
    """Import `path/to/file.py:ClassName` as a module of its own and return the class."""
    path_str, sep, cls_name = spec.rpartition(":")
    if not sep or not path_str or not cls_name:
        raise ValueError(f"expected path/to/file.py:ClassName, got {spec!r}")
    path = Path(path_str).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"environment file not found: {path}")
    mod_name = "rl_envs_file_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module = sys.modules.get(mod_name)
    if module is None:
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        if file_spec is None or file_spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module
        try:
            file_spec.loader.exec_module(module)
        except Exception:
            del sys.modules[mod_name]
            raise
        try:  # Ray workers cannot import this synthetic module: ship its classes by value
            from ray import cloudpickle

            cloudpickle.register_pickle_by_value(module)
        except Exception:  # noqa: BLE001 - only needed for the Ray grader pool
            pass
    if not hasattr(module, cls_name):
        raise AttributeError(f"{path} has no class {cls_name!r}")
    return _check_class(getattr(module, cls_name), spec)


def register_file(spec: str, name: str | None = None) -> str:
    """Register a local environment file persistently; returns the environment name."""
    cls = load_file_class(spec)
    env_name = name or cls.name
    if not env_name:
        raise ValueError(f"{spec}: the class has no `name`; set it or pass a name")
    path_str, _, cls_name = spec.rpartition(":")
    target = f"{Path(path_str).expanduser().resolve()}:{cls_name}"
    files = _read_json(registry_dir() / "registry.json")
    files[env_name] = {"target": target}
    _write_json(registry_dir() / "registry.json", files)
    _ENTRIES[env_name] = _Entry(env_name, lambda: load_file_class(target), "file", target)
    return env_name


def _all_entries() -> dict[str, _Entry]:
    """Built-ins, then entry points, then files, then decorators (later ones win on a name clash)."""
    entries: dict[str, _Entry] = {}
    for name, target, defaults in _BUILTINS:
        entries[name] = _Entry(name, _import_target(target), "builtin", target, defaults)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entries[ep.name] = _Entry(ep.name, (lambda ep=ep: _check_class(ep.load(), ep.value)), "entry_point", ep.value)
    for name, rec in _read_json(registry_dir() / "registry.json").items():
        target = rec["target"]
        entries[name] = _Entry(name, (lambda t=target: load_file_class(t)), "file", target)
    entries.update(_ENTRIES)
    return entries


def env_names() -> list[str]:
    return sorted(_all_entries())


def get_entry(name: str) -> _Entry:
    entries = _all_entries()
    if name not in entries:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(sorted(entries))}")
    return entries[name]


def make(name: str, **kwargs: Any) -> Environment:
    """Build a registered environment; kwargs override the registration's defaults."""
    entry = get_entry(name)
    cls = entry.load()
    env = cls(**{**entry.defaults, **kwargs})
    if env.name != name:  # presets and renamed registrations report the name they were made under
        env.name = name
    return env


def list_envs(sizes: bool = True) -> list[EnvSpec]:
    """Every registered environment with domain, tools, dataset sizes (default kwargs) and last check."""
    checks = _read_json(registry_dir() / "checks.json")
    out = []
    for name, entry in sorted(_all_entries().items()):
        spec = EnvSpec(name=name, domain="?", tools=[], dataset_sizes=None, last_check=checks.get(name),
                       source=entry.source, target=entry.target, defaults=entry.defaults)
        try:
            if sizes:
                env = make(name)
                spec.domain, spec.tools = env.domain, [t["function"]["name"] for t in env.tools]
                spec.dataset_sizes = {s: len(env.dataset(s)) for s in ("train", "heldout")}
                env.close()
            else:
                cls = entry.load()
                spec.domain = cls.domain
        except Exception as exc:  # noqa: BLE001 - one broken env must not hide the others
            spec.error = f"{type(exc).__name__}: {exc}"
        out.append(spec)
    return out


def record_check(name: str, report: dict[str, Any]) -> None:
    """Remember the gate's verdict so `list` can show it."""
    checks = _read_json(registry_dir() / "checks.json")
    checks[name] = {"ok": report.get("ok"), "reasons": report.get("reasons", []), "tasks": report.get("tasks"),
                    "env_kwargs": report.get("env_kwargs", {}), "checked_at": report.get("checked_at", time.time())}
    _write_json(registry_dir() / "checks.json", checks)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"corrupt registry file {path}: {exc}") from exc


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    tmp.replace(path)  # atomic: concurrent readers never see half a file
