"""Property-based fuzzing (hypothesis) of the run folder's readers: the tolerant JSONL reader, the
trainer's rewind, the dashboard's tail, the dashboard and rl report over records of any shape, and
checkpoint manifests. Properties: no traceback, no hang, nothing dropped without a warning, and
nothing torn accepted."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl.dashboard.model import RunData
from rl.dashboard.panels import build_panels
from rl.dashboard.report import write_report
from rl.dashboard.runfolder import JsonlTail
from rl.dashboard.samples import SampleQuery, find_samples
from rl.dashboard.server import Dashboard
from rl.integrity import MANIFEST, MAX_DEPTH, read_jsonl, verify_manifest, write_manifest
from rl.run_folder import checkpoint_to_resume, rewind_step_logs

FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)


@contextmanager
def folder() -> Iterator[Path]:
    """A fresh directory for one example (pytest's tmp_path lasts the whole test)."""
    path = Path(tempfile.mkdtemp(prefix="rl-fuzz-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def deep(levels: int) -> bytes:
    return b'{"step": 1, "x": ' + b"[" * levels + b"]" * levels + b"}"


# one JSONL line each, none with a newline inside: records, other JSON, deep lines, garbage
lines = st.one_of(
    st.dictionaries(st.sampled_from(["step", "a", "b/c", "uid"]), json_values, max_size=4)
    .map(lambda d: json.dumps(d).encode()),
    st.builds(lambda step, v: json.dumps({"step": step, "v": v}).encode(), st.integers(-3, 6), json_values),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(MAX_DEPTH - 2, 3000).map(deep),
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b" ")),
    st.just(b"1" * 5000),
)


def expected_record(line: bytes) -> dict | None:
    """What a careful reader must make of one line: the record, or nothing."""
    try:
        value = json.loads(line)
        return value if isinstance(value, dict) and depth(value) <= MAX_DEPTH else None
    except (ValueError, RecursionError):  # a depth this oracle cannot count is far past the bound
        return None


@st.composite
def jsonl_files(draw) -> tuple[bytes, list[bytes]]:
    """(file content, its lines); the last line may lack its newline (a torn write, or not)."""
    body = draw(st.lists(lines, max_size=8))
    content = b"".join(line + b"\n" for line in body)
    if body and draw(st.booleans()):
        content = content[:-1]  # no newline after the last line
        if draw(st.booleans()):
            content = content[: draw(st.integers(0, len(content)))]  # cut somewhere
    return content, content.split(b"\n")


def non_empty(parts: list[bytes]) -> list[bytes]:
    return [p for p in parts if p.strip()]


@settings(FUZZ, max_examples=200)
@given(jsonl_files())
def test_read_jsonl_keeps_every_record_and_warns_for_every_other_line(file):
    content, parts = file
    with folder() as d:
        path = d / "metrics.jsonl"
        path.write_bytes(content)
        warnings: list[str] = []
        records = read_jsonl(path, warnings.append)
    expected = [expected_record(p) for p in non_empty(parts)]
    assert records == [r for r in expected if r is not None]
    assert len(warnings) == sum(r is None for r in expected)  # nothing dropped without a word
    assert all(w.startswith("metrics.jsonl: ") and "\n" not in w for w in warnings)


def is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@settings(FUZZ, max_examples=150)
@given(jsonl_files(), st.integers(-2, 6))
def test_rewind_keeps_exactly_the_records_up_to_the_step(file, last_step):
    content, parts = file
    records = [r for r in map(expected_record, non_empty(parts)) if r is not None]
    with folder() as d:
        (d / "rollouts.jsonl").write_bytes(content)
        logger = logging.getLogger("rl.run_folder")
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())
        logger.addHandler(handler)
        try:
            rewind_step_logs(d, last_step)
        finally:
            logger.removeHandler(handler)
        kept = [json.loads(line) for line in (d / "rollouts.jsonl").read_bytes().split(b"\n") if line]
    assert kept == [r for r in records if is_step(r.get("step")) and r["step"] <= last_step]
    stepless = sum(not is_step(r.get("step")) for r in records)
    assert len(seen) == len(non_empty(parts)) - len(records) + stepless


@settings(FUZZ, max_examples=150)
@given(jsonl_files(), st.data())
def test_the_dashboard_tail_reads_what_a_whole_read_reads(file, data):
    """Written in pieces and read after each (as the dashboard polls), then read once more at the
    end (as rl report does): the same records as one read of the whole file."""
    content, _ = file
    cuts = sorted(data.draw(st.lists(st.integers(0, len(content)), max_size=4)))
    with folder() as d:
        path = d / "metrics.jsonl"
        tail, got, problems = JsonlTail(path), [], []
        for start, end in zip([0, *cuts], [*cuts, len(content)]):
            with path.open("ab") as f:
                f.write(content[start:end])
            records, replaced, found = tail.read()
            assert not replaced
            got += records
            problems += found
        records, _, found = tail.read(final=True)
        warnings: list[str] = []
        assert got + records == read_jsonl(path, warnings.append)
    torn = [w for w in warnings if "cut off" in w]
    assert not any("cut off" in p for p in problems)  # a write in progress is not called torn
    assert len([p for p in found if "cut off" in p]) == len(torn)


metric_keys = st.sampled_from(["step", "rollout/reward", "rollout/domain/math/reward", "rollout/effort/low/reward",
                               "time/step_s", "train/mismatch", "moe/imbalance/layer1", "weights/version"])
sample_keys = st.sampled_from(["step", "uid", "reward", "domain", "effort", "transcript", "grade", "passed", "env"])
moe_keys = st.sampled_from(["step", "layers", "load"])
odd_values = json_values | st.integers(-(10**400), 10**400) | st.sampled_from([[[1, 2]], [1], [[float("inf")]]])


def records_of(keys) -> st.SearchStrategy:
    return st.lists(st.dictionaries(keys, odd_values, max_size=6), max_size=5)


def write_run(d: Path, metrics: list, samples: list, moe: list, torn: bytes) -> None:
    (d / "config.yaml").write_text("name: fuzz\ntrain: {steps: 5}\n")
    metrics = [{"step": 0, "rollout/reward": 0.5, "time/step_s": 1.0}, *metrics]  # some charts have data
    for name, records in (("metrics.jsonl", metrics), ("rollouts.jsonl", samples), ("moe_load.jsonl", moe)):
        (d / name).write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + torn)


@settings(FUZZ, max_examples=80)
@given(records_of(metric_keys), records_of(sample_keys), records_of(moe_keys), st.sampled_from([b"", b'{"step": 9, "a']))
def test_the_dashboard_reads_records_of_any_shape(metrics, samples, moe, torn):
    """What the state endpoint builds, short of drawing the figures (the next test draws them)."""
    with folder() as d:
        write_run(d, metrics, samples, moe, torn)
        run = RunData(d)
        run.refresh()
        for panel in build_panels([run]):
            assert all(chart.has_data in (True, False) for chart in panel.charts)
            json.dumps([table.rows for table in panel.tables], default=str)
        json.dumps(find_samples([run], SampleQuery()), default=str)
        json.dumps(find_samples([run], SampleQuery.parse({"min_reward": "0", "domain": "math"})), default=str)


@settings(FUZZ, max_examples=12)
@given(records_of(metric_keys), records_of(sample_keys), records_of(moe_keys), st.sampled_from([b"", b'{"step": 9, "a']))
def test_the_dashboard_state_is_built_for_records_of_any_shape(metrics, samples, moe, torn):
    with folder() as d:
        write_run(d, metrics, samples, moe, torn)
        board = Dashboard([d])
        board.refresh()
        state = json.loads(board.state())
        assert state["runs"] == [d.name] and state["panels"]


@settings(FUZZ, max_examples=8)
@given(records_of(metric_keys), records_of(sample_keys), records_of(moe_keys), st.sampled_from([b"", b'{"step": 9, "a']))
def test_rl_report_writes_records_of_any_shape(metrics, samples, moe, torn):
    with folder() as d:
        write_run(d, metrics, samples, moe, torn)
        report = write_report(d).read_text()
    assert report.startswith("# Run report: ")
    assert ("cut off, a write the run did not finish" in report) == bool(torn)


# -- manifests -----------------------------------------------------------------------------------------
names = st.text(alphabet="abcdefghij_.", min_size=1, max_size=8).filter(lambda n: n not in (".", "..", MANIFEST))
trees = st.dictionaries(st.lists(names, min_size=1, max_size=3).map("/".join), st.binary(max_size=200),
                        min_size=1, max_size=6)
DAMAGE = ["none", "extra file", "truncate", "append", "flip a byte", "delete", "manifest bytes", "manifest json",
          "no manifest"]


def build(d: Path, tree: dict[str, bytes]) -> list[str]:
    """Write the tree (a name that is also a folder of another entry is skipped); the files written."""
    written = []
    for rel, content in tree.items():
        path = d / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            written.append(rel)
        except (IsADirectoryError, NotADirectoryError, FileExistsError):
            pass
    return [rel for rel in written if (d / rel).is_file()]


def damage(d: Path, files: list[str], kind: str, data) -> str:
    """Do `kind` of damage to the checkpoint in `d`; what was done ("none" when there was nothing to cut)."""
    target = d / data.draw(st.sampled_from(files))
    if kind == "extra file":
        (d / "eval.json").write_text("{}")
    elif kind == "truncate":
        sized = [f for f in files if (d / f).stat().st_size]
        if not sized:
            return "none"
        target = d / data.draw(st.sampled_from(sized))
        target.write_bytes(target.read_bytes()[: data.draw(st.integers(0, target.stat().st_size - 1))])
    elif kind == "append":
        with target.open("ab") as f:
            f.write(data.draw(st.binary(min_size=1, max_size=20)))
    elif kind == "flip a byte":
        content = bytearray(target.read_bytes() or b"\0")
        i = data.draw(st.integers(0, len(content) - 1))
        content[i] ^= data.draw(st.integers(1, 255))
        target.write_bytes(bytes(content))
    elif kind == "delete":
        target.unlink()
    elif kind == "manifest bytes":
        (d / MANIFEST).write_bytes(data.draw(st.binary(max_size=200)))
    elif kind == "manifest json":
        (d / MANIFEST).write_text(json.dumps(data.draw(json_values | st.fixed_dictionaries({"files": json_values}))))
    elif kind == "no manifest":
        (d / MANIFEST).unlink()
    return kind


@settings(FUZZ, max_examples=150)
@given(trees, st.sampled_from(DAMAGE), st.data())
def test_a_manifest_accepts_a_whole_checkpoint_and_nothing_else(tree, kind, data):
    with folder() as d:
        files = build(d, tree)
        write_manifest(d)
        kind = damage(d, files, kind, data)
        problem = verify_manifest(d)
    if kind in ("none", "extra file"):
        assert problem is None
    else:
        assert isinstance(problem, str) and problem and "\n" not in problem


@settings(FUZZ, max_examples=60)
@given(st.lists(st.sampled_from(DAMAGE), min_size=1, max_size=4), st.data())
def test_resume_takes_the_newest_whole_checkpoint_and_names_the_rest(kinds, data):
    with folder() as run:
        for step, kind in enumerate(kinds):
            tag = run / "checkpoints" / f"step_{step}"
            files = build(tag, {"model.pt": os.urandom(64), "hf/config.json": b"{}", "scheduler.json": b"{}"})
            write_manifest(tag)
            assert damage(tag, files, kind, data) == kind
        (run / "checkpoints" / "latest").write_text(f"step_{len(kinds) - 1}")
        whole = [step for step, kind in enumerate(kinds) if kind in ("none", "extra file")]
        try:
            found, note = checkpoint_to_resume(run)
        except Exception as exc:  # RunRefused: only when no checkpoint is whole
            assert not whole and type(exc).__name__ == "RunRefused" and "\n" not in str(exc)
            return
    assert found == (f"step_{whole[-1]}", whole[-1])
    torn = [f"step_{s}" for s in range(whole[-1] + 1, len(kinds))]
    if torn:
        assert note.endswith(f"resuming from step_{whole[-1]}, the newest whole checkpoint") and "\n" not in note
        assert [part.split(" is torn")[0] for part in note.split("; ")] == torn[::-1]
    else:
        assert note is None
