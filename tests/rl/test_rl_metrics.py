"""MetricsLogger: JSONL, wandb and TensorBoard sinks; warm-up steps (negative) and GRPO steps on
their own wandb axes."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from rl.metrics import MetricsLogger, read_metrics


def test_warmup_and_grpo_steps_reach_wandb_without_step_warnings(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the suite defaults to disabled
    monkeypatch.setenv("WANDB_SILENT", "false")
    logger = MetricsLogger(tmp_path, "offline", "pytest", "metrics", {"a": 1}, resume=False)
    try:
        for step in (-20, -10, -1):
            logger.log(step, {"sft/loss": 1.0 / -step})
        for step in range(3):
            logger.log(step, {"rollout/reward": 0.1 * step, "train/loss": 1.0})
        summary = dict(logger.wandb_run.summary)
    finally:
        logger.close()
    out = capfd.readouterr()
    assert "less than the current step" not in out.out + out.err and "deprecated" not in out.out + out.err
    assert [r["step"] for r in read_metrics(tmp_path)] == [-20, -10, -1, 0, 1, 2]
    assert summary["grpo_step"] == 2 and summary["warmup_step"] == -1
    assert summary["sft/loss"] == 1.0 and summary["rollout/reward"] == pytest.approx(0.2)


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the offline wandb run in run_dir, read from its transaction log (the
    LevelDB log format: 32 KiB blocks of chunks, each a 7-byte header of crc, length and type)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, pos, chunk, rows = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_jsonl_wandb_and_tensorboard_sinks_agree(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    logged = {-3: {"sft/loss": 2.5, "sft/grad_norm": 1.75},
              -1: {"sft/loss": 1.5, "sft/grad_norm": 0.5}}
    for step in range(3):
        logged[step] = {"rollout/reward": 0.25 * step, "rollout/domain/math/reward": 0.125 * step,
                        "train/loss": -0.5 + step, "time/step_s": 1.0 + 0.1 * step}
    config = {"logging": {"tensorboard": True}}
    logger = MetricsLogger(tmp_path, "offline", "pytest", "sinks", config, resume=False)
    for step, metrics in logged.items():
        logger.log(step, metrics)
    logger.close()

    jsonl = {r.pop("step"): r for r in read_metrics(tmp_path)}
    assert jsonl == logged

    deadline = time.monotonic() + 60  # wandb's service may still be writing its log after finish()
    while len(rows := wandb_history(tmp_path)) < len(logged) and time.monotonic() < deadline:
        time.sleep(0.5)
    wandb_rows = {}
    for row in rows:
        step = row.pop("grpo_step") if "grpo_step" in row else row.pop("warmup_step")
        wandb_rows[step] = {k: v for k, v in row.items() if not k.startswith("_")}
    assert wandb_rows == logged

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tensorboard: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            tensorboard.setdefault(event.step, {})[tag] = event.value
    assert tensorboard.keys() == logged.keys()
    for step, metrics in logged.items():  # TensorBoard keeps float32
        assert tensorboard[step] == pytest.approx(metrics, rel=1e-6)


def test_tensorboard_is_off_unless_the_config_asks(tmp_path):
    logger = MetricsLogger(tmp_path, "disabled", "pytest", "off", {"logging": {"tensorboard": False}}, resume=False)
    logger.log(0, {"rollout/reward": 1.0})
    logger.close()
    assert not (tmp_path / "tensorboard").exists() and read_metrics(tmp_path) == [{"step": 0, "rollout/reward": 1.0}]


def test_tensorboard_without_its_package_is_refused_at_config_time(monkeypatch):
    import importlib.util

    from rl.config import ConfigError, validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="'logging.tensorboard'.*needs the tensorboard package"):
        validate({"envs": [{"name": "math"}], "logging": {"tensorboard": True}})


def test_a_resumed_run_is_one_unbroken_run_in_every_sink(tmp_path, monkeypatch):
    """Resuming after step 1 (steps 2-3 were logged, then lost with the interruption): wandb keeps
    one offline folder and TensorBoard one history, each step once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rl.run_folder import rewind_step_logs

    monkeypatch.setenv("WANDB_MODE", "offline")
    config = {"logging": {"tensorboard": True}}
    first = MetricsLogger(tmp_path, "offline", "pytest", "resume", config, resume=False)
    for step in range(4):
        first.log(step, {"rollout/reward": float(step)})
    first.close()
    rewind_step_logs(tmp_path, last_step=1)
    second = MetricsLogger(tmp_path, "offline", "pytest", "resume", config, resume=True)
    for step in range(2, 5):
        second.log(step, {"rollout/reward": 10.0 + step})
    second.close()

    expected = {0: 0.0, 1: 1.0, 2: 12.0, 3: 13.0, 4: 14.0}
    assert {r["step"]: r["rollout/reward"] for r in read_metrics(tmp_path)} == expected
    assert len(list(tmp_path.glob("wandb/offline-run-*"))) == 1
    deadline = time.monotonic() + 60
    while len(rows := wandb_history(tmp_path)) < len(expected) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [(r["grpo_step"], r["rollout/reward"]) for r in rows] == sorted(expected.items())
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward")] == sorted(expected.items())


@pytest.mark.parametrize("asked", [False, True])
def test_wandbs_end_of_run_history_is_printed_only_when_asked_for(tmp_path, capfd, monkeypatch, asked):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the suite defaults to disabled
    monkeypatch.setenv("WANDB_SILENT", "false")
    logger = MetricsLogger(tmp_path, "offline", "pytest", "quiet", {"logging": {"wandb_summary": asked}},
                           resume=False)
    try:
        for step in range(3):
            logger.log(step, {"rollout/reward": 0.1 * step, "train/loss": 1.0})
    finally:
        logger.close()
    out = capfd.readouterr()
    said = out.out + out.err
    assert ("Run history:" in said and "Run summary:" in said) == asked, said
    assert "rollout/reward" not in said or asked, said
