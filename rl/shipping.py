"""Directories that actors on other nodes need (the tokenizer, a transformers model, a checkpoint to
resume from), without assuming the nodes share a filesystem.

A `ShippedDir` names a directory on the driver's node. An actor on that node reads it in place; an
actor elsewhere unpacks its files, packed once into Ray's object store, into a node-local cache
(each directory once per node, whatever the number of actors there). With `ray.shared_filesystem:
true` every node reads the path itself and nothing is packed. Files written by an actor on another
node come back the other way, as a `PackedFiles` the driver unpacks where they belong."""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

# the node-local cache of unpacked directories (never on a shared filesystem: one per node)
CACHE = Path(tempfile.gettempdir()) / "rl-shipped"


def this_node() -> str:
    return ray.get_runtime_context().get_node_id()


@dataclass(frozen=True)
class ShippedDir:
    path: str  # on the driver's node
    node_id: str  # the driver's node
    digest: str  # names its unpacked copy on other nodes
    blob: Any = None  # ObjectRef of the packed files; None: every node reads `path` (shared filesystem)

    def local(self) -> Path:
        """The directory on this node: `path` on the driver's node (or a shared filesystem), else
        the unpacked copy in this node's cache (unpacked by the first actor that asks)."""
        if self.blob is None or this_node() == self.node_id:
            return Path(self.path)
        target = CACHE / self.digest / Path(self.path).name
        if not target.exists():
            unpack(ray.get(self.blob), target)
        return target


def ship_dir(path: str | Path, shared_filesystem: bool = False) -> ShippedDir:
    """A directory of the driver's node, as every node of the cluster will read it."""
    path = Path(path).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"no directory {path} to send to the cluster's nodes")
    node = this_node()
    if shared_filesystem:
        return ShippedDir(str(path), node, "", None)
    return ShippedDir(str(path), node, _digest(path), ray.put(pack(path)))


def localize(spec: dict[str, Any]) -> dict[str, Any]:
    """A model spec whose shipped directories are replaced by their paths on this node."""
    return {k: str(v.local()) if isinstance(v, ShippedDir) else v for k, v in spec.items()}


@dataclass(frozen=True)
class PackedFiles:
    """Files an actor wrote on its node, relative to a root, packed for the driver."""

    data: bytes
    files: int

    def unpack_into(self, root: Path) -> None:
        _extract(self.data, root)


def pack_files(root: Path, relative: list[str]) -> PackedFiles:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel in sorted(relative):
            tar.add(str(root / rel), arcname=rel, recursive=False)
    return PackedFiles(buf.getvalue(), len(relative))


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def pack(path: Path) -> bytes:
    return pack_files(path, files_under(path)).data


def unpack(data: bytes, target: Path) -> None:
    """Unpack into `target` atomically: a half-unpacked copy is never read (actors of one node race)."""
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
    _extract(data, staging)
    try:
        os.rename(staging, target)
    except OSError:  # another actor of this node got there first: its copy is the same
        shutil.rmtree(staging, ignore_errors=True)


def _extract(data: bytes, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(root, filter="data")  # no member may land outside root


def _digest(path: Path) -> str:
    """Names the directory's contents as they are now (paths, sizes, modification times)."""
    h = hashlib.sha256(str(path).encode())
    for rel in files_under(path):
        st = (path / rel).stat()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:24]
