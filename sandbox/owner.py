"""Host-side bookkeeping both backends share: where sandbox state lives on this host, and
whether the process that owns a sandbox is still alive (a crashed owner's sandboxes are reaped)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

STATE_ROOT = Path(os.environ.get("RL_SANDBOX_STATE", Path(tempfile.gettempdir()) / "rl-sandbox"))


def start_time(pid: int) -> int | None:
    """Process start time (clock ticks since boot) so a recycled pid is not mistaken for the owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owner_alive(pid: int | None, start: int | None) -> bool:
    if not pid:
        return False
    st = start_time(int(pid))
    return st is not None and (start is None or st == start)
