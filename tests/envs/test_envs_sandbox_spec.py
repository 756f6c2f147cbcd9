"""An environment declares the sandbox it needs; its constructor's `sandbox` (a run config's
entry) overrides fields of it; an episode that opens its own sandbox gets exactly that one."""
from __future__ import annotations

import pytest

import envs
from envs.domains.shell import ShellEnv
from envs.toolcall import format_tool_call
from sandbox import SandboxSpec


class TightShellEnv(ShellEnv):
    name = "shell-tight"
    sandbox_spec = SandboxSpec(memory_mb=160, pids=40)


def test_an_environment_declares_its_sandbox_and_an_override_replaces_fields():
    env = TightShellEnv(n_train=8, n_heldout=2, sandbox_backend="process", sandbox={"network": True})
    assert env.sandbox_spec == SandboxSpec(memory_mb=160, pids=40, network=True)
    assert TightShellEnv.sandbox_spec.network is None  # the class declaration is left as it was
    assert envs.make("shell").sandbox_spec == SandboxSpec()  # environments that declare nothing
    with pytest.raises(ValueError, match="unknown key 'memory'"):
        TightShellEnv(sandbox={"memory": 100})


def test_an_episode_opening_its_own_sandbox_gets_the_declared_one():
    env = TightShellEnv(n_train=8, n_heldout=2, sandbox_backend="process", sandbox={"network": True})
    env.reset(seed=0)
    try:
        assert env.sandbox.limits == env.sandbox_spec.limits()
        hog = format_tool_call("bash", {"command": "python3 -c 'x = bytearray(300 << 20); print(len(x))'"})
        obs, *_ = env.step(hog)
        assert "exit code 0" not in obs, obs  # 300 MiB does not fit in 160
        obs, *_ = env.step(format_tool_call("bash", {"command": "python3 -c 'import socket; "
                                                                "print(len(socket.if_nameindex()))'"}))
        assert int(obs.split()[0]) > 1, obs  # network on: more than loopback
    finally:
        env.close()
