"""State, files, fork and the async API, on every backend."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import sandbox
from sandbox import ExecResult, SandboxDead, SandboxLimits


def test_state_persists_within_episode_and_is_gone_in_the_next(make_sb):
    sb = make_sb("ep1")
    assert sb.exec("echo 41 > counter").ok
    r = sb.exec("n=$(cat counter); echo $((n+1)) > counter; cat counter")
    assert r.exit_code == 0 and r.stdout.strip() == "42"
    # a background process started in one turn keeps running in later turns. Each tick is renamed
    # into place: `date > tick` truncates the file first, and a reader could see it empty
    assert sb.exec("(while true; do date +%s%N > tick.new && mv tick.new tick; sleep 0.05; done) "
                   ">/dev/null 2>&1 &").ok
    first = sb.exec("for i in $(seq 200); do test -e tick && break; sleep 0.05; done; cat tick").stdout.strip()
    r = sb.exec(f'for i in $(seq 200); do [ "$(cat tick)" != "{first}" ] && echo running && break; sleep 0.05; done')
    assert first and r.stdout.strip() == "running", (first, r)
    # env, cwd, stdin, argv with spaces
    assert sb.exec("mkdir -p sub").ok
    r = sb.exec(["python3", "-c", "import os,sys; print(os.environ['X'], os.getcwd(), sys.stdin.read())"],
                env={"X": "a b"}, cwd="sub", stdin="piped")
    assert r.stdout.split() == ["a", "b", f"{sb.workdir}/sub", "piped"], r
    sb.close()
    with pytest.raises(SandboxDead):
        sb.exec("true")

    nxt = make_sb("ep2")
    r = nxt.exec("cat counter tick")
    assert r.exit_code != 0 and "No such file" in r.stderr
    assert nxt.exec("ls -A").stdout == ""


def test_exec_result_fields(make_sb):
    sb = make_sb()
    r = sb.exec("echo out; echo err >&2; exit 7")
    assert isinstance(r, ExecResult)
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (7, "out\n", "err\n", False)
    assert not r.stdout_truncated and not r.stderr_truncated and 0 < r.wall_time < 5
    r = sb.exec(["no-such-binary-xyz"])
    assert r.exit_code == 127 and "no-such-binary-xyz" in (r.error or "")


def test_files_upload_download(make_sb, tmp_path: Path):
    sb = make_sb()
    sb.write_file("d/e/f.bin", bytes(range(256)) * 100)
    assert sb.read_file("d/e/f.bin") == bytes(range(256)) * 100
    assert sb.read_file(f"{sb.workdir}/d/e/f.bin", max_bytes=3) == b"\x00\x01\x02"
    sb.write_file("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sb.exec(["./run.sh"]).stdout == "ran\n"
    with pytest.raises(FileNotFoundError):
        sb.read_file("missing.txt")
    with pytest.raises(IsADirectoryError):
        sb.read_file("d")
    # special files cannot make the agent stream forever or block
    with pytest.raises(OSError, match="not a regular file"):
        sb.read_file("/dev/zero")
    assert sb.exec("mkfifo pipe").ok
    with pytest.raises(OSError, match="not a regular file"):
        sb.read_file("pipe")
    with pytest.raises(OSError):
        sb.write_file("pipe", "x")
    assert sb.exec("echo still answering").stdout == "still answering\n"

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("VALUE = 5\n")
    (src / "top.txt").write_text("top")
    sb.upload(src, "proj")
    assert sb.exec(["python3", "-c", "import pkg.mod as m; print(m.VALUE)"], cwd="proj").stdout == "5\n"
    sb.exec("echo made > proj/new.txt")
    sb.download("proj", tmp_path / "back")
    assert (tmp_path / "back" / "new.txt").read_text() == "made\n"
    assert (tmp_path / "back" / "pkg" / "mod.py").read_text() == "VALUE = 5\n"
    sb.download("proj/top.txt", tmp_path / "one.txt")
    assert (tmp_path / "one.txt").read_text() == "top"


def test_fork_gives_independent_copies(make_sb):
    parent = make_sb("group")
    parent.write_file("shared.txt", "prefix")
    parent.exec("mkdir -p .local/lib && echo installed > .local/lib/pkg")
    snap = parent.snapshot()
    assert snap.size > 0 and snap.backend == parent.backend
    kids = [parent.fork(snap, labels={"episode": f"g{i}"}) for i in range(2)]
    try:
        for i, kid in enumerate(kids):
            assert kid.read_file("shared.txt") == b"prefix"
            assert kid.read_file(".local/lib/pkg") == b"installed\n"
            kid.write_file("shared.txt", f"kid{i}")
        parent.write_file("shared.txt", "parent")
        parent.write_file("after.txt", "late")
        assert [k.read_file("shared.txt") for k in kids] == [b"kid0", b"kid1"]
        assert parent.read_file("shared.txt") == b"parent"
        assert all(k.exec("test -e after.txt").exit_code == 1 for k in kids)
        assert kids[0].labels["episode"] == "g0" and kids[0].labels["forked_from"] == parent.id
    finally:
        for k in kids:
            k.close()
    assert parent.exec("cat shared.txt").stdout == "parent"


def test_async_twins_run_concurrently(make_sb):
    sbs = [make_sb(f"a{i}") for i in range(3)]

    async def episode(sb: sandbox.Sandbox, i: int) -> list[float]:
        await sb.awrite_file("x", str(i))
        r = await sb.aexec("date +%s.%N; sleep 1; echo $(cat x); date +%s.%N")
        data = await sb.aread_file("x")
        assert data == str(i).encode()
        start, got, end = r.stdout.split()
        assert got == str(i)
        return [float(start), float(end)]

    async def main() -> list[list[float]]:
        return await asyncio.gather(*(episode(sb, i) for i, sb in enumerate(sbs)))

    spans = asyncio.run(main())
    # they overlapped: every command had started before any had finished (sandboxes share the host clock)
    assert max(start for start, _ in spans) < min(end for _, end in spans), spans


def test_ttl_expiry_destroys_the_sandbox(make_sb):
    sb = make_sb(limits=SandboxLimits(ttl=1.5))
    assert sb.info()["ttl_left"] <= 1.5
    r = sb.exec("sleep 10", timeout=8)
    assert r.timed_out and r.exit_code == 124 and "ttl" in (r.error or "")
    with pytest.raises(SandboxDead):
        for _ in range(50):  # the agent exits right after answering
            sb.exec("true")
    assert not sb.alive


def test_open_sandbox_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        sandbox.open_sandbox("vm")
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(sandbox.SandboxError, match="rootfs"):
        sandbox.open_sandbox("process", image="/nonexistent-rootfs")


@pytest.mark.parametrize("jail", ["bwrap", "unshare"])
def test_process_backend_runs_on_the_base_rootfs(jail: str, base_rootfs_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """The debootstrap rootfs kept by build-image is also a process-backend image, with
    bubblewrap and on the unshare fallback alike."""
    from sandbox_testutil import use_unshare_fallback

    root = base_rootfs_dir
    if jail == "unshare":
        use_unshare_fallback(monkeypatch)
    # a file the host's /usr has and the minimal rootfs lacks tells the two apart
    probe = next(p for p in ("/usr/bin/bwrap", "/usr/bin/unshare", "/usr/bin/dpkg") if Path(p).exists()
                 and not (root / p.lstrip("/")).exists())
    with sandbox.open_sandbox("process", image=str(root), labels={"run": "pytest", "episode": "rootfs"}) as sb:
        r = sb.exec(f"test -e {probe}; echo $?; python3 -c 'print(6*7)'")
        assert r.stdout.split() == ["1", "42"], r
    with sandbox.open_sandbox("process", labels={"run": "pytest", "episode": "host-usr"}) as sb:
        assert sb.exec(f"test -e {probe}; echo $?").stdout.strip() == "0"


def test_concurrent_calls_on_one_sandbox_are_serialised_safely(make_sb):
    import concurrent.futures

    sb = make_sb("threads")

    def work(i: int) -> bool:
        sb.write_file(f"t{i}", str(i) * 1000)
        r = sb.exec(["cat", f"t{i}"])
        return r.stdout == str(i) * 1000 and sb.read_file(f"t{i}") == (str(i) * 1000).encode()

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        assert all(ex.map(work, range(24)))
