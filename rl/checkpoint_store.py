"""A copy of a run's checkpoints beyond its run folder (`checkpoint.dir`): a path (another disk, a
shared filesystem) or an fsspec URL (s3://bucket/prefix, gs://..., memory:// in tests), under
<dir>/<run name>/step_N.

The run folder on the driver's node always holds the checkpoint first, whole (its manifest written
last, rl/integrity.py). An upload then copies every file, the manifest after them, and the `latest`
marker after that: a partial upload has no manifest (or one its files do not match), so it never
looks complete. A download takes the newest checkpoint whose manifest verifies once its files are
on the local disk."""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from rl.errors import RunRefused
from rl.integrity import MANIFEST, verify_manifest
from rl.run_folder import LATEST


class CheckpointMirror:
    """The checkpoints under one URL (a run's: <checkpoint.dir>/<run name>)."""

    def __init__(self, url: str, what: str = "checkpoint.dir") -> None:
        import fsspec

        self.url = url.rstrip("/")
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as exc:  # an unknown protocol, or its package (s3fs, gcsfs) missing
            raise RunRefused(f"{what}={url!r}: {exc}") from None
        self.root = root.rstrip("/")

    @classmethod
    def of_run(cls, url: str, run_name: str) -> "CheckpointMirror":
        return cls(f"{url.rstrip('/')}/{run_name}")

    def where(self, tag: str) -> str:
        return f"{self.url}/{tag}"

    def upload(self, tag_dir: Path) -> None:
        """Copy a whole local checkpoint: its files, then its manifest, then the `latest` marker."""
        target = f"{self.root}/{tag_dir.name}"
        if self.fs.exists(f"{target}/{MANIFEST}"):  # a step saved again is not whole until its new manifest is up
            self.fs.rm(f"{target}/{MANIFEST}")
        files = sorted(p for p in tag_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
        for path in files:
            remote = f"{target}/{path.relative_to(tag_dir).as_posix()}"
            self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), remote)
        self.fs.put_file(str(tag_dir / MANIFEST), f"{target}/{MANIFEST}")
        self.fs.pipe_file(f"{self.root}/{LATEST}", tag_dir.name.encode())

    def steps(self) -> list[tuple[int, str]]:
        """(step, tag) of the checkpoints there, whole or not, oldest first."""
        if not self.fs.exists(self.root):
            return []
        tags = [Path(p.rstrip("/")).name for p in self.fs.ls(self.root, detail=False)]
        return sorted((int(t[5:]), t) for t in tags if t.startswith("step_") and t[5:].isdigit())

    def prune(self, keep: int) -> None:
        for _, tag in self.steps()[:-keep]:
            self.fs.rm(f"{self.root}/{tag}", recursive=True)

    def download_newest(self, checkpoints: Path) -> tuple[str | None, list[str]]:
        """Fetch the newest checkpoint whose manifest verifies into `checkpoints/<tag>`: (its tag or
        None, a line for each newer one passed over)."""
        passed_over = []
        for _, tag in reversed(self.steps()):
            problem = self.fetch(tag, checkpoints / tag)
            if problem is None:
                return tag, passed_over
            passed_over.append(f"{self.where(tag)} is torn ({problem})")
        return None, passed_over

    def fetch(self, tag: str, dest: Path) -> str | None:
        """Download one checkpoint to `dest` (replacing what is there) if it verifies: None, or why not."""
        staging = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}")
        try:
            self.fs.get(f"{self.root}/{tag}/", str(staging) + "/", recursive=True)
            problem = verify_manifest(staging)
            if problem is None:
                shutil.rmtree(dest, ignore_errors=True)
                staging.rename(dest)
            return problem
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def fetch_checkpoint(url: str, into: Path) -> Path:
    """`rl eval --checkpoint URL/step_N`: the checkpoint downloaded into `into/step_N`, verified."""
    run_url, tag = url.rstrip("/").rsplit("/", 1)
    problem = CheckpointMirror(run_url, "--checkpoint").fetch(tag, into / tag)
    if problem is not None:
        raise RunRefused(f"--checkpoint: {url} is torn: {problem}")
    return into / tag
