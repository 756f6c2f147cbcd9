"""Environment registry: built-ins, a decorator, `rl.envs` entry points, and local files.

Local files registered with `register_file("path.py:ClassName")` are remembered in
<registry dir>/registry.json; gate results are kept in checks.json beside it, per name and
class version (a hash of the class's source), so an edited class never shows an old verdict.
The registry dir is $RL_ENVS_HOME, else $RL_HOME/envs, else the repo's .cache/envs, else
~/.cache/kimi-rl/envs (sandbox/home.py).

A name is taken once: registering another class under a registered name (a built-in's
included) is refused unless `replace=True`. `resolve(name, kwargs)` gives a picklable
`EnvRecipe` (the class itself, shipped by value when worker processes could not import it):
what a driver hands to processes that build environments.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from envs.base import Environment

ENTRY_POINT_GROUP = "rl.envs"
SEP = ":"  # a family's domains are named FAMILY:member (envs.families)
MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


class EnvRegistryError(ValueError):
    """A name that is unknown, taken, or whose class cannot be loaded; the message is one line."""


class EnvFileImportError(EnvRegistryError):
    """An environment file raised at import; `failure` is what it raised, in one line."""

    def __init__(self, path: Path, failure: str):
        super().__init__(f"environment file {path} failed at import: {failure}")
        self.failure = failure


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
    last_check: dict[str, Any] | None  # the last gate verdict for this class version, if any
    source: str
    target: str
    defaults: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the env could not be loaded or built
    class_version: str | None = None
    older_checks: int = 0  # verdicts recorded for other (earlier) versions of the class
    domains: int = 0  # the family's domains (NAME:member) with no kwargs given


@dataclass(frozen=True)
class EnvRecipe:
    """How to build one configured environment: picklable, so a driver resolves the name once
    and worker processes build from the class it found (they need not see the registration)."""

    name: str
    cls: type[Environment]
    kwargs: dict[str, Any]
    domain: str = ""  # a family's domain (`math:add-9x2`): what the instance reports as its domain

    def make(self) -> Environment:
        env = self.cls(**self.kwargs)
        if env.name != self.name:  # presets and renamed registrations report the name they were made under
            env.name = self.name
        if self.domain:  # metrics, held-out tables and samples are kept per domain
            env.domain = self.domain
        return env


_ENTRIES: dict[str, _Entry] = {}

_BUILTINS: list[tuple[str, str, dict[str, Any]]] = [
    ("math", "envs.domains.math:MathEnv", {}),
    ("math-word", "envs.domains.math:MathEnv", {"kind": "word", "max_operand": 30}),
    ("lookup", "envs.domains.lookup:LookupEnv", {}),
    ("lookup-docs", "envs.domains.lookup:LookupEnv", {"kind": "docs"}),
    ("multihop", "envs.domains.multihop:MultiHopEnv", {}),  # k hops, k tool calls: effort pays
    ("code", "envs.domains.code:CodeEnv", {}),
    ("code-generated", "envs.domains.code:CodeEnv", {"kind": "generated"}),
    ("humaneval", "envs.domains.code:CodeEnv", {"kind": "humaneval"}),
    ("shell", "envs.domains.shell:ShellEnv", {}),
    ("shell-fix-test", "envs.domains.shell:ShellEnv", {"kind": "fix_test"}),
    ("shell-sqlite", "envs.domains.shell:ShellEnv", {"kind": "sqlite"}),
    ("dataset", "envs.domains.dataset:DatasetEnv", {}),  # a family of a user's data files' subsets
]


def registry_dir() -> Path:
    """$RL_ENVS_HOME, else $RL_HOME/envs (sandbox.home: the checkout's .cache/envs, or
    ~/.cache/kimi-rl/envs, where RL_HOME is unset)."""
    from sandbox.home import home_dir

    return home_dir("envs", "RL_ENVS_HOME")


def _import_target(target: str) -> Callable[[], type[Environment]]:
    module, _, attr = target.partition(":")
    return lambda: _check_class(getattr(importlib.import_module(module), attr), target)


def _check_class(obj: Any, where: str) -> type[Environment]:
    if not (inspect.isclass(obj) and issubclass(obj, Environment)):
        raise TypeError(f"{where} is not an envs.Environment subclass (got {obj!r})")
    return obj


def _ship_by_value(module: types.ModuleType) -> None:
    """Ray workers cannot import a module they never saw (a local file, a test module): have
    Ray's pickler carry its classes by value. The package's own modules stay by reference."""
    if module.__name__ == "__main__" or module.__name__.split(".")[0] == "envs":
        return  # __main__ is pickled by value anyway; envs is installed everywhere
    try:
        from ray import cloudpickle
    except ImportError:  # only Ray needs it
        return
    cloudpickle.register_pickle_by_value(module)


def _refuse_taken(name: str, target: str, replace: bool) -> None:
    """Refuse a name registered to another class, unless asked to replace it."""
    if replace:
        return
    existing = _all_entries().get(name)
    if existing is not None and existing.target != target:
        raise EnvRegistryError(f"environment name {name!r} is already registered ({existing.source}: {existing.target}); "
                               f"pass replace=True (`rl env register --replace`) to replace it")


def register_env(cls: type[Environment] | None = None, *, name: str | None = None, replace: bool = False,
                 **defaults: Any) -> Any:
    """Decorator: `@register_env` or `@register_env(name="x", kind="toy")` (defaults become make() kwargs).

    A name registered to another class (built-ins included) is refused unless replace=True;
    registering the same class again is a no-op."""

    def wrap(klass: type[Environment]) -> type[Environment]:
        _check_class(klass, f"{klass.__module__}.{klass.__qualname__}")
        env_name = name or klass.name
        if not env_name:
            raise ValueError(f"{klass.__qualname__} has no `name`; set the class attribute or pass name=")
        target = f"{klass.__module__}:{klass.__qualname__}"
        _refuse_taken(env_name, target, replace)
        _ENTRIES[env_name] = _Entry(env_name, lambda: klass, "decorator", target, dict(defaults))
        return klass

    return wrap(cls) if cls is not None else wrap


def unregister(name: str) -> str:
    """Forget a decorator or file registration (files are also removed from registry.json) and
    its recorded checks; returns where it pointed. Built-ins and entry points cannot be removed."""
    entries = _all_entries()
    if name not in entries:
        raise EnvRegistryError(f"unknown environment {name!r}; registered: {', '.join(sorted(entries))}")
    entry = entries[name]
    if entry.source == "builtin":
        raise EnvRegistryError(f"{name!r} is a built-in environment and cannot be unregistered")
    if entry.source == "entry_point":
        raise EnvRegistryError(f"{name!r} comes from an installed package's entry point ({entry.target}); "
                               f"uninstall the package to remove it")
    _ENTRIES.pop(name, None)
    for file in ("registry.json", "checks.json"):
        data = _read_json(registry_dir() / file)
        if name in data:
            del data[name]
            _write_json(registry_dir() / file, data)
    return entry.target


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
        except BaseException as exc:  # noqa: BLE001 - a user's file may do anything at import, sys.exit too
            del sys.modules[mod_name]
            if isinstance(exc, KeyboardInterrupt):  # the user's own Ctrl-C stays one
                raise
            raise EnvFileImportError(path, _import_failure(exc)) from None
        _ship_by_value(module)
    if not hasattr(module, cls_name):
        raise AttributeError(f"{path} has no class {cls_name!r}")
    return _check_class(getattr(module, cls_name), spec)


def _import_failure(exc: BaseException) -> str:
    """One line for what a module raised at import (sys.exit included)."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"SyntaxError: {exc.msg} (line {exc.lineno})"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def register_file(spec: str, name: str | None = None, replace: bool = False) -> str:
    """Register a local environment file persistently; returns the environment name.

    A name registered to another class (built-ins included) is refused unless replace=True."""
    cls = load_file_class(spec)
    env_name = name or cls.name
    if not env_name:
        raise ValueError(f"{spec}: the class has no `name`; set it or pass a name")
    path_str, _, cls_name = spec.rpartition(":")
    target = f"{Path(path_str).expanduser().resolve()}:{cls_name}"
    _refuse_taken(env_name, target, replace)
    files = _read_json(registry_dir() / "registry.json")
    files[env_name] = {"target": target}
    _write_json(registry_dir() / "registry.json", files)
    _ENTRIES.pop(env_name, None)  # a decorator registration under this name is replaced too
    return env_name


def _all_entries() -> dict[str, _Entry]:
    """Built-ins, then entry points, then files, then decorators (later ones win on a name clash,
    which only `replace=True` can create)."""
    entries: dict[str, _Entry] = {}
    for name, target, defaults in _BUILTINS:
        entries[name] = _Entry(name, _import_target(target), "builtin", target, defaults)
    for ep in _entry_points(_path_stamp()):
        entries[ep.name] = _Entry(ep.name, (lambda ep=ep: _check_class(ep.load(), ep.value)), "entry_point", ep.value)
    for name, target in _file_targets().items():
        entries[name] = _Entry(name, (lambda t=target: load_file_class(t)), "file", target)
    entries.update(_ENTRIES)
    return entries


@functools.lru_cache(maxsize=8)
def _entry_points(_stamp: tuple) -> tuple[importlib.metadata.EntryPoint, ...]:
    """The installed packages' `rl.envs` entry points, read once per state of the import path (reading
    every package's metadata takes tens of milliseconds; a run resolves hundreds of domains)."""
    return tuple(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _path_stamp() -> tuple[tuple[str, int | None], ...]:
    """The import path and each folder's modification time: a package installed or removed changes it."""
    out = []
    for path in sys.path:
        try:
            out.append((path, os.stat(path or ".").st_mtime_ns))
        except OSError:
            out.append((path, None))
    return tuple(out)


def _file_targets() -> dict[str, str]:
    """registry.json's {name: "path.py:Class"}; a record of another shape is refused with one line."""
    path = registry_dir() / "registry.json"
    targets = {}
    for name, rec in _read_json(path).items():
        target = rec.get("target") if isinstance(rec, dict) else None
        if not isinstance(target, str) or ":" not in target:
            raise EnvRegistryError(f"corrupt registry file {path}: the entry {name!r} has no \"target\": "
                                   f"\"path.py:Class\"; fix or delete the file (then register again)")
        targets[name] = target
    return targets


def env_names() -> list[str]:
    return sorted(_all_entries())


def get_entry(name: str) -> _Entry:
    entries = _all_entries()
    if name not in entries:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(sorted(entries))}")
    return entries[name]


def resolve(name: str, kwargs: dict[str, Any] | None = None) -> EnvRecipe:
    """Load a registered environment's class here and return a picklable recipe to build it; a family's
    domain (`FAMILY:member`) is the family's class with the member's kwargs over the entry's."""
    entries = _all_entries()  # once: a run resolves hundreds of domains
    family, sep, member = name.partition(SEP)
    key = family if sep and name not in entries else name
    if key not in entries:
        raise KeyError(f"unknown environment {key!r}; registered: {', '.join(sorted(entries))}")
    entry = entries[key]
    cls = entry.load()
    module = sys.modules.get(cls.__module__)
    if entry.source == "decorator" and module is not None:
        _ship_by_value(module)
    kwargs = {**entry.defaults, **(kwargs or {})}
    if key == name:
        return EnvRecipe(name, cls, kwargs)
    members = _declared(entry, kwargs)
    if member not in members:
        close = difflib.get_close_matches(member, list(members), n=1)
        hint = f"did you mean {family}{SEP}{close[0]}? " if close else ""
        raise EnvRegistryError(f"family {family!r} has no domain {member!r}; {hint}it has {len(members)}"
                               + (f" (e.g. {', '.join(sorted(members)[:4])})" if members else
                                  " with these kwargs"))
    made_by = members[member]
    clash = next((k for k in made_by if k in kwargs and kwargs[k] != made_by[k]), None)
    if clash is not None:
        raise EnvRegistryError(f"domain {name!r} is {clash}={made_by[clash]!r}; its entry's kwargs say "
                               f"{clash}={kwargs[clash]!r} (name another domain instead)")
    return EnvRecipe(name, cls, {**kwargs, **made_by}, domain=name)


def family_domains(name: str, kwargs: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The domains a registered environment declares ({member: kwargs}), given a config entry's kwargs.
    None for a preset whose defaults fix what makes the domains (math-word: its class's family is reached
    through `math`); a registration with other defaults is a family of its own (a dataset's files)."""
    entry = _all_entries().get(name)
    return {} if entry is None else _declared(entry, kwargs)


def _declared(entry: _Entry, kwargs: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    try:
        members = dict(entry.load().domains(**{**entry.defaults, **(kwargs or {})}))
    except Exception as exc:  # noqa: BLE001 - a family that cannot list its domains is one line
        lines = str(exc).strip().splitlines()
        raise EnvRegistryError(f"family {entry.name!r} cannot list its domains: {type(exc).__name__}"
                               + (f": {lines[0]}" if lines else "")) from None
    if any(set(made_by) & set(entry.defaults) for made_by in members.values()):
        return {}  # a preset fixes what makes its class's domains (math-word's kind): they are the class's family
    bad = next((m for m in members if not MEMBER_NAME.fullmatch(str(m))), None)
    if bad is not None:  # metric keys and file names hold domain names
        raise EnvRegistryError(f"family {entry.name!r} declares a domain named {bad!r}; a domain name is letters, "
                               f"digits, '.', '_', '+' and '-'")
    return members


def make(name: str, **kwargs: Any) -> Environment:
    """Build a registered environment; kwargs override the registration's defaults."""
    return resolve(name, kwargs).make()


def check_names(names: Sequence[str], where: str = "envs") -> None:
    """For a run config, before anything starts: every name is registered and its class loads.

    Raises EnvRegistryError with one line naming the entry (`where[i]`), a close match, and
    for a class that does not load, where it lives and the error."""
    entries = _all_entries()
    for i, name in enumerate(names):
        family, sep, _ = name.partition(SEP)
        if name not in entries and sep:  # a family's domain: its member is checked with the entry's kwargs
            name = family  # (check_kwargs)
        if name not in entries:
            close = difflib.get_close_matches(name, list(entries), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise EnvRegistryError(f"unknown {'family' if sep else 'environment'} {name!r} in {where}[{i}]{hint} "
                                   f"registered: {', '.join(sorted(entries))}")
        entry = entries[name]
        try:
            entry.load()
        except Exception as exc:  # noqa: BLE001 - any import error becomes the one-line message
            if isinstance(exc, EnvFileImportError):  # the target already names the file
                failure = exc.failure
            else:
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                failure = f"{type(exc).__name__}: {detail}"
            raise EnvRegistryError(f"environment {name!r} in {where}[{i}] cannot be loaded from {entry.target}: "
                                   f"{failure}") from None


def check_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """For a run config, before anything starts: the registered environment `name` takes `kwargs` (over its
    registration's defaults). A name its constructor does not take, or a value not of a parameter's simple
    type (bool, int, float, str, None), is refused from the signature; then the environment is built once,
    so that the constructor's own checks run (a built-in's constructor is cheap and opens no sandbox: one
    opens at reset). Raises EnvRegistryError with one line."""
    recipe = resolve(name, kwargs)
    params = constructor_params(recipe.cls)
    for key, value in recipe.kwargs.items() if params is not None else ():
        if key not in params:
            close = difflib.get_close_matches(key, list(params), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise EnvRegistryError(f"environment {name!r} takes no argument {key!r}; {hint}"
                                   f"it takes: {', '.join(params)}")
        if not _fits(value, params[key]):
            kind = params[key].__name__ if isinstance(params[key], type) else str(params[key])
            raise EnvRegistryError(f"environment {name!r}: {key!r} must be {kind}, got {repr(value)[:80]}")
    try:
        recipe.make().close()
    except Exception as exc:  # noqa: BLE001 - whatever the constructor raises becomes the one line
        lines = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise EnvRegistryError(f"environment {name!r} refuses these kwargs: {detail}") from None


def constructor_params(cls: type) -> dict[str, Any] | None:
    """The keyword arguments `cls(...)` takes, each with its annotation (Any where none): its __init__'s and,
    through a `**kwargs`, those of the next __init__ up the MRO (environments pass theirs on to
    Environment's). None where a signature cannot be read."""
    params: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:  # reached through a **kwargs: object() takes none
            return params
        try:
            signature = inspect.signature(init)
        except (TypeError, ValueError):
            return None
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # noqa: BLE001 - a hint naming what only type checkers import: no types then
            hints = {}
        passes_on = False
        for p in list(signature.parameters.values())[1:]:  # after self
            if p.kind is p.VAR_KEYWORD:
                passes_on = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                params.setdefault(p.name, hints.get(p.name, Any))
        if not passes_on:
            return params
    return params


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` has a parameter's simple annotated type; other annotations (mappings, specs) are
    the constructor's to check."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    return True


def class_version(cls: type) -> str:
    """A fingerprint of an environment class: its name and the source of every module in its
    MRO, so editing the class, a base class or their modules gives a new version."""
    digest = hashlib.sha256(f"{cls.__module__}:{cls.__qualname__}".encode())
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        path = getattr(module, "__file__", None)
        if path and os.path.isfile(path):
            digest.update(Path(path).read_bytes())
    return f"{cls.__qualname__}@{digest.hexdigest()[:12]}"


def list_envs(sizes: bool = True) -> list[EnvSpec]:
    """Every registered environment with domain, tools, dataset sizes (default kwargs) and the
    last check of its current class version."""
    checks = _read_json(registry_dir() / "checks.json")
    out = []
    for name, entry in sorted(_all_entries().items()):
        spec = EnvSpec(name=name, domain="?", tools=[], dataset_sizes=None, last_check=None,
                       source=entry.source, target=entry.target, defaults=entry.defaults)
        try:
            cls = entry.load()
            spec.domain, spec.class_version = cls.domain, class_version(cls)
            by_version = _versioned(checks.get(name))
            spec.last_check = by_version.get(spec.class_version)
            spec.older_checks = len(by_version) - (spec.last_check is not None)
            spec.domains = len(family_domains(name))
            if sizes and not _needs_arguments(cls, entry.defaults):  # a dataset family needs its files
                env = make(name)
                spec.domain, spec.tools = env.domain, [t["function"]["name"] for t in env.tools]
                spec.dataset_sizes = {s: len(env.dataset(s)) for s in ("train", "heldout")}
                env.close()
        except Exception as exc:  # noqa: BLE001 - one broken env must not hide the others
            spec.error = f"{type(exc).__name__}: {exc}"
        out.append(spec)
    return out


def _needs_arguments(cls: type, defaults: dict[str, Any]) -> bool:
    """Whether `cls(**defaults)` lacks a required argument."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in defaults
               for p in params)


def _versioned(record: Any) -> dict[str, dict[str, Any]]:
    """checks.json keeps {name: {class version: verdict}}; a verdict from before versions had no key."""
    if not isinstance(record, dict) or "ok" in record:
        return {}
    return record


def record_check(name: str, report: dict[str, Any]) -> None:
    """Remember the gate's verdict for this class version so `list` can show it."""
    version = report.get("class_version")
    if not version:
        return
    checks = _read_json(registry_dir() / "checks.json")
    by_version = _versioned(checks.get(name))
    by_version[version] = {"ok": report.get("ok"), "reasons": report.get("reasons", []), "tasks": report.get("tasks"),
                           "env_kwargs": report.get("env_kwargs", {}), "checked_at": report.get("checked_at", time.time())}
    checks[name] = by_version
    _write_json(registry_dir() / "checks.json", checks)


def _read_json(path: Path) -> dict[str, Any]:
    """A registry file's object ({} when absent); EnvRegistryError names a file that cannot be used."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise EnvRegistryError(f"cannot read registry file {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep, a number too long
        detail = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EnvRegistryError(f"corrupt registry file {path}: {detail}; fix or delete it") from None
    if not isinstance(data, dict):
        raise EnvRegistryError(f"corrupt registry file {path}: expected a JSON object, got {type(data).__name__}; "
                               f"fix or delete it")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    tmp.replace(path)  # atomic: concurrent readers never see half a file
