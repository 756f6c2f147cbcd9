"""The documentation cannot rot: its commands run, its configs validate, its links resolve, the config
reference matches the schema, and every benchmark it names exists.

A fenced block in docs/*.md is tested by the HTML comment right above it (invisible when rendered):

    <!-- doc-test: run -->              bash: runs, in order with the page's other blocks, and must exit 0
    <!-- doc-test: run, exit 2 -->      ... must exit 2
    <!-- doc-test: output -->           text: each line must match a line the last run block printed
                                        (`…` stands for any text)
    <!-- doc-test: file NAME -->        the block is written to NAME for the page's later blocks
    <!-- doc-test: config -->           yaml: a valid (partial) run config
    <!-- doc-test: skip: REASON -->     not run (needs a GPU, a cluster, minutes of training), said why

A page's blocks run in a scratch folder holding `configs/` (the repository's), with the virtualenv's
`rl` on the PATH and a registry of its own (RL_ENVS_HOME). In the guides below every bash block carries
a marker. Whether or not they run, `rl train CONFIG key=value ...` lines anywhere in the docs and the
README are loaded with their overrides, so a renamed key fails here.
"""
from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
VENV_BIN = Path(sys.executable).parent
GUIDES = ["concepts.md", "own-environment.md", "own-model.md", "gpus.md", "async.md", "watching-runs.md",
          "troubleshooting.md", "README.md"]
MARK = re.compile(r"<!-- doc-test: (.+?) -->")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    mark: str | None  # the doc-test directive above the block, if any


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.fullmatch(before.strip())
        found.append(Block(path.name, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2),
                           mark.group(1) if mark else None))
    return found


def _marked_pages() -> list[str]:
    return sorted(p.name for p in DOCS.glob("*.md") if "<!-- doc-test: run" in p.read_text())


def _line_pattern(expected: str) -> re.Pattern:
    return re.compile(".*?".join(re.escape(part) for part in expected.strip().split("…")))


def _newest_demo_run(work: Path) -> None:
    """A run folder as `rl train configs/demo.yaml` leaves it, in brief, for the pages that read one:
    its resolved config, six GRPO steps of metrics, held-out tables before and after."""
    from rl.config import dump_config, load_config

    run = work / "runs" / "demo-20261205-101500"
    run.mkdir(parents=True)
    dump_config(load_config(REPO / "configs" / "demo.yaml"), run / "config.yaml")
    rng = random.Random(0)
    domains, efforts = ("tool_use", "agentic_shell", "multi_hop"), ("low", "medium", "high", "max")
    with open(run / "metrics.jsonl", "w") as out:
        for step in range(6):
            row = {"step": step, "rollout/reward": 0.4 + 0.04 * step, "rollout/pass_rate": 0.4 + 0.04 * step,
                   "time/rollout_s": 3.4, "time/train_s": 5.5, "throughput/samples_per_s": 17.8, "train/loss": 0.01}
            row.update({f"rollout/domain/{d}/reward": rng.random() for d in domains})
            row.update({f"rollout/effort/{e}/reward": rng.random() for e in efforts})
            out.write(json.dumps(row) + "\n")
    for name, reward in (("eval_before.json", 0.3), ("eval_after.json", 0.6)):
        table = {d: {e: {"reward": reward, "pass_rate": reward, "tokens": 30.0, "n": 96} for e in (*efforts, "all")}
                 for d in (*domains, "all")}
        (run / name).write_text(json.dumps(table))


SETUP = {"watching-runs.md": _newest_demo_run}


@pytest.mark.parametrize("page", _marked_pages())
def test_a_pages_commands_run(page, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(REPO / "configs")
    if page in SETUP:
        SETUP[page](work)
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "RL_ENVS_HOME": str(tmp_path / "envs"),
           "WANDB_MODE": "disabled"}
    printed = None
    for block in blocks(DOCS / page):
        where = f"docs/{page}:{block.line}"
        if block.mark is None or block.mark.startswith(("skip", "config")):
            continue
        if block.mark.startswith("file "):
            (work / block.mark[5:].strip()).write_text(block.text)
        elif block.mark.startswith("run"):
            exit_code = int(re.search(r"exit (\d+)", block.mark).group(1)) if "exit" in block.mark else 0
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=work, env=env,
                                  capture_output=True, text=True, timeout=600)
            printed = proc.stdout + proc.stderr
            assert proc.returncode == exit_code, \
                f"{where} exited {proc.returncode}, not {exit_code}:\n{printed[-3000:]}"
        elif block.mark == "output":
            assert printed is not None, f"{where}: an output block with no run block before it"
            lines = [line.strip() for line in printed.splitlines()]
            for expected in filter(str.strip, block.text.splitlines()):
                pattern = _line_pattern(expected)
                assert any(pattern.fullmatch(line) for line in lines), \
                    f"{where}: no printed line matches {expected.strip()!r}; printed:\n{printed[-3000:]}"
        else:
            pytest.fail(f"{where}: unknown doc-test directive {block.mark!r}")


def _skipped() -> list[Block]:
    return [b for p in sorted(DOCS.glob("*.md")) for b in blocks(p) if b.mark and b.mark.startswith("skip")]


@pytest.mark.parametrize("block", _skipped(), ids=lambda b: f"{b.page}:{b.line}")
def test_blocks_not_run_say_why(block):
    reason = block.mark.partition(":")[2].strip()
    assert reason, f"docs/{block.page}:{block.line}: `skip` needs a reason (`<!-- doc-test: skip: why -->`)"
    pytest.skip(f"docs/{block.page}:{block.line}: {reason}")


@pytest.mark.parametrize("page", GUIDES)
def test_every_command_block_of_a_guide_is_run_or_says_why_not(page):
    unmarked = [b.line for b in blocks(DOCS / page) if b.lang in ("bash", "sh", "shell", "console") and b.mark is None]
    assert not unmarked, f"docs/{page}: bash blocks at lines {unmarked} carry no <!-- doc-test: ... --> marker"


def test_config_blocks_are_valid_run_configs():
    from rl.config import ConfigError, validate

    checked = 0
    for path in sorted(DOCS.glob("*.md")):
        for block in blocks(path):
            if block.mark == "config":
                try:
                    validate(yaml.safe_load(block.text))
                except ConfigError as exc:
                    pytest.fail(f"docs/{path.name}:{block.line}: {exc}")
                checked += 1
    assert checked, "no <!-- doc-test: config --> block found"


def _train_commands(text: str) -> list[tuple[str, list[str]]]:
    """(config, overrides) of each `rl train CONFIG key=value ...` command in shell text whose every
    argument can be read without running anything (no variables, no placeholders)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words[:-2]):
            if Path(word).name != "rl" or words[i + 1] != "train" or not words[i + 2].endswith(".yaml"):
                continue
            rest = []
            for arg in words[i + 3:]:
                if arg in ("&&", "||", ";", "|") or arg.endswith(";"):
                    break
                rest.append(arg)
            if all(re.match(r"[A-Za-z_][\w.]*=", a) and "$" not in a for a in rest):
                found.append((words[i + 2], rest))
    return found


def test_every_rl_train_command_in_the_docs_loads_its_config_and_overrides():
    from rl.config import ConfigError, load_config

    checked = 0
    for path in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for block in blocks(path):
            if block.lang not in ("bash", "sh", "shell", "console", "") or re.search(r"exit [1-9]", block.mark or ""):
                continue  # not a command, or one shown failing on purpose
            for config, overrides in _train_commands(block.text):
                if not (REPO / config).is_file():
                    continue  # a config of the reader's own (my_config.yaml)
                try:
                    load_config(REPO / config, overrides)
                except ConfigError as exc:
                    command = " ".join(["rl train", config, *overrides])
                    pytest.fail(f"{path.relative_to(REPO)}:{block.line}: {command}: {exc}")
                checked += 1
    assert checked, "no rl train command found in the docs"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as dashes, a
    repeated heading numbered."""
    seen: dict[str, int] = {}
    out = set()
    text = FENCE.sub("", path.read_text())
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_links_between_the_docs_resolve():
    broken = []
    for path in [*sorted(DOCS.glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", path.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_config_reference_matches_the_schema():
    from rl import config_reference

    assert config_reference.OUTPUT.read_text() == config_reference.render(), \
        f"docs/config.md differs from the schema in rl/config.py: run `{config_reference.COMMAND}`"


def test_the_config_reference_names_every_key_with_its_type_and_default():
    from rl import config_reference
    from rl.config import EnvEntry, RunConfig, Section

    text = config_reference.render()
    for section in ("rollout", "train", "gate"):
        for name, info in RunConfig.model_fields[section].annotation.model_fields.items():
            heading = isinstance(info.annotation, type) and issubclass(info.annotation, Section)
            assert (f"## {section}.{name}\n" if heading else f"- `{section}.{name}`: ") in text, f"{section}.{name}"
    for name in EnvEntry.model_fields:
        assert f"- `envs[].{name}`: " in text
    assert "- `rollout.max_staleness`: int, >= 0, <= 1,000; default `0`\\\n  asynchronous training:" in text
    assert "- `rollout.adaptive.high`: float, > 0, < 1; default `0.9`\\\n  see `rollout.adaptive.low`" in text
    assert "- `sandbox_backend`: one of `auto`, `docker`, `process`; default `\"auto\"`" in text


def test_the_config_reference_reads_comments_above_and_beside_a_field():
    from pydantic import Field

    from rl.config import Section
    from rl.config_reference import _field_texts

    class Example(Section):
        # explained above,
        # over two lines
        first: int = Field(default=1, ge=0)  # and beside
        second: int = 2  # its own
        # the run of fields below: third and fourth
        third: int = 3
        fourth: int = 4

        fifth: int = 5

    texts = _field_texts(Example)
    assert texts == {"first": "explained above, over two lines and beside", "second": "its own",
                     "third": "the run of fields below: third and fourth", "fourth": "see `third`", "fifth": ""}


def test_the_benchmark_harness_lists_and_runs_benchmarks():
    listed = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    scripts = [p.stem for p in (REPO / "benchmarks").glob("*.py")
               if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M) and p.stem != "__main__"]
    rows = {line.split()[0]: line.split(None, 1)[1] for line in listed.stdout.splitlines()[2:] if line.strip()}
    assert sorted(rows) == sorted(scripts)
    assert all(len(text) > 20 for text in rows.values()), rows
    assert "bench_common" not in rows  # a helper, not a benchmark
    run = subprocess.run([sys.executable, "-m", "benchmarks", "domain_metrics", "--domains", "20", "--groups", "2",
                          "--steps", "2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "20 domains, 2 groups of 8 a step, 2 steps" in run.stdout
    wrong = subprocess.run([sys.executable, "-m", "benchmarks", "rollout_gpus"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "rollout_decode_gpu" in wrong.stderr


def test_every_benchmark_the_repository_names_exists():
    """A script renamed or removed leaves no reference behind: prose, commands, imports."""
    sources = [REPO / "README.md", REPO / "Makefile", *DOCS.glob("*.md"), *(REPO / "benchmarks").rglob("*.md"),
               *(REPO / "benchmarks").rglob("*.py"), *(REPO / "benchmarks").rglob("*.sh")]
    for package in ("rl", "envs", "policy", "sandbox", "kimi_kernels", "tests", "configs", "deploy"):
        sources += [p for p in (REPO / package).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh")]
    missing = []
    for path in sources:
        text = path.read_text(errors="replace")
        names = re.findall(r"benchmarks/(\w+)\.py", text) + re.findall(r"python3? -m benchmarks (\w+)", text)
        names += re.findall(r"\bfrom benchmarks\.(\w+) import", text)
        missing += [f"{path.relative_to(REPO)}: {name}" for name in names
                    if not name.isupper() and not (REPO / "benchmarks" / f"{name}.py").is_file()]  # NAME: a placeholder
    assert not missing, "\n".join(sorted(set(missing)))
