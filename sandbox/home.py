"""Where kimi-rl keeps a user's state: the environment registry (and the quality gate's cache in
it), converted models, compiled-kernel caches (torch extensions, inductor, Triton), Ray's temp dir
for a local cluster and the sandbox root filesystem cache.

One setting decides: `RL_HOME`. Unset, each goes where it always went: inside the checkout's
`.cache/` when the code runs from a checkout (a `pyproject.toml` beside the packages), else under
`~/.cache/kimi-rl/` (the rootfs cache under `~/.cache/rl-sandbox/`). Set, all of them go under it
(`$RL_HOME/envs`, `$RL_HOME/models`, `$RL_HOME/ray`, ...), so a shared or read-only install never
writes into its own files. A setting for one of them (`RL_ENVS_HOME`, `RL_SANDBOX_ROOTFS`,
`TORCH_EXTENSIONS_DIR`, `TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`, the config's `ray.temp_dir`)
still wins over `RL_HOME`.

It lives in `sandbox`, the package every other one imports and that imports none of ours; it
imports nothing but the standard library. Read at each call, not at import.
"""
from __future__ import annotations

import os
from pathlib import Path

HOME_VAR = "RL_HOME"
CHECKOUT = Path(__file__).resolve().parents[1]


def rl_home() -> Path:
    """$RL_HOME; else the checkout's `.cache` (running from a checkout); else ~/.cache/kimi-rl."""
    set_to = os.environ.get(HOME_VAR)
    if set_to:
        return Path(set_to).expanduser()
    if (CHECKOUT / "pyproject.toml").exists():
        return CHECKOUT / ".cache"
    return Path.home() / ".cache" / "kimi-rl"


def home_dir(name: str, override: str | None = None) -> Path:
    """`rl_home() / name`, unless the environment variable `override` names another place."""
    set_to = os.environ.get(override) if override else None
    return Path(set_to).expanduser() if set_to else rl_home() / name
