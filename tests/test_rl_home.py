"""RL_HOME: one setting for where a user's state goes (the environment registry and the gate's
cache in it, converted models, compiled-kernel caches, Ray's temp dir, the sandbox rootfs cache);
unset, everything stays where it was (the checkout's .cache/); a setting for one of them still wins."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWN = ("RL_HOME", "RL_ENVS_HOME", "RL_SANDBOX_ROOTFS", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR",
       "TRITON_CACHE_DIR")

WHERE = r"""
import json, ray
import rl.cluster as cluster
from envs.registry import registry_dir
from envs.gate_cache import default_cache
from policy.smollm2 import default_dir
from rl.config import RunConfig
from sandbox.images import ROOTFS_CACHE

class Seen(Exception):
    pass

def init(**kw):
    raise Seen(kw["_temp_dir"])

ray.init = init
try:
    cluster.start_ray(RunConfig())
except Seen as seen:
    temp_dir = str(seen)
env = cluster.actor_env()
print(json.dumps({"registry": str(registry_dir()), "gate": str(default_cache().root), "models": str(default_dir()),
                  "rootfs": str(ROOTFS_CACHE), "ray": temp_dir, "torch_extensions": env["TORCH_EXTENSIONS_DIR"],
                  "inductor": env["TORCHINDUCTOR_CACHE_DIR"], "triton": env["TRITON_CACHE_DIR"]}))
"""


def rl_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OWN}
    return {**env, **settings}


def where(**settings: str) -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-c", WHERE], cwd=REPO, env=rl_env(**settings), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_rl_home_decides_where_a_users_state_goes(tmp_path):
    home = tmp_path / "rl-home"
    places = where(RL_HOME=str(home))
    assert places == {"registry": str(home / "envs"), "gate": str(home / "envs" / "gate"),
                      "models": str(home / "models" / "smollm2-135m-instruct"), "rootfs": str(home / "sandbox-rootfs"),
                      "ray": str(home / "ray"), "torch_extensions": str(home / "torch_extensions"),
                      "inductor": str(home / "torchinductor"), "triton": str(home / "triton")}
    # a registered environment file is remembered there, and only there
    source = tmp_path / "my_env.py"
    source.write_text("from envs.domains.math import MathEnv\n\n\nclass MyMath(MathEnv):\n    name = 'my-math'\n")
    for args in (["env", "register", f"{source}:MyMath"], ["env", "list"]):
        proc = subprocess.run([sys.executable, "-m", "rl.cli", *args], cwd=REPO, env=rl_env(RL_HOME=str(home)),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "my-math" in proc.stdout
    assert "my-math" in json.loads((home / "envs" / "registry.json").read_text())


def test_unset_everything_stays_in_the_checkout_and_one_setting_still_wins(tmp_path):
    cache = REPO / ".cache"
    assert where() == {"registry": str(cache / "envs"), "gate": str(cache / "envs" / "gate"),
                       "models": str(cache / "models" / "smollm2-135m-instruct"),
                       "rootfs": str(Path.home() / ".cache" / "rl-sandbox" / "rootfs"), "ray": str(cache / "ray"),
                       "torch_extensions": str(cache / "torch_extensions"), "inductor": str(cache / "torchinductor"),
                       "triton": str(cache / "triton")}
    places = where(RL_HOME=str(tmp_path / "home"), RL_ENVS_HOME=str(tmp_path / "envs"),
                   TRITON_CACHE_DIR=str(tmp_path / "triton"), RL_SANDBOX_ROOTFS=str(tmp_path / "rootfs"))
    assert places["registry"] == str(tmp_path / "envs") and places["triton"] == str(tmp_path / "triton")
    assert places["rootfs"] == str(tmp_path / "rootfs") and places["ray"] == str(tmp_path / "home" / "ray")
