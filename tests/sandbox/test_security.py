"""Promises of SECURITY.md that tests elsewhere do not hold: nothing of the owner's environment inside,
an agent out of the sandbox's reach, bounded /dev/shm and logs, no privileges to regain, memory in
files and CPU within the limits, safe downloads, a state dir no other user can plant things in."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

import sandbox
from sandbox import SandboxError, SandboxLimits, owner, process_backend

# every environ (and command line) the sandbox can read: its own, its agent's, any other process's
_READ_PROC = r"""
import json, os
out = {}
for name in os.listdir("/proc"):
    if name.isdigit() or name == "self":
        for part in ("environ", "cmdline"):
            try:
                with open("/proc/%s/%s" % (name, part), "rb") as f:
                    out[name + "/" + part] = f.read().decode("latin-1")
            except OSError:
                pass
print(json.dumps(out))
"""


def _process_tree(root_pid: int) -> dict[int, tuple[int, bytes]]:
    """For root_pid and every descendant, read from the host: its pid in its own pid namespace and
    its environ."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) if d.name.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            ns_pid = int(next(ln for ln in status.splitlines() if ln.startswith("NSpid:")).split()[-1])
            out[pid] = (ns_pid, Path(f"/proc/{pid}/environ").read_bytes())
        except OSError:
            pass
        todo += children.get(pid, [])
    return out


def test_the_owners_environment_never_reaches_the_sandbox(backend, make_sb, monkeypatch: pytest.MonkeyPatch):
    canary = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("RL_CANARY_SECRET", canary)  # as a WANDB_API_KEY or HF_TOKEN would be
    sb = make_sb("canary")
    # inside: every environ the sandbox can read (its own, its agent's under bubblewrap: /proc/1)
    r = sb.exec(["python3", "-c", _READ_PROC])
    assert r.exit_code == 0, r
    seen = json.loads(r.stdout)
    assert "PATH=" in seen["self/environ"], sorted(seen)
    leaks = [k for k, v in seen.items() if canary in v or "RL_CANARY_SECRET" in v]
    assert leaks == [], f"the owner's environment is readable inside at /proc/{leaks}"
    env = sb.exec("env").stdout
    assert "PATH=" in env and canary not in env
    # from the host: no process of the sandbox, the agent included, carries it at all
    if os.geteuid() != 0:
        pytest.skip("reading the environment of the sandbox's processes from the host needs root")
    if backend == "docker":
        from sandbox.docker_backend import docker_client

        root_pid = docker_client().api.inspect_container(sb.container_id)["State"]["Pid"]
    else:
        root_pid = sb._proc.pid
    tree = _process_tree(root_pid)
    assert sb.info()["agent_pid"] in [ns_pid for ns_pid, _ in tree.values()], tree  # the agent was read
    assert [pid for pid, (_, environ) in tree.items() if canary.encode() in environ] == []


# what of the agent (its channel to the owner, its log, its memory) a sandboxed process can get at
_REACH_AGENT = r"""
import ctypes, os, sys
pid = int(sys.argv[1])
got = []
for part, flags in (("fd/0", os.O_WRONLY), ("fd/1", os.O_WRONLY), ("fd/2", os.O_WRONLY), ("mem", os.O_RDONLY),
                    ("environ", os.O_RDONLY)):
    try:
        os.close(os.open("/proc/%d/%s" % (pid, part), flags))
        got.append(part)
    except OSError:
        pass
if ctypes.CDLL(None).ptrace(0x4206, pid, 0, 0) == 0:  # PTRACE_SEIZE: traces without stopping it
    got.append("ptrace")
print(" ".join(got))
"""


def test_the_agent_is_out_of_the_sandboxs_reach(make_sb):
    sb = make_sb("agent")
    r = sb.exec(["python3", "-c", _REACH_AGENT, str(sb.info()["agent_pid"])])
    assert r.exit_code == 0 and r.stdout.strip() == "", r
    assert sb.exec("echo still served").stdout == "still served\n"


def test_a_containers_log_on_the_host_is_bounded(backend, make_sb):
    if backend != "docker":
        pytest.skip("docker only: the process backend's agent log is out of reach (test above)")
    from sandbox.docker_backend import docker_client

    sb = make_sb("log")
    # docker's init (pid 1) runs as the sandbox user: its stdout is the container's log on the host's disk
    r = sb.exec("yes 0123456789abcdef | head -c 20M > /proc/1/fd/1", timeout=60)
    assert r.exit_code == 0, r
    assert len(docker_client().api.logs(sb.container_id)) < 2 << 20


def test_a_download_writes_nothing_outside_its_destination(make_sb, tmp_path: Path):
    sb = make_sb("download")
    outside = tmp_path / "outside"
    outside.mkdir()
    for link in (str(outside), "../outside"):  # absolute, and relative out of the destination
        assert sb.exec(["sh", "-c", 'rm -rf d && mkdir d && echo ok > d/f && ln -s "$1" d/link', "sh", link]).ok
        with pytest.raises(SandboxError, match="link"):
            sb.download("d", tmp_path / "back")
        assert not (tmp_path / "back" / "link").exists() and not (tmp_path / "back" / "link").is_symlink()
    assert os.listdir(outside) == []


def test_dev_shm_is_bounded_and_the_rest_of_dev_is_read_only(make_sb):
    lim = SandboxLimits(memory_mb=256, pids=64, disk_mb=32, tmp_mb=16, exec_timeout=20)
    sb = make_sb("shm", limits=lim)
    # usable for what needs it (POSIX shared memory, semaphores)
    r = sb.exec(["python3", "-c", "from multiprocessing import shared_memory as s\n"
                 "m = s.SharedMemory(create=True, size=1 << 20); m.close(); m.unlink(); print('ok')"])
    assert r.stdout == "ok\n", r
    # well under the memory limit, so only a size limit on /dev/shm stops it
    r = sb.exec("head -c 100M /dev/zero > /dev/shm/fill", timeout=20)
    assert r.exit_code != 0 and "No space left" in r.stderr, r
    assert int(sb.exec("stat -c %s /dev/shm/fill").stdout) <= lim.tmp_mb << 20
    r = sb.exec("echo x > /dev/rl-fill")
    assert r.exit_code != 0 and ("Read-only" in r.stderr or "Permission denied" in r.stderr), r


def test_no_privileges_to_regain(backend, make_sb):
    sb = make_sb("privs")
    lines = sb.exec("cat /proc/self/status").stdout.splitlines()
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    assert status["Uid"].split()[1] != "0"  # effective uid
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    # the kernel then ignores setuid bits and file capabilities: no binary of /usr runs as root
    assert status["NoNewPrivs"].strip() == "1"
    # nor is a user namespace (root in it, over mount, network and more of the kernel) to be had
    bwrap = process_backend.bwrap_path() if backend == "process" else None
    if bwrap and not process_backend.bwrap_disables_userns(bwrap):
        pytest.skip("this bubblewrap (before 0.8) cannot forbid user namespaces inside")
    r = sb.exec("unshare --user --map-root-user id -u")
    assert r.exit_code != 0 and r.stdout == "", r


def test_the_hosts_private_keys_are_outside_the_view(backend, make_sb):
    if backend != "process":
        pytest.skip("a docker sandbox sees its image, not the host's /etc")
    sb = make_sb("keys")
    assert sb.exec("test -e /etc/ssl/private").exit_code != 0
    r = sb.exec(["python3", "-c", "import ssl; print(len(ssl.create_default_context().get_ca_certs()) > 0)"])
    assert r.stdout == "True\n", r  # the CA certificates are still there


def test_memory_held_in_files_counts_against_the_memory_limit(backend, make_sb):
    lim = SandboxLimits(memory_mb=128, pids=64, disk_mb=32, tmp_mb=16, exec_timeout=20)
    sb = make_sb("memfd", limits=lim)
    if backend == "process" and sb._cg is None:
        pytest.skip("no writable cgroup here: the address-space cap does not bound a memfd (SECURITY.md)")
    # written, never mapped: invisible to an address-space cap, charged to the memory cgroup
    r = sb.exec(["python3", "-c", "import os\nfd = os.memfd_create('x')\n"
                 "for _ in range(300): os.write(fd, bytes(1 << 20))\nprint('held 300 MiB')"], timeout=20)
    assert r.exit_code == 137 and "out of memory" in (r.error or ""), r
    assert sb.exec("echo alive").stdout == "alive\n"


# two processes busy for 2 s of wall time, then the CPU seconds they got
_BUSY = """
import os, time
end = time.monotonic() + 2
for _ in range(2):
    if os.fork() == 0:
        while time.monotonic() < end:
            pass
        os._exit(0)
for _ in range(2):
    os.wait()
t = os.times()
print(t.children_user + t.children_system)
"""


def test_cpu_beyond_the_quota_is_not_granted(backend, make_sb):
    sb = make_sb("cpu", limits=SandboxLimits(cpus=0.25))
    if backend == "process" and sb._cg is None:
        pytest.skip("no writable cgroup here: the process backend has no CPU limit without one (SECURITY.md)")
    r = sb.exec(["python3", "-c", _BUSY], timeout=20)
    assert r.exit_code == 0, r
    # a quarter of a CPU for 2 s is 0.5 s; unthrottled they take what the host's free cores give
    assert float(r.stdout) < 1.0, r


def test_a_state_dir_others_can_write_to_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    shared = tmp_path / "state"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as another user who made /tmp/rl-sandbox-<uid> first could leave it
    monkeypatch.setattr(owner, "STATE_ROOT", shared)
    monkeypatch.setattr(owner, "_checked", False)
    with pytest.raises(SandboxError, match="not a directory of this user's alone"):
        owner.check_state_root()
    with pytest.raises(SandboxError, match="not a directory of this user's alone"):
        sandbox.open_sandbox("process", labels={"run": "state-dir"})
    assert os.listdir(shared) == []  # nothing was started from it
    shared.chmod(0o700)
    owner.check_state_root()
