"""Host-side bookkeeping both backends share: where sandbox state lives on this host, and
whether the process that owns a sandbox is still alive (a crashed owner's sandboxes are reaped)."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from .base import SandboxError

# per user: another user's sandboxes must not share (or squat) the dir this one's are run from
STATE_ROOT = Path(os.environ.get("RL_SANDBOX_STATE", Path(tempfile.gettempdir()) / f"rl-sandbox-{os.getuid()}"))
_checked = False


def check_state_root() -> None:
    """Create the state dir (0700), or refuse one that another user owns or may write to: it holds
    the agent each sandbox runs and the pids gc kills, so on a shared host it must be ours alone."""
    global _checked
    if _checked:
        return
    STATE_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(STATE_ROOT)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SandboxError(f"sandbox state dir {STATE_ROOT} is not a directory of this user's alone (owner uid "
                           f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); remove it or set RL_SANDBOX_STATE")
    _checked = True


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
