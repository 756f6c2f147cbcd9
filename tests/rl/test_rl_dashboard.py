"""`rl dashboard` in a real headless browser and `rl report`, both on the run folder of a real tiny
training run (shared by every test here): every panel draws with data, a metrics line written
during the test appears without a reload, the sample table filters, two runs sit side by side,
and the report's PNGs are real pictures. Screenshots are kept under pytest's tmp folder."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rl.cli import app

from tests_rl_config import TINY

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, ray_session) -> Path:
    from rl.trainer import train

    out = tmp_path_factory.mktemp("dashboard")
    tree = {**TINY, "output_dir": str(out / "runs"), "logging": {**TINY["logging"], "tensorboard": True}}
    config = out / "tiny.yaml"
    config.write_text(yaml.safe_dump(tree))
    return Path(train(str(config), [])["run_dir"])


@pytest.fixture(scope="module")
def second_run(tiny_run) -> Path:
    """The same run under another name, shown beside the first."""
    copy = tiny_run.parent / "tiny-second"
    shutil.copytree(tiny_run, copy, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    return copy


def rollouts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def test_the_run_writes_tensorboard_events_when_the_config_asks(tiny_run):
    assert list((tiny_run / "tensorboard").glob("events.out.tfevents.*"))


def test_report_writes_markdown_and_readable_pngs(tiny_run, tmp_path):
    from PIL import Image, ImageStat

    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(tiny_run), "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = (out / "report.md").read_text()
    for heading in ("## Configuration", "## Quality gate", "## Held-out evaluation", "## Training", "## Curves"):
        assert heading in text
    assert "| math | ok |" in text and "agentic_shell" in text
    pictures = sorted(out.glob("*.png"))
    assert {p.stem for p in pictures} >= {"rewards", "effort", "throughput", "learner", "env"}
    for picture in pictures:
        assert f"]({picture.name})" in text
        image = Image.open(picture).convert("L")
        assert image.width >= 600 and image.height >= 300
        assert ImageStat.Stat(image).stddev[0] > 10  # not a blank canvas
    print(f"\nreport: {out / 'report.md'}")


# -- the browser ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the dev extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="rl-dashboard-chromium-")
    for flag in BROWSER_FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def dashboard_url(tiny_run, second_run):
    """`rl dashboard RUN_A RUN_B --port 0` as a user starts it; its URL."""
    command = [sys.executable, "-m", "rl.cli", "dashboard", str(tiny_run), str(second_run), "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("dashboard: http://"), line + proc.stdout.read() if proc.poll() is not None else line
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_for(driver, script: str, timeout: float = 60.0, what: str = ""):
    """Poll a JavaScript expression until it is truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(f"return {script}")
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or script}")
        time.sleep(0.25)


def screenshot(driver, folder: Path, name: str) -> Path:
    """The whole page, for a person to look at."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(height + 100, 16000))
    time.sleep(0.5)  # plotly redraws charts on resize
    path = folder / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1400, 1000)
    print(f"\nscreenshot: {path}")
    return path


CHARTS_JS = """[...document.querySelectorAll('.chart')].map(d => ({
    id: d.id.slice(6), panel: d.closest('section').id.slice(6), hasData: d.dataset.hasData === 'true',
    drawn: !!d.querySelector('.main-svg'), traces: (d.data || []).length,
    titles: ((d.layout || {}).annotations || []).map(a => a.text)}))"""


def test_dashboard_in_a_browser(browser, dashboard_url, tiny_run, second_run, tmp_path_factory):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    shots = tmp_path_factory.mktemp("screenshots")
    browser.get(dashboard_url)
    wait_for(browser, "document.querySelectorAll('.chart').length > 20 && "
                      "[...document.querySelectorAll('.chart')].every(d => d.querySelector('.main-svg'))",
             what="every chart drawn")
    browser.execute_script("window.loadedOnce = 'yes'")  # a reload would drop this
    fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert fetched and all(url.startswith(dashboard_url) for url in fetched), fetched  # nothing from the network
    charts = browser.execute_script(f"return {CHARTS_JS}")
    panels = {c["panel"] for c in charts}
    assert panels >= {"rewards", "effort", "throughput", "mismatch", "learner", "moe", "env", "hacking"}
    # What the trainer records today is drawn; what it does not yet record says so.
    with_data = {c["id"] for c in charts if c["hasData"] and c["traces"]}
    assert {"rewards.domain_reward", "rewards.effort_pass", "effort.pareto", "effort.tokens",
            "throughput.time_split", "throughput.engine_batch", "env.grading", "learner.warmup",
            "learner.warmup_time", "throughput.episode_phases"} <= with_data
    # Two runs side by side: every chart has a column titled with each run's name.
    for chart in charts:
        assert tiny_run.name in chart["titles"] and second_run.name in chart["titles"], chart
    tables = browser.find_elements(By.CSS_SELECTOR, "#panel-env .table")
    assert len(tables) == 2 and all("math" in t.text and "ok" in t.text for t in tables)
    screenshot(browser, shots, "dashboard-two-runs")

    # A step is written while the page is open: it appears with no reload, and every chart now
    # has data (this line carries the metrics the trainer is about to record, and an expert-load line).
    last = max(json.loads(line)["step"] for line in (tiny_run / "metrics.jsonl").read_text().splitlines())
    step = last + 1
    metrics = {"step": step, "rollout/reward": 0.75, "rollout/pass_rate": 0.5, "train/loss": 0.125,
               "train/entropy": 2.0, "train/kl": 0.01, "train/grad_norm": 0.8, "train/advantage_abs": 0.4,
               "train/ratio": 1.0, "train/clipped": 0.05, "train/mismatch": 0.02, "train/mismatch/domain/math": 0.03,
               "throughput/samples_per_s": 6.5, "throughput/tokens_per_s": 300.0, "time/sync_s": 0.2,
               "time/learner_idle_frac": 0.3, "time/rollout_idle_frac": 0.1, "engine/tokens_per_step": 12.0,
               "engine/step_ms": 4.0, "engine/launch_ms": 1.0, "engine/wait_ms": 2.5, "async/staleness_mean": 0.5,
               "async/staleness_max": 1, "async/staleness/0": 0.5, "async/staleness/1": 0.5,
               "async/aborted_groups": 0, "rollout/refilled_groups": 1, "train/is_weight_mean": 1.0,
               "train/is_weight_std": 0.1, "train/is_weight_min": 0.7, "train/is_weight_max": 1.4,
               "train/is_masked_frac": 0.01, "train/routing_agreement": 0.93, "moe/imbalance/layer0": 1.6,
               "env/math/grade_errors": 0, "env/math/grade_timeouts": 1, "env/shell/env_errors": 0,
               "env/sandbox_live": 4, "env/sandbox_acquire_s": 0.02, "hack/math/distinct_answers": 3,
               "hack/math/degenerate_frac": 0.25, "train/model_tflops_per_s": 1.5, "train/mfu": 0.2}
    with (tiny_run / "moe_load.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, "layers": [0, 2], "load": [[0.4, 0.3, 0.2, 0.1], [0.25] * 4]}) + "\n")
    with (tiny_run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(metrics) + "\n")
    wait_for(browser, "document.getElementById('chart-throughput.samples').dataset.hasData === 'true'",
             what="the appended step on the page")
    assert browser.execute_script("return window.loadedOnce") == "yes"
    wait_for(browser, "[...document.querySelectorAll('.chart')].every(d => d.dataset.hasData === 'true')",
             timeout=10, what="every chart with data")
    charts = browser.execute_script(f"return {CHARTS_JS}")
    assert all(c["drawn"] and c["traces"] for c in charts), [c["id"] for c in charts if not c["traces"]]
    runs_row = browser.find_element(By.CSS_SELECTOR, "#panel-runs tbody tr").text
    assert f"{step + 1} / {TINY['train']['steps']}" in runs_row
    screenshot(browser, shots, "dashboard-after-a-new-step")

    # The sample table filters by run, domain, effort and reward; a row opens its transcript.
    samples = {run.name: rollouts(run) for run in (tiny_run, second_run)}

    def shown_rows() -> list[dict[str, str]]:
        cells = browser.execute_script(
            "return [...document.querySelectorAll('#samples-body tr.row')].map(r => "
            "Object.fromEntries([...r.children].map(c => [c.className, c.textContent])))")
        return cells

    def expect(run="", domain="", effort="", min_reward=None) -> None:
        want = sum(1 for name, recs in samples.items() for r in recs
                   if (not run or name == run) and (not domain or r["domain"] == domain)
                   and (not effort or r["effort"] == effort) and (min_reward is None or r["reward"] >= min_reward))
        wait_for(browser, f"document.getElementById('samples-count').textContent.endsWith(' of {want} matching')",
                 timeout=10, what=f"{want} matching samples")
        for row in shown_rows():
            assert (not run or row["run"] == run) and (not domain or row["domain"] == domain)
            assert not effort or row["effort"] == effort
            assert min_reward is None or float(row["reward"]) >= min_reward

    browser.find_element(By.ID, "panel-samples").location_once_scrolled_into_view
    expect()
    Select(browser.find_element(By.ID, "f-run")).select_by_visible_text(second_run.name)
    expect(run=second_run.name)
    Select(browser.find_element(By.ID, "f-run")).select_by_index(0)
    Select(browser.find_element(By.ID, "f-domain")).select_by_visible_text("math")
    expect(domain="math")
    effort = samples[tiny_run.name][0]["effort"]
    Select(browser.find_element(By.ID, "f-effort")).select_by_visible_text(effort)
    expect(domain="math", effort=effort)
    Select(browser.find_element(By.ID, "f-domain")).select_by_index(0)
    Select(browser.find_element(By.ID, "f-effort")).select_by_index(0)
    browser.find_element(By.ID, "f-min").send_keys("0.5")
    expect(min_reward=0.5)
    browser.find_element(By.ID, "f-min").clear()
    browser.execute_script("document.getElementById('f-min').dispatchEvent(new Event('input'))")
    Select(browser.find_element(By.ID, "f-domain")).select_by_visible_text("tool_use")
    expect(domain="tool_use")
    row = browser.find_element(By.CSS_SELECTOR, "#samples-body tr.row")
    uid, run = row.get_attribute("data-uid"), row.get_attribute("data-run")
    record = next(r for r in samples[run] if r["uid"] == uid)
    browser.execute_script("arguments[0].click()", row)  # a real click could land on the sticky header
    detail = wait_for(browser, "document.querySelector('#samples-body tr.detail .msg.assistant') && "
                               "document.querySelector('#samples-body tr.detail').textContent",
                      timeout=10, what="the sample's transcript")
    assert record["transcript"][1]["content"] in detail  # the user's question, shown whole
    if any(m["role"] == "tool" for m in record["transcript"]):
        assert browser.find_elements(By.CSS_SELECTOR, "#samples-body tr.detail .msg.tool")
    screenshot(browser, shots, "dashboard-samples")
