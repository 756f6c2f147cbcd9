"""Reading a run folder while the trainer writes it: JSONL files are tailed from the last complete
line, JSON/YAML files re-read when they change. A file that is missing, half-written or corrupt
is reported as a problem and never stops the reader."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from rl.integrity import parse_record
from rl.run_folder import CONFIG, METRICS

# rollouts.jsonl holds whole transcripts and grows fastest: a reader opening a long run starts
# this far from its end (only the recent samples are shown anyway).
ROLLOUTS_TAIL_BYTES = 32 << 20
# The trainer writes a line in one go: a last line still without its newline this long after the
# file last changed is a write the run did not finish (it was killed), not one in progress.
TORN_AFTER_S = 10.0


class JsonlTail:
    """The records appended to a JSONL file since the last `read()`; a line without its newline
    yet is left for the next call, and reported as torn once the file has stopped changing (or at
    once, for a `final` read)."""

    def __init__(self, path: Path, start_from_end: int | None = None) -> None:
        self.path = path
        self.offset = 0
        self.start_from_end = start_from_end
        self._identity: tuple[int, int] | None = None

    def read(self, final: bool = False) -> tuple[list[dict[str, Any]], bool, list[str]]:
        """(new records, whether the file was replaced so earlier records are void, problems).
        `final`: nothing more will be written (a report of a run), so an unfinished line is torn."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return [], False, []
        replaced = False
        identity = (stat.st_dev, stat.st_ino)
        if self._identity is not None and (identity != self._identity or stat.st_size < self.offset):
            self.offset, replaced = 0, True
        self._identity = identity
        if stat.st_size == self.offset:
            return [], replaced, []
        with self.path.open("rb") as f:
            skip_partial = False
            if self.offset == 0 and self.start_from_end and stat.st_size > self.start_from_end:
                self.offset, skip_partial = stat.st_size - self.start_from_end, True
            f.seek(self.offset)
            data = f.read(stat.st_size - self.offset)
        end = data.rfind(b"\n") + 1
        position, lines = self.offset, data[:end].split(b"\n")[:-1]
        self.offset += end
        records, problems = [], []
        for i, line in enumerate(lines):
            start, position = position, position + len(line) + 1
            if (i == 0 and skip_partial) or not line.strip():  # started mid-file: the first line is a fragment
                continue
            record, problem = parse_record(line)
            if record is None:
                problems.append(f"{self.path.name}: the line at byte {start} {problem}; skipped")
            else:
                records.append(record)
        fragment = data[end:]
        if fragment.strip() and (final or time.time() - stat.st_mtime > TORN_AFTER_S):
            record, _ = parse_record(fragment)
            if record is not None:  # whole but for its newline
                records.append(record)
                self.offset += len(fragment)
            else:
                problems.append(f"{self.path.name}: the last line (at byte {self.offset}) is cut off, a write "
                                f"the run did not finish; ignored")
        return records, replaced, problems


class WatchedFile:
    """A JSON or YAML file, parsed again whenever its size or modification time changes."""

    def __init__(self, path: Path, parse: Callable[[str], Any]) -> None:
        self.path = path
        self.parse = parse
        self._seen: tuple[int, int] | None = None

    def read(self) -> tuple[bool, Any, str | None]:
        """(changed, value, problem): value is None for a missing file; a file that does not parse
        keeps `changed` False so the last good value stays."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            changed = self._seen is not None
            self._seen = None
            return changed, None, None
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            return False, None, None
        try:
            value = self.parse(self.path.read_text())
        except (ValueError, RecursionError, yaml.YAMLError) as exc:
            return False, None, f"{self.path.name}: cannot be parsed ({type(exc).__name__}); showing the last good copy"
        self._seen = seen
        return True, value, None


def json_file(path: Path) -> WatchedFile:
    return WatchedFile(path, json.loads)


def yaml_file(path: Path) -> WatchedFile:
    return WatchedFile(path, yaml.safe_load)


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in (CONFIG, METRICS))
