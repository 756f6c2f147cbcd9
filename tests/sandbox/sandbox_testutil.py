"""Helpers shared by the sandbox tests."""
from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

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


def use_unshare_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the process backend take its unshare fallback (skip where it cannot run)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("the unshare fallback needs util-linux unshare and root")
    monkeypatch.setenv("RL_SANDBOX_NO_BWRAP", "1")


def wait_for(cond: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Whether `cond()` came true within `timeout` seconds (asked every `interval`, and once more at the end)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return cond()
