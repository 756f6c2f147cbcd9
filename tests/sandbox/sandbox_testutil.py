"""Helpers shared by the sandbox tests."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

RUN = f"pytest-{uuid.uuid4().hex[:8]}"  # the run label of every sandbox of this test session


def host_pids(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (sandboxed processes are visible here)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out
