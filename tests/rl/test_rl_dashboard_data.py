"""The dashboard's reading of a run folder while it is written, without a browser: half-written
lines, replaced files, resumed steps, corrupt lines, absent metrics, sample filters."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl.cli import app
from rl.dashboard.model import RunData
from rl.dashboard.panels import build_panels
from rl.dashboard.plotly_render import figure
from rl.dashboard.runfolder import JsonlTail
from rl.dashboard.samples import QueryError, SampleQuery, find_samples
from rl.dashboard.server import Dashboard, DashboardError, make_server


def write_lines(path: Path, records: list[dict], mode: str = "a") -> None:
    with path.open(mode) as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def new_run(tmp_path: Path, name: str = "run") -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "config.yaml").write_text("name: run\ntrain: {steps: 10}\n")
    return run


def test_a_half_written_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == ([], False, [])  # not there yet
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a"')
    assert tail.read()[0] == [{"step": 0, "a": 1}]
    assert tail.read()[0] == []
    with path.open("a") as f:
        f.write(': 2}\n')
    assert tail.read()[0] == [{"step": 1, "a": 2}]


def test_a_long_file_is_read_from_near_its_end(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    write_lines(path, [{"step": s, "pad": "x" * 50} for s in range(100)])
    records, _, problems = JsonlTail(path, start_from_end=1000).read()
    assert [r["step"] for r in records] == list(range(100 - len(records), 100)) and 10 <= len(records) < 20
    assert problems == []  # the fragment the read starts in is dropped, not reported


def test_a_replaced_file_is_read_again_from_the_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [{"step": 0}, {"step": 1}, {"step": 2}])
    tail = JsonlTail(path)
    assert len(tail.read()[0]) == 3
    replacement = tmp_path / "new.jsonl"
    write_lines(replacement, [{"step": 0, "b": 1}])
    replacement.replace(path)
    records, replaced, _ = tail.read()
    assert replaced and records == [{"step": 0, "b": 1}]


def test_a_resumed_run_replaces_the_steps_it_repeats(tmp_path):
    run_dir = new_run(tmp_path)
    write_lines(run_dir / "metrics.jsonl", [{"step": -1, "sft/loss": 3.0}] +
                [{"step": s, "rollout/reward": 0.1 * s} for s in range(5)])
    run = RunData(run_dir)
    assert run.refresh()
    assert not run.refresh()  # nothing new
    write_lines(run_dir / "metrics.jsonl", [{"step": 3, "rollout/reward": 0.9}, {"step": 4, "rollout/reward": 1.0}])
    assert run.refresh()
    assert run.grpo.series("rollout/reward") == ([0, 1, 2, 3, 4], [0.0, 0.1, 0.2, 0.9, 1.0])
    assert run.warmup.series("sft/loss") == ([-1], [3.0])


def test_a_corrupt_line_is_reported_and_the_rest_read(tmp_path):
    run_dir = new_run(tmp_path)
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "rollout/reward": 0.5}\nnot json\n{"rollout/reward": 1}\n'
                                           '{"step": 1, "rollout/reward": 0.25}\n')
    (run_dir / "gate.json").write_text('{"math": {"ok": tr')  # being written
    run = RunData(run_dir)
    run.refresh()
    assert run.grpo.series("rollout/reward") == ([0, 1], [0.5, 0.25])
    assert any("not JSON" in p for p in run.problems) and any("no integer 'step'" in p for p in run.problems)
    assert any("gate.json" in p for p in run.problems) and run.gate == {}
    (run_dir / "gate.json").write_text('{"math": {"ok": true, "reasons": []}}')
    run.refresh()
    assert run.gate["math"]["ok"] is True


def test_every_panel_says_no_data_yet_for_a_run_that_just_started(tmp_path):
    run = RunData(new_run(tmp_path))
    run.refresh()
    panels = build_panels([run])
    charts = [c for p in panels for c in p.charts]
    assert len(charts) > 20 and not any(c.has_data for c in charts)
    for chart in charts:
        notes = [a.text for a in figure(chart).layout.annotations]
        assert "no data yet" in notes and any(n.startswith("waiting for: ") for n in notes), chart.id


def test_a_chart_names_the_metrics_it_still_lacks(tmp_path):
    run_dir = new_run(tmp_path)
    write_lines(run_dir / "metrics.jsonl", [{"step": 0, "time/rollout_s": 2.0, "time/train_s": 1.0}])
    run = RunData(run_dir)
    run.refresh()
    (throughput,) = [p for p in build_panels([run]) if p.id == "throughput"]
    split = next(c for c in throughput.charts if c.id == "throughput.time_split")
    plot = split.plots[run.name]
    assert [line.name for line in plot.lines] == ["rollout", "learner"] and plot.missing == ["time/sync_s"]
    assert "no data yet: time/sync_s" in [a.text for a in figure(split).layout.annotations]


def test_moe_load_gives_the_newest_heatmap_and_imbalance_per_step(tmp_path):
    run_dir = new_run(tmp_path)
    write_lines(run_dir / "moe_load.jsonl", [
        {"step": 0, "layers": [1, 3], "load": [[0.5, 0.5], [0.9, 0.1]]},
        {"step": 1, "layers": [1, 3], "load": [[0.75, 0.25], [0.5, 0.5]]},
        {"step": 2, "layers": [1], "load": [[1.0], [0.5]]},  # rows do not match the layers
    ])
    run = RunData(run_dir)
    run.refresh()
    assert run.moe.latest_step == 1 and run.moe.latest == [[0.75, 0.25], [0.5, 0.5]]
    assert run.moe.imbalance[0] == {1: 1.0, 3: pytest.approx(1.8)} and run.moe.imbalance[1][1] == 1.5
    assert any("step 2 has 1 layers but 2 load rows" in p for p in run.problems)
    (moe,) = [p for p in build_panels([run]) if p.id == "moe"]
    assert all(c.has_data for c in moe.charts)


def test_samples_filter_by_run_domain_effort_and_reward(tmp_path):
    runs = []
    for name in ("a", "b"):
        run_dir = new_run(tmp_path, name)
        write_lines(run_dir / "rollouts.jsonl", [
            {"step": s, "uid": f"s{s}/{i}", "domain": domain, "effort": effort, "reward": reward,
             "transcript": [{"role": "user", "content": f"question {s}"}, {"role": "assistant", "content": "x"},
                            {"role": "tool", "content": "y"}]}
            for s in range(3) for i, (domain, effort, reward) in
            enumerate([("math", "low", 0.0), ("math", "max", 1.0), ("tool_use", "low", 0.5)])])
        runs.append(RunData(run_dir))
        runs[-1].refresh()

    def uids(**params) -> list[tuple[str, str]]:
        found = find_samples(runs, SampleQuery.parse({k: str(v) for k, v in params.items()}))
        return [(row["run"], row["uid"]) for row in found["rows"]]

    assert len(uids()) == 18
    assert uids(run="b", domain="math", effort="max") == [("b", "s2/1"), ("b", "s1/1"), ("b", "s0/1")]
    assert {u for _, u in uids(min_reward=0.4, max_reward=0.6)} == {"s0/2", "s1/2", "s2/2"}
    assert len(uids(limit=4)) == 4
    row = find_samples(runs, SampleQuery(run="a", limit=1))["rows"][0]
    assert row["step"] == 2 and row["prompt"] == "question 2" and row["tool_calls"] == 1
    with pytest.raises(QueryError, match="min_reward must be a number"):
        SampleQuery.parse({"min_reward": "lots"})


def test_dashboard_refuses_what_it_cannot_show(tmp_path):
    with pytest.raises(DashboardError, match="not a run folder"):
        Dashboard([tmp_path])
    run = new_run(tmp_path)
    with pytest.raises(DashboardError, match="named twice"):
        Dashboard([run, run])
    taken = make_server(Dashboard([run]), port=0)
    try:
        with pytest.raises(DashboardError, match=f"cannot listen on 127.0.0.1:{taken.server_address[1]}"):
            make_server(Dashboard([run]), port=taken.server_address[1])
    finally:
        taken.server_close()


def test_cli_refuses_a_folder_that_is_not_a_run(tmp_path):
    for command in (["dashboard", str(tmp_path)], ["report", str(tmp_path / "nope")]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2 and "is not a run folder" in " ".join(result.output.split())


def test_the_server_answers_only_changes_and_names_a_bad_filter(tmp_path):
    import threading
    import urllib.error
    import urllib.request

    run = new_run(tmp_path)
    write_lines(run / "metrics.jsonl", [{"step": 0, "rollout/reward": 0.5}])
    server = make_server(Dashboard([run]), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    get = lambda path: json.loads(urllib.request.urlopen(base + path, timeout=30).read())  # noqa: E731
    try:
        state = get("/api/state")
        assert state["runs"] == ["run"] and any(p["id"] == "rewards" for p in state["panels"])
        assert get(f"/api/state?since={state['version']}") == {"version": state["version"]}
        write_lines(run / "metrics.jsonl", [{"step": 1, "rollout/reward": 0.75}])
        assert get(f"/api/state?since={state['version']}")["version"] == state["version"] + 1
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(base + "/api/samples?min_reward=high", timeout=30)
        assert error.value.code == 400 and json.loads(error.value.read()) == {
            "error": "min_reward must be a number, got 'high'"}
        assert b"Plotly" in urllib.request.urlopen(base + "/static/plotly.min.js", timeout=30).read(4096)
    finally:
        server.shutdown()
        server.server_close()
