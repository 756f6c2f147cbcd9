"""A run folder after a crash: torn JSONL lines, torn checkpoints, a `latest` marker naming what is
not there. Every reader (the trainer's rewind and resume, rl eval, the dashboard, rl report) says
what it dropped or refused in one line, never with a traceback, never silently."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rl.cli import app
from rl.dashboard.model import RunData
from rl.dashboard.report import write_report
from rl.dashboard.runfolder import JsonlTail
from rl.dashboard.server import Dashboard, make_server
from rl.errors import RunRefused
from rl.integrity import MANIFEST, read_jsonl, verify_manifest, write_manifest
from rl.run_folder import checkpoint_to_resume, latest_checkpoint, rewind_step_logs

from tests_rl_config import TINY

DEEP_LINE = '{"step": 2, "x": ' + "[" * 1000 + "]" * 1000 + "}"
TORN_LINE = '{"step": 3, "rollout/rew'


def write_jsonl(path: Path, lines: list[str], torn: str = "") -> None:
    path.write_text("".join(line + "\n" for line in lines) + torn)


def at_byte(path: Path, text: str) -> int:
    return path.read_bytes().index(text.encode())


def steps_in(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


# -- JSONL: the trainer's rewind ---------------------------------------------------------------------
def test_rewind_drops_a_torn_last_line_with_a_warning(tmp_path, caplog):
    for name in ("metrics.jsonl", "rollouts.jsonl", "moe_load.jsonl"):
        write_jsonl(tmp_path / name, [json.dumps({"step": s}) for s in (-1, 0, 1, 2)], torn=TORN_LINE)
    with caplog.at_level(logging.WARNING):
        dropped = rewind_step_logs(tmp_path, 1)
    for name in ("metrics.jsonl", "rollouts.jsonl", "moe_load.jsonl"):
        assert steps_in(tmp_path / name) == [-1, 0, 1]
        assert f"{name}: the last line (line 5) is cut off, a write the run did not finish; dropped" in caplog.messages
    assert dropped == 3  # step 2 of each file; the torn lines are not records


def test_rewind_drops_deep_and_stepless_lines_with_a_warning(tmp_path, caplog):
    write_jsonl(tmp_path / "metrics.jsonl", ['{"step": 0}', DEEP_LINE, '{"loss": 1}', "[1]", '{"step": 1}'])
    with caplog.at_level(logging.WARNING):
        rewind_step_logs(tmp_path, 5)
    assert steps_in(tmp_path / "metrics.jsonl") == [0, 1]
    assert caplog.messages == ["metrics.jsonl: line 2 is nested deeper than 32 levels; dropped",
                               "metrics.jsonl: line 4 is not a JSON object; dropped",
                               "metrics.jsonl: a record without an integer 'step'; dropped"]


def test_read_jsonl_keeps_a_whole_last_line_without_its_newline(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}')
    warnings: list[str] = []
    assert read_jsonl(path, warnings.append) == [{"step": 0}, {"step": 1}] and warnings == []


# -- checkpoint manifests ----------------------------------------------------------------------------
def fake_checkpoint(root: Path, step: int, manifest: bool = True) -> Path:
    """A checkpoint folder's shape: weights, an hf/ export with a tokenizer, the scheduler's state."""
    tag = root / "checkpoints" / f"step_{step}"
    (tag / "hf" / "tokenizer").mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(os.urandom(4096))
    (tag / "hf" / "model.safetensors").write_bytes(os.urandom(2048))
    (tag / "hf" / "tokenizer" / "vocab.json").write_text("{}")
    (tag / "scheduler.json").write_text("{}")
    if manifest:
        write_manifest(tag)
    (root / "checkpoints" / "latest").write_text(tag.name)
    return tag


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_manifest_lists_every_file_and_verifies(tmp_path):
    tag = fake_checkpoint(tmp_path, 4)
    listed = json.loads((tag / MANIFEST).read_text())["files"]
    assert sorted(listed) == ["hf/model.safetensors", "hf/tokenizer/vocab.json", "mp_rank_00_model_states.pt",
                              "scheduler.json"]
    assert listed["scheduler.json"] == {"bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    assert verify_manifest(tag) is None
    (tag / "hf" / "eval.json").write_text("{}")  # rl eval writes beside the weights later: not checked
    assert verify_manifest(tag) is None


@pytest.mark.parametrize("damage, problem", [
    (lambda t: cut_in_half(t / "hf" / "model.safetensors"),
     "hf/model.safetensors has 1024 bytes, its manifest says 2048"),
    (lambda t: (t / "scheduler.json").unlink(), "scheduler.json is missing"),
    (lambda t: (t / "mp_rank_00_model_states.pt").write_bytes(bytes(4096)),
     "mp_rank_00_model_states.pt does not match the sha256 in its manifest"),
    (lambda t: (t / MANIFEST).unlink(), "no manifest.json (it was cut off before it was complete"),
    (lambda t: cut_in_half(t / MANIFEST), "its manifest.json is not JSON"),
    (lambda t: (t / MANIFEST).write_text('{"files": {}}'), "does not list files with their bytes and sha256"),
    (lambda t: (t / MANIFEST).write_text('{"files": {"../x": {"bytes": 1, "sha256": "0"}}}'),
     "does not list files"),
])
def test_a_torn_checkpoint_fails_its_manifest_in_one_line(tmp_path, damage, problem):
    tag = fake_checkpoint(tmp_path, 4)
    damage(tag)
    found = verify_manifest(tag)
    assert found is not None and problem in found and "\n" not in found


def test_resume_falls_back_to_the_newest_whole_checkpoint_and_says_so(tmp_path):
    fake_checkpoint(tmp_path, 2)
    torn = fake_checkpoint(tmp_path, 4)
    cut_in_half(torn / "mp_rank_00_model_states.pt")
    assert latest_checkpoint(tmp_path) == ("step_2", 2)
    found, note = checkpoint_to_resume(tmp_path)
    assert found == ("step_2", 2)
    assert note == ("step_4 is torn (mp_rank_00_model_states.pt has 2048 bytes, its manifest says 4096): "
                    "resuming from step_2, the newest whole checkpoint")


def test_resume_passes_over_a_save_cut_off_before_its_manifest(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4, manifest=False)
    (tmp_path / "checkpoints" / "latest").write_text("step_2")  # the marker is written after the manifest
    found, note = checkpoint_to_resume(tmp_path)
    assert found == ("step_2", 2) and note.startswith("step_4 is torn (no manifest.json")


@pytest.mark.parametrize("marker", ["step_9", "garbage", "step_", ""])
def test_a_latest_marker_naming_what_is_not_there_is_passed_over(tmp_path, marker):
    fake_checkpoint(tmp_path, 2)
    (tmp_path / "checkpoints" / "latest").write_text(marker)
    assert latest_checkpoint(tmp_path) == ("step_2", 2)
    found, note = checkpoint_to_resume(tmp_path)
    assert found == ("step_2", 2)
    assert note == (f"checkpoints/latest names {marker!r}, which is not there: resuming from step_2, "
                    f"the newest whole checkpoint")


def test_resume_refuses_when_no_checkpoint_is_whole(tmp_path):
    cut_in_half(fake_checkpoint(tmp_path, 2) / "scheduler.json")
    with pytest.raises(RunRefused, match=r"cannot resume .*: no checkpoint is whole \(step_2 is torn \(scheduler.json "
                                         r"has 1 bytes, its manifest says 2\)\); remove .*checkpoints to train"):
        checkpoint_to_resume(tmp_path)
    assert checkpoint_to_resume(tmp_path / "never-checkpointed") == (None, None)


# -- rl eval --checkpoint ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_policy(tmp_path_factory) -> Path:
    """A real training checkpoint's hf/ export: a tiny policy and its tokenizer."""
    from policy import Tokenizer, build_policy, save_policy

    root = tmp_path_factory.mktemp("ckpt")
    tag = root / "run" / "checkpoints" / "step_1"
    tok = Tokenizer.train(["the answer is 42", "search for the value"] * 20, vocab_size=300)
    model = build_policy({"preset": "toy", "overrides": {"vocab_size": tok.vocab_size}})
    save_policy(model, str(tag / "hf"))
    tok.save(str(tag / "hf" / "tokenizer"))
    (tag / "scheduler.json").write_text("{}")
    write_manifest(tag)
    return tag


def copy_of(tag: Path, dest: Path) -> Path:
    import shutil

    return Path(shutil.copytree(tag, dest / "run" / "checkpoints" / tag.name))


def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path / "runs")}))
    return path


def test_rl_eval_refuses_a_checkpoint_whose_weights_are_cut_in_half(saved_policy, tmp_path):
    from rl.evaluate_cmd import resolve_checkpoint

    tag = copy_of(saved_policy, tmp_path)
    assert resolve_checkpoint(str(tag)) == tag / "hf"
    weights = tag / "hf" / "model.safetensors"
    full = weights.stat().st_size
    cut_in_half(weights)
    with pytest.raises(RunRefused) as refused:
        resolve_checkpoint(str(tag))
    assert str(refused.value) == (f"--checkpoint: {tag} is torn: hf/model.safetensors has {full // 2} bytes, "
                                  f"its manifest says {full}")
    result = CliRunner().invoke(app, ["eval", str(config_file(tmp_path)), "--checkpoint", str(tag)])
    assert result.exit_code == 2
    assert " ".join(result.output.split()) == f"error: {refused.value}"


def test_rl_eval_refuses_a_cut_safetensors_file_without_a_manifest(saved_policy, tmp_path):
    """A save_pretrained folder carries no manifest: the safetensors header says how long it must be."""
    import shutil

    from policy import from_pretrained
    from rl.evaluate_cmd import resolve_checkpoint

    folder = Path(shutil.copytree(saved_policy / "hf", tmp_path / "exported"))
    weights = folder / "model.safetensors"
    full = weights.stat().st_size
    cut_in_half(weights)
    message = f"checkpoint file {weights} is cut short: {full // 2} bytes, its header promises {full}"
    with pytest.raises(RunRefused, match="^--checkpoint: " + message.replace(".", r"\.") + "$"):
        resolve_checkpoint(str(folder))
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.") + "$"):
        from_pretrained(folder)
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(RunRefused, match=f"--checkpoint: checkpoint file {weights} is not a whole safetensors file"):
        resolve_checkpoint(str(folder))


def test_rl_eval_refuses_a_training_checkpoint_without_its_manifest(saved_policy, tmp_path):
    from rl.evaluate_cmd import resolve_checkpoint

    tag = copy_of(saved_policy, tmp_path)
    (tag / MANIFEST).unlink()
    with pytest.raises(RunRefused, match=r"--checkpoint: .*step_1 is torn: no manifest.json"):
        resolve_checkpoint(str(tag / "hf"))


# -- the dashboard and rl report ---------------------------------------------------------------------
def damaged_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: run\ntrain: {steps: 10}\n")
    write_jsonl(run / "metrics.jsonl", ['{"step": 0, "rollout/reward": 0.5}', DEEP_LINE,
                                        '{"step": 1, "rollout/reward": 0.75}'], torn=TORN_LINE)
    write_jsonl(run / "moe_load.jsonl", ['{"step": 0, "layers": [1], "load": [[1, 3]]}'], torn='{"step": 1, "lay')
    write_jsonl(run / "rollouts.jsonl", ['{"step": 0, "uid": "a", "reward": 1, "transcript": []}', DEEP_LINE],
                torn='{"step": 1, "uid": "b", "transcr')
    return run


def test_the_dashboard_state_survives_a_deep_line_and_reports_it(tmp_path):
    board = Dashboard([damaged_run(tmp_path)])
    server = make_server(board, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = "http://127.0.0.1:%d/api/state" % server.server_address[1]
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.status == 200 and json.loads(resp.read())["panels"]
    finally:
        server.shutdown()
        server.server_close()
    run = board.runs[0]
    assert sorted(run.grpo.rows) == [0, 1]
    deep_at = at_byte(run.path / "metrics.jsonl", DEEP_LINE)
    assert f"metrics.jsonl: the line at byte {deep_at} is nested deeper than 32 levels; skipped" in run.problems
    assert len(run.samples) == 1


def test_the_dashboard_reports_a_torn_last_line_once_the_file_stops_changing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, ['{"step": 0}'], torn=TORN_LINE)
    tail = JsonlTail(path)
    assert tail.read() == ([{"step": 0}], False, [])  # a write may be in progress
    old = time.time() - 60
    os.utime(path, (old, old))
    assert tail.read() == ([], False, ["metrics.jsonl: the last line (at byte 12) is cut off, a write the run did "
                                       "not finish; ignored"])
    with path.open("a") as f:  # it was in progress after all
        f.write('ard": 1}\n')
    assert tail.read() == ([{"step": 3, "rollout/reward": 1}], False, [])


def test_rl_report_drops_torn_and_deep_lines_with_a_warning(tmp_path, caplog):
    run = damaged_run(tmp_path)
    with caplog.at_level(logging.WARNING):
        path = write_report(run)
    metrics, moe, rollouts = (run / name for name in ("metrics.jsonl", "moe_load.jsonl", "rollouts.jsonl"))
    torn, second = "is cut off, a write the run did not finish; ignored", '{"step": 1'
    deep = "is nested deeper than 32 levels; skipped"
    expected = [f"metrics.jsonl: the last line (at byte {at_byte(metrics, TORN_LINE)}) {torn}",
                f"metrics.jsonl: the line at byte {at_byte(metrics, DEEP_LINE)} {deep}",
                f"moe_load.jsonl: the last line (at byte {at_byte(moe, second)}) {torn}",
                f"rollouts.jsonl: the last line (at byte {at_byte(rollouts, second)}) {torn}",
                f"rollouts.jsonl: the line at byte {at_byte(rollouts, DEEP_LINE)} {deep}"]
    assert sorted(caplog.messages) == expected
    report = path.read_text()
    assert all(f"- {line}" in report for line in expected)
    data = RunData(run)
    data.refresh(final=True)
    assert sorted(data.grpo.rows) == [0, 1] and data.moe.latest_step == 0


# -- end to end: a real run, torn, resumed ----------------------------------------------------------
def test_a_run_resumes_past_a_torn_checkpoint_and_rl_eval_refuses_it(tmp_path, ray_session):
    tree = {**TINY, "output_dir": str(tmp_path / "runs"), "train": {"steps": 2, "micro_batches": 1},
            "checkpoint": {"every": 1, "keep": 2}, "gate": {"enabled": False}, "warmup": {**TINY["warmup"], "steps": 1},
            "eval": {"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False}}
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tree))
    runner = CliRunner()
    assert runner.invoke(app, ["train", str(config)], catch_exceptions=False).exit_code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    tag = run_dir / "checkpoints" / "step_1"
    assert verify_manifest(tag) is None and verify_manifest(run_dir / "checkpoints" / "step_0") is None
    states = max(tag.glob("*.pt"), key=lambda p: p.stat().st_size)  # the learner's model (or optimizer) state
    full = states.stat().st_size
    cut_in_half(states)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(TORN_LINE)  # the run was killed mid-line too
    refused = runner.invoke(app, ["eval", str(config), "--checkpoint", str(tag)])
    assert refused.exit_code == 2 and " ".join(refused.output.split()) == (
        f"error: --checkpoint: {tag.resolve()} is torn: {states.name} has {full // 2} bytes, its manifest says {full}")
    result = runner.invoke(app, ["train", "--resume", str(run_dir), "train.steps=3"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert (f"step_1 is torn ({states.name} has {full // 2} bytes, its manifest says {full}): resuming from step_0, "
            f"the newest whole checkpoint") in output
    assert "continuing at step 1" in output
    assert steps_in(run_dir / "metrics.jsonl")[-3:] == [0, 1, 2]
    assert verify_manifest(tag) is None  # saved again, whole
