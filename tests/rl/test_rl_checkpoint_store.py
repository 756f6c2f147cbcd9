"""checkpoint.dir in object storage: a local S3-compatible server (moto) takes a run's checkpoints; a
partial upload never looks complete; resume and `rl eval --checkpoint s3://...` read from it."""
from __future__ import annotations

import json
import socket

import pytest

from rl.checkpoint_store import CheckpointMirror, fetch_checkpoint
from rl.errors import RunRefused
from rl.integrity import MANIFEST, write_manifest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A bucket on a moto server on this machine, reached through the standard AWS environment variables."""
    import os
    import urllib.request

    import s3fs

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    # moto keeps buckets per process, not per server: start from none whatever ran before
    urllib.request.urlopen(urllib.request.Request(env["AWS_ENDPOINT_URL_S3"] + "/moto-api/reset", method="POST"))
    s3fs.S3FileSystem().mkdir("ckpts")
    yield "s3://ckpts"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


def checkpoint(root, tag: str, payload: str):
    d = root / tag
    (d / "hf").mkdir(parents=True)
    (d / "hf" / "weights.bin").write_text(payload)
    (d / "scheduler.json").write_text(json.dumps({"next_index": 3}))
    write_manifest(d)
    return d


def test_upload_then_download_the_newest_whole_checkpoint(s3, tmp_path):
    mirror = CheckpointMirror.of_run(s3, "run-a")
    for step in (1, 2, 3):
        mirror.upload(checkpoint(tmp_path / "local", f"step_{step}", f"weights {step}"))
    mirror.prune(keep=2)
    assert [tag for _, tag in mirror.steps()] == ["step_2", "step_3"]
    assert mirror.fs.cat_file(f"{mirror.root}/latest") == b"step_3"
    tag, passed_over = mirror.download_newest(tmp_path / "fetched")
    assert tag == "step_3" and passed_over == []
    assert (tmp_path / "fetched" / "step_3" / "hf" / "weights.bin").read_text() == "weights 3"


def test_a_partial_upload_never_looks_complete(s3, tmp_path, monkeypatch):
    """The driver dies while uploading: the files went up, the manifest did not (it goes last); the
    download passes over that checkpoint, saying so, and takes the whole one before it."""
    mirror = CheckpointMirror.of_run(s3, "run-b")
    mirror.upload(checkpoint(tmp_path / "local", "step_1", "weights 1"))
    put = mirror.fs.put_file

    def dies_at_the_manifest(local, remote, **kw):
        if remote.endswith(MANIFEST):
            raise ConnectionError("the driver died")
        return put(local, remote, **kw)

    monkeypatch.setattr(mirror.fs, "put_file", dies_at_the_manifest)
    with pytest.raises(ConnectionError):
        mirror.upload(checkpoint(tmp_path / "local", "step_2", "weights 2"))
    monkeypatch.undo()
    assert [tag for _, tag in mirror.steps()] == ["step_1", "step_2"]
    tag, passed_over = mirror.download_newest(tmp_path / "fetched")
    assert tag == "step_1"
    assert passed_over == [f"{s3}/run-b/step_2 is torn (no {MANIFEST} (it was cut off before it was complete, "
                           f"or written before checkpoints carried one))"]
    assert not (tmp_path / "fetched" / "step_2").exists()


def test_eval_fetches_a_checkpoint_by_url_and_refuses_a_torn_one(s3, tmp_path):
    mirror = CheckpointMirror.of_run(s3, "run-c")
    mirror.upload(checkpoint(tmp_path / "local", "step_4", "weights 4"))
    fetched = fetch_checkpoint(f"{s3}/run-c/step_4", tmp_path / "eval")
    assert (fetched / "hf" / "weights.bin").read_text() == "weights 4"
    mirror.fs.pipe_file(f"{mirror.root}/step_4/hf/weights.bin", b"weights 5")  # changed after its manifest
    with pytest.raises(RunRefused, match=r"step_4 is torn: hf/weights.bin does not match the sha256"):
        fetch_checkpoint(f"{s3}/run-c/step_4", tmp_path / "again")


def test_an_unusable_checkpoint_dir_is_one_config_line():
    from rl.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"'checkpoint.dir': nosuch:// is not usable here"):
        validate({"envs": [{"name": "math"}], "checkpoint": {"dir": "nosuch://x"}})
