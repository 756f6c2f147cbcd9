"""`rl dashboard` and `rl report` on a run of 200 domains in 4 families: charts by family, the best and
worst domains, the held-out table by family (standard errors pooled exactly), the gate by family, the
domain picker in a real browser, and what a step costs in metrics.jsonl and in charted metrics. The run
folder is written by the trainer's own producers (rollout_metrics, MetricsLogger, summarise_eval,
rollout_record, HackMonitor) from simulated samples, so no training is needed."""
from __future__ import annotations

import json
import random
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from rl.config import dump_config, validate
from rl.dashboard.domains import family_eval, pool
from rl.dashboard.model import RunData
from rl.dashboard.panels import build_panels
from rl.dashboard.report import write_report
from rl.dashboard.server import Dashboard, make_server
from rl.evaluation import summarise_eval
from rl.hack_monitor import HackMonitor, responses_from_records
from rl.metrics import MetricsLogger, charted, rollout_metrics
from rl.rollout.scheduler import rollout_record
from rl.types import Sample

from test_rl_dashboard import CHARTS_JS, browser, screenshot, wait_for  # noqa: F401 - the browser fixture

FAMILIES = {"math": 50, "lookup": 50, "dataset": 60, "shell": 40}
DOMAINS = [f"{family}:d{i}" for family, n in FAMILIES.items() for i in range(n)]
STEPS, GROUPS, GROUP_SIZE = 30, 16, 8


def _sample(rng: random.Random, domain: str, uid: str, p: float, effort: str, step: int) -> Sample:
    passed = rng.random() < p
    return Sample(uid=uid, group_uid=uid.rsplit("/", 1)[0], env=domain, domain=domain, task_id=f"{domain}/t{step}",
                  effort=effort, tokens=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0.0, -0.5, -0.5],
                  token_versions=[-1, step, step], reward=float(passed), passed=passed, num_turns=1,
                  phase_s={"start": 0.1, "generate": 0.5, "tools": 0.0, "grade": 0.05},
                  transcript=[{"role": "user", "content": f"a task of {domain}"},
                              {"role": "assistant", "content": "The answer is 1." if passed else "no idea"}])


def _skill(domain: str, progress: float) -> float:
    base = {"math": 0.1, "lookup": 0.4, "dataset": 0.3, "shell": 0.5}[domain.split(":")[0]]
    return min(1.0, base + 0.3 * progress + 0.002 * int(domain.rsplit("d", 1)[1]))


def write_run(root: Path) -> tuple[Path, list[int]]:
    """A finished run folder of 200 domains; the bytes of each GRPO step's metrics.jsonl line."""
    rng = random.Random(0)
    run = root / "many-domains-run"
    run.mkdir()
    cfg = validate({"name": "many", "envs": [{"name": d, "weight": 1.0} for d in DOMAINS], "train": {"steps": STEPS},
                    "eval": {"efforts": ["low", "medium"]}, "logging": {"wandb_mode": "disabled"}})
    dump_config(cfg, run / "config.yaml")
    (run / "gate.json").write_text(json.dumps({d: {"env": d, "ok": d != "shell:d7", "cached": i % 3 == 0,
                                                   "gate_s": 0.4, "reasons": [] if d != "shell:d7" else ["leaks: 1"]}
                                               for i, d in enumerate(DOMAINS)}))
    logger = MetricsLogger(run, "disabled", "p", "many", cfg.model_dump(mode="json"), resume=False)
    hacks, sizes = HackMonitor(), []
    with (run / "rollouts.jsonl").open("w") as rollouts:
        for step in range(STEPS):
            samples = []
            for g in range(GROUPS):
                domain = rng.choice(DOMAINS)
                samples += [_sample(rng, domain, f"s{step}g{g}/{i}", _skill(domain, step / STEPS), "medium", step)
                            for i in range(GROUP_SIZE)]
            records = [rollout_record(step, s, trained=True) for s in samples]
            metrics = rollout_metrics(samples, step)
            metrics.update({f"train/mismatch/domain/{s.domain}": 0.01 for s in samples[::GROUP_SIZE]})
            metrics.update(hacks.observe(step, responses_from_records(records))[0])
            metrics["train/mismatch"] = 0.01
            before = (run / "metrics.jsonl").stat().st_size if (run / "metrics.jsonl").exists() else 0
            logger.log(step, metrics)
            sizes.append((run / "metrics.jsonl").stat().st_size - before)
            rollouts.write("".join(json.dumps(r) + "\n" for r in records))
    logger.close()
    for tag, progress in (("before", 0.0), ("after", 1.0)):
        samples = [_sample(rng, d, f"{tag}/{d}/{effort}/{t}/{i}", _skill(d, progress), effort, 0)
                   for d in DOMAINS for effort in ("low", "medium") for t in range(2) for i in range(4)]
        (run / f"eval_{tag}.json").write_text(json.dumps(summarise_eval(samples)))
    return run, sizes


@pytest.fixture(scope="module")
def many_run(tmp_path_factory) -> tuple[Path, list[int]]:
    return write_run(tmp_path_factory.mktemp("many-domains"))


def test_a_step_of_200_domains_stays_small_in_every_sink(many_run):
    run, sizes = many_run
    per_step = sum(sizes) / len(sizes)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    charted_keys = {k for r in records for k in charted(r)}
    every_key = {k for r in records for k in r}
    print(f"\nmetrics.jsonl: {per_step:.0f} bytes a step (max {max(sizes)}), {len(every_key)} metric names in "
          f"{STEPS} steps, {len(charted_keys)} of them charted in wandb / TensorBoard")
    assert per_step < 16_000  # a step's groups set its size, not the run's 200 domains
    assert len(charted_keys) < 120 and not any(":" in k for k in charted_keys)
    assert {"rollout/family/math/reward", "rollout/family/shell/episode_s/generate"} <= charted_keys
    assert not any(k.startswith("rollout/domain/") and k.endswith("/response_tokens") for k in every_key)


def test_family_cells_pool_their_domains_samples_exactly():
    rng = random.Random(1)
    samples = [_sample(rng, d, f"e/{d}/{i}", rng.random(), "low", 0)
               for d in DOMAINS[:60] for i in range(rng.randint(1, 9))]
    per_domain = summarise_eval(samples)
    by_family = summarise_eval([Sample(**{**vars(s), "domain": s.domain.split(":")[0]}) for s in samples])
    pooled = family_eval(per_domain)
    for family in ("math", "lookup"):
        assert pooled[family]["low"]["reward"] == pytest.approx(by_family[family]["low"]["reward"])
        assert pooled[family]["low"]["stderr"] == pytest.approx(by_family[family]["low"]["stderr"])
        assert pooled[family]["low"]["n"] == by_family[family]["low"]["n"]
    assert pool([]) is None


def test_panels_and_report_group_200_domains_by_family(many_run, tmp_path):
    run_dir, _ = many_run
    run = RunData(run_dir)
    run.refresh(final=True)
    panels = {p.id: p for p in build_panels([run])}
    reward = next(c for c in panels["rewards"].charts if c.id == "rewards.domain_reward")
    assert sorted(line.name for line in reward.plots[run.name].lines) == ["all", "dataset", "lookup", "math", "shell"]
    heldout = panels["rewards"].tables[0]
    assert [row[0] for row in heldout.rows] == ["dataset", "lookup", "math", "shell", "all"]
    assert all("±" in cell for row in heldout.rows[:-1] for cell in row[2:])
    ranking = panels["domains"].tables[0]
    assert len(ranking.rows) == 20 and ranking.rows[0][0] == "best 1" and ranking.rows[-1][0].startswith("worst")
    assert float(ranking.rows[0][3]) >= float(ranking.rows[-1][3])
    gate = panels["env"].tables[0]
    shell = next(row for row in gate.rows if row[0] == "shell")
    assert shell[1:3] == ["40", "39"] and "shell:d7: leaks: 1" in shell[5]
    mismatch = next(c for c in panels["mismatch"].charts if c.id == "mismatch.gap")
    assert len(mismatch.plots[run.name].lines) <= 5  # all, and one pooled line per family
    report = write_report(run_dir, tmp_path / "report").read_text()
    assert "| math | 50 |" in report and "<summary>shell: 40 domains</summary>" in report
    assert "best and worst 10 of" in report.lower() and "math x50 (weight 50)" in report


def test_the_page_of_200_domains_in_a_browser(browser, many_run, tmp_path):  # noqa: F811 - the fixture
    run_dir, _ = many_run
    dashboard = Dashboard([run_dir])
    server = make_server(dashboard, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dashboard.refresh()
        state_bytes = len(dashboard.state())
        browser.get(f"http://127.0.0.1:{server.server_address[1]}/")
        wait_for(browser, "document.querySelectorAll('.chart').length > 20 && "
                          "[...document.querySelectorAll('.chart')].every(d => d.querySelector('.main-svg'))",
                 what="every chart drawn")
        charts = {c["id"]: c for c in browser.execute_script(f"return {CHARTS_JS}")}
        assert charts["rewards.domain_reward"]["traces"] == 5  # all and four families, not 200 lines
        ranking = browser.execute_script("return document.querySelectorAll('#panel-domains tbody tr').length")
        assert ranking == 20
        families = browser.execute_script(
            "return [...document.querySelectorAll('#panel-rewards tbody tr')].map(r => r.children[0].textContent)")
        assert families == ["dataset", "lookup", "math", "shell", "all"]
        options = browser.execute_script("return document.querySelectorAll('#domain-list option').length")
        assert options == 200 and browser.execute_script("return !document.getElementById('panel-domain').hidden")
        picked = "lookup:d17"
        browser.execute_script("const i = document.getElementById('f-pick'); i.value = arguments[0];"
                               "i.dispatchEvent(new Event('input'))", picked)
        wait_for(browser, f"document.getElementById('chart-domain').dataset.domain === '{picked}' && "
                          "document.getElementById('chart-domain').querySelector('.main-svg')",
                 what="the picked domain")
        traces = browser.execute_script("return document.getElementById('chart-domain').data.map(t => t.name)")
        assert traces[-1] == "family lookup" and "reward" in traces
        heldout = browser.execute_script("return document.getElementById('table-domain').textContent")
        assert f"{picked}: held-out reward" in heldout and "->" in heldout
        families = browser.execute_script("return [...document.querySelectorAll('#f-family option')].map(o => o.value)")
        assert families == ["", "dataset", "lookup", "math", "shell"]
        screenshot(browser, tmp_path, "dashboard-200-domains")
        print(f"\nthe page's state: {state_bytes / 1e6:.2f} MB for 200 domains")
        assert state_bytes < 3_000_000
    finally:
        server.shutdown()


def test_domains_by_family_in_the_samples_filter(many_run):
    from rl.dashboard.samples import SampleQuery, find_samples

    run = RunData(many_run[0])
    run.refresh(final=True)
    found = find_samples([run], SampleQuery(family="math", limit=500))
    counts = defaultdict(int)
    for row in found["rows"]:
        counts[row["domain"].split(":")[0]] += 1
    assert found["total"] > 0 and set(counts) == {"math"}
