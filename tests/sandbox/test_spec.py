"""SandboxSpec and SandboxPools: what an environment declares (image, limits, network, time
limits) is what its sandboxes get, one warm pool per spec, all under one cap."""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from sandbox import PoolExhausted, SandboxLimits, SandboxPools, SandboxSpec
from sandbox_testutil import RUN

HOG = ["python3", "-c", "x = bytearray(200 << 20); print('allocated')"]
INTERFACES = ["python3", "-c", "import socket; print(len(socket.if_nameindex()))"]


def test_a_bad_spec_is_a_one_line_error_naming_the_key():
    cases = [({"memroy_mb": 256}, "unknown key 'memroy_mb'"), ({"memory_mb": "lots"}, "'memory_mb' must be int"),
             ({"cpus": 0}, "'cpus' must be > 0"), ({"network": "yes"}, "'network' must be bool"),
             ({"disk_mb": 4096}, "disk_mb (4096) plus /tmp (64) must be < memory_mb (1024)"),
             ({"image": "/srv/rootfs"}, "give a rootfs directory as 'rootfs'")]
    for bad, message in cases:
        with pytest.raises(ValueError) as info:
            SandboxSpec.from_dict(bad)
        assert message in str(info.value) and "\n" not in str(info.value)


def test_spec_fields_become_limits_and_overrides_replace_only_what_they_set():
    declared = SandboxSpec(image="my-env:1", memory_mb=256, exec_timeout=5, episode_timeout=30)
    spec = declared.merged({"network": True, "pids": 32})
    assert (spec.image, spec.memory_mb, spec.network, spec.pids) == ("my-env:1", 256, True, 32)
    lim = spec.limits()
    assert (lim.memory_mb, lim.pids, lim.network, lim.exec_timeout) == (256, 32, True, 5.0)
    assert lim.disk_mb + lim.tmp_mb < lim.memory_mb  # the work dir shrinks to fit a small sandbox
    assert lim.ttl > 30 + 120  # the sandbox outlives its episode by the grading time
    assert SandboxSpec().limits() == SandboxLimits()  # an empty spec is the default sandbox


def _image_probe(backend: str, tmp_path: Path, base_rootfs_dir: Path | None) -> tuple[SandboxSpec, list[str], str]:
    """A spec whose image differs from the default one, a command and what it prints only there."""
    if backend == "docker":
        marker = uuid.uuid4().hex
        (tmp_path / "marker").write_text(marker)
        (tmp_path / "Dockerfile").write_text("ARG BASE\nFROM ${BASE}\nCOPY marker /opt/env/marker\n")
        return SandboxSpec(dockerfile=str(tmp_path / "Dockerfile")), ["cat", "/opt/env/marker"], marker
    assert base_rootfs_dir is not None
    # the minimal rootfs lacks bubblewrap, which the host's /usr (the default image) has
    return SandboxSpec(rootfs=str(base_rootfs_dir)), ["sh", "-c", "test -e /usr/bin/bwrap; echo $?"], "1"


def test_pools_honour_limits_network_and_image_of_each_spec(backend_name: str, tmp_path: Path,
                                                            request: pytest.FixtureRequest):
    rootfs = None if backend_name == "docker" else request.getfixturevalue("base_rootfs_dir")
    image_spec, probe, only_there = _image_probe(backend_name, tmp_path, rootfs)
    small = SandboxSpec(memory_mb=128, pids=48, network=True, exec_timeout=1.0)
    try:
        with SandboxPools(backend_name, warm=1, max_live=4, health_interval=0.2, labels={"run": RUN}) as pools:
            default, tight, custom = (pools.acquire(s, timeout=120) for s in (SandboxSpec(), small, image_spec))
            assert tight.limits.memory_mb == 128 and tight.limits.pids == 48 and tight.limits.network
            assert tight.backend == default.backend == custom.backend == backend_name
            # memory: the same allocation fits the default sandbox, not the small one
            assert default.exec(HOG).stdout == "allocated\n"
            assert tight.exec(HOG).exit_code != 0
            # network: off by default (loopback only), on where the spec says so
            assert default.exec(INTERFACES).stdout.strip() == "1"
            assert int(tight.exec(INTERFACES).stdout) > 1
            # the per-exec default timeout
            t0 = time.monotonic()
            r = tight.exec("sleep 30")
            assert r.timed_out and time.monotonic() - t0 < 10
            assert not default.exec("sleep 1.2").timed_out
            # the image
            assert custom.exec(probe).stdout.strip() == only_there
            assert default.exec(probe).stdout.strip() != only_there
            assert len(pools.status()["pools"]) == 3
            for sb in (default, tight, custom):
                sb.close()
    finally:
        if backend_name == "docker":  # once the pools closed: no container uses it (else this refuses)
            from sandbox.docker_backend import docker_client

            docker_client().images.remove(image_spec.docker_tag())


def test_equal_specs_share_a_pool_and_the_cap_is_shared_by_all_pools():
    a, b = SandboxSpec(memory_mb=256), SandboxSpec(memory_mb=300)
    with SandboxPools("process", warm=2, max_live=2, health_interval=0.2, labels={"run": RUN}) as pools:
        assert pools.pool(a) is pools.pool(SandboxSpec(memory_mb=256, disk_mb=128))  # same limits once resolved
        assert pools.pool(a).wait_ready(2, timeout=30)  # a's warm sandboxes hold the whole cap...
        sb = pools.acquire(b, timeout=30)  # ...so one of them makes room for b's episode
        assert sb.limits.memory_mb == 300 and sb.exec("echo ok").stdout == "ok\n"
        held = pools.acquire(a, timeout=30)
        assert pools.live <= 2
        with pytest.raises(PoolExhausted, match="cap of 2 shared by the pools"):
            pools.acquire(b, timeout=0.5)  # both sandboxes are in episodes: nothing to reclaim
        held.close()
        sb2 = pools.acquire(b, timeout=30)
        assert sb2.exec("echo again").stdout == "again\n"
        for s in (sb, sb2):
            s.close()
