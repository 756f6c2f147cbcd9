"""What a run folder holds after a crash, read with care: JSONL files whose last line may be torn
(a run killed mid-write), and checkpoints whose manifest (every file's size and sha256, written
last) tells a whole checkpoint from a torn one. The run folder's writer (rl/run_folder.py, the
trainer) and its readers (the dashboard, rl report, rl eval) all use these functions; nothing
here imports beyond the standard library, so the dashboard stays light."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

MANIFEST = "manifest.json"
# The trainer writes flat records (a transcript is a list of messages); a line nested deeper is
# not one of them, and walking it could exhaust the interpreter's recursion limit later.
MAX_DEPTH = 32
_HASH_CHUNK = 8 << 20
_VERIFIED: set[tuple[str, tuple[tuple[str, str, int, int], ...]]] = set()  # checkpoints hashed whole, by file stats

log = logging.getLogger(__name__)


# -- JSONL -------------------------------------------------------------------------------------------
def parse_record(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One JSONL line: (its record, None), or (None, why it is not a record)."""
    try:
        value = json.loads(line)
    except RecursionError:
        return None, f"is nested deeper than {MAX_DEPTH} levels"
    except ValueError:  # not JSON, not UTF-8, or an integer longer than Python converts
        return None, "is not JSON"
    if not isinstance(value, dict):
        return None, "is not a JSON object"
    if _nesting_depth(value, MAX_DEPTH) > MAX_DEPTH:
        return None, f"is nested deeper than {MAX_DEPTH} levels"
    return value, None


def _nesting_depth(value: Any, stop_after: int) -> int:
    """How deeply lists and dicts nest in `value`, counted without recursion; stops past `stop_after`."""
    deepest, stack = 0, [(value, 0)]
    while stack and deepest <= stop_after:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def read_jsonl(path: Path, warn: Callable[[str], None] = log.warning) -> list[dict[str, Any]]:
    """Every record of a JSONL file ([] when it is missing). A torn last line (a write the run did
    not finish) and lines that are not records are dropped, each with a warning naming the line."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record, problem = parse_record(line)
        if record is not None:
            records.append(record)
        elif number == len(lines):  # no newline after it: the write was cut off
            warn(f"{path.name}: the last line (line {number}) is cut off, a write the run did not finish; dropped")
        else:
            warn(f"{path.name}: line {number} {problem}; dropped")
    return records


# -- checkpoint manifests ----------------------------------------------------------------------------
def write_manifest(directory: Path) -> Path:
    """Record the size and sha256 of every file under `directory` in its manifest.json. Call it
    once everything else of the checkpoint is on disk: a checkpoint without one is incomplete."""
    files = {rel: _describe(directory / rel) for rel in _files_under(directory) if rel != MANIFEST}
    path = directory / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp{os.getpid()}")
    with tmp.open("w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)  # atomic: a manifest is whole or absent
    return path


def verify_manifest(directory: Path) -> str | None:
    """None when every file the manifest lists is there with its size and sha256; otherwise one
    line saying what is wrong (paths relative to `directory`). Files added later (an eval.json
    beside the policy) are not checked."""
    files, problem = _read_manifest(directory)
    if problem is not None:
        return problem
    seen = []
    for rel, want in sorted(files.items()):
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        stat = path.stat()
        if stat.st_size != want["bytes"]:
            return f"{rel} has {stat.st_size} bytes, its manifest says {want['bytes']}"
        seen.append((rel, want["sha256"], stat.st_size, stat.st_mtime_ns))
    key = (str(directory.resolve()), tuple(seen))
    if key in _VERIFIED:  # resuming asks more than once; the files have not changed since
        return None
    for rel, sha256, _, _ in seen:
        try:
            digest = _sha256(directory / rel)
        except OSError as exc:
            return f"{rel} cannot be read ({exc.strerror or exc})"
        if digest != sha256:
            return f"{rel} does not match the sha256 in its manifest"
    _VERIFIED.add(key)
    return None


def _read_manifest(directory: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(relative path -> {"bytes", "sha256"}, None) or ({}, the problem)."""
    path = directory / MANIFEST
    if not path.is_file():
        return {}, f"no {MANIFEST} (it was cut off before it was complete, or written before checkpoints " \
                   f"carried one)"
    record, problem = parse_record(path.read_bytes())
    if record is None:
        return {}, f"its {MANIFEST} {problem}"
    files = record.get("files")
    if not isinstance(files, dict) or not files or not all(_is_entry(rel, v) for rel, v in files.items()):
        return {}, f"its {MANIFEST} does not list files with their bytes and sha256"
    return files, None


def _is_entry(rel: str, value: Any) -> bool:
    """A manifest entry: a file inside the checkpoint (a relative path a file system takes) with its
    size and hash."""
    try:
        os.fsencode(rel)  # a lone surrogate the file system cannot take
    except UnicodeEncodeError:
        return False
    parts = Path(rel).parts
    inside = bool(parts) and not Path(rel).is_absolute() and ".." not in parts and "\0" not in rel
    size = value.get("bytes") if isinstance(value, dict) else None
    return inside and isinstance(size, int) and not isinstance(size, bool) \
        and isinstance(value.get("sha256"), str)


def _files_under(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def _describe(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
