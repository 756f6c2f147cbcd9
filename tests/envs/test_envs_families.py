"""Domain families: the built-in classes' domains, a user's data files as a family (JSONL, Parquet, a
folder of files), patterns and shares in a run config, and the one-line errors of each."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import yaml

import envs
from envs.families import PatternError, Weighted, expand, family_of, match
from envs.quality import check_env
from envs.registry import MEMBER_NAME, EnvRegistryError, check_names, family_domains, resolve
from rl.config import ConfigError, load_config


def _rows(subsets: dict[str, int]) -> list[dict]:
    return [{"subset": name, "question": f"Say {name} {i}.", "answer": f"{name}{i}"}
            for name, n in subsets.items() for i in range(n)]


@pytest.fixture
def qa_jsonl(tmp_path) -> Path:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows({"capitals": 20, "rivers": 12})))
    return path


def test_builtin_families_split_into_their_natural_domains():
    sizes = {name: len(family_domains(name)) for name in ("math", "lookup", "code", "shell")}
    assert sizes["math"] >= 40 and sizes["lookup"] >= 60 and sizes["code"] >= 13 and sizes["shell"] >= 20
    assert sum(sizes.values()) >= 145
    for name in sizes:
        assert all(MEMBER_NAME.fullmatch(m) for m in family_domains(name))
    assert family_domains("math-word") == {}  # a preset of one kind is not a second family
    assert {"toy-add", "generated-clip", "humaneval"} <= set(family_domains("code"))
    assert {"create_file-notes", "fix_test-scale", "sqlite-item"} <= set(family_domains("shell"))


def test_a_domain_builds_its_members_tasks_and_reports_itself():
    env = envs.make("math:mul-9x2", n_train=30)
    assert env.domain == "math:mul-9x2" and family_of(env.domain) == "math"
    assert all(" x " in q for q in env.dataset("train")["question"])
    shell = resolve("shell:fix_test-offset").make()
    assert {t["variant"] for t in shell.dataset("train")} == {"offset"}
    code = resolve("code:generated-clip").make()
    assert all(t["entry_point"].startswith("clip_") for t in code.dataset("train"))
    lookup = resolve("lookup:keys-3").make()
    assert lookup.seed == 3 and lookup.kind == "keys" and envs.make("lookup").domain == "tool_use"


def test_an_entry_may_not_contradict_what_makes_its_domain():
    with pytest.raises(EnvRegistryError, match=r"is kind='arithmetic'; its entry's kwargs say kind='word'"):
        resolve("math:add-9x2", {"kind": "word"})
    with pytest.raises(EnvRegistryError, match=r"has no domain 'add-9x9'; did you mean math:add-9x3\?"):
        resolve("math:add-9x9")
    check_names(["math:add-9x2", "lookup"])  # the member is checked with the entry's kwargs
    with pytest.raises(EnvRegistryError, match="unknown family 'mth' in envs\\[0\\]; did you mean 'math'"):
        check_names(["mth:add-9x2"])


def test_a_jsonl_file_is_a_family_of_its_subsets(qa_jsonl):
    kwargs = {"data_files": str(qa_jsonl)}
    assert match("dataset:*", kwargs) == ["dataset:capitals", "dataset:rivers"]
    env = resolve("dataset:rivers", kwargs).make()
    tasks = list(env.dataset("train")) + list(env.dataset("heldout"))
    assert len(tasks) == 12 and all(t["question"].startswith("Say rivers") for t in tasks)
    assert len(env.dataset("heldout")) >= 1  # split by a hash of task_id
    report = check_env("dataset:capitals", kwargs, max_tasks=2, record=False)
    assert report["ok"], report["reasons"]


def test_a_parquet_file_keeps_its_split_column_and_a_folder_has_a_domain_per_file(tmp_path):
    rows = [{**r, "split": "test" if r["question"].endswith(("0.", "1.")) else "train"}
            for r in _rows({"a": 10, "b": 10})]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "qa.parquet"))
    env = resolve("dataset:b", {"data_files": str(tmp_path / "qa.parquet")}).make()
    assert sorted(env.dataset("heldout")["question"]) == ["Say b 0.", "Say b 1."]
    folder = tmp_path / "folder"
    folder.mkdir()
    for name in ("algebra", "geometry"):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n"
                                                      for i in range(10)))
    assert match("dataset:*", {"data_files": str(folder)}) == ["dataset:algebra", "dataset:geometry"]
    geometry = resolve("dataset:geometry", {"data_files": str(folder)}).make()
    assert len(geometry.dataset("train")) + len(geometry.dataset("heldout")) == 10


def test_dataset_errors_are_one_line(tmp_path, qa_jsonl):
    with pytest.raises(FileNotFoundError, match="data_files not found"):
        envs.make("dataset", data_files=str(tmp_path / "nope.jsonl"))
    env = resolve("dataset:capitals", {"data_files": str(qa_jsonl), "answer_column": "gold"}).make()
    with pytest.raises(ValueError, match=r"has no column 'gold'"):
        env.dataset("train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"subset": "a b", "question": "q", "answer": "a"}) + "\n")
    with pytest.raises(EnvRegistryError, match=r"declares a domain named 'a b'"):
        match("dataset:*", {"data_files": str(bad)})


def test_patterns_expand_with_weights_shares_and_exact_overrides():
    entries = [Weighted("math:add-*", 1.0, share=6.0), Weighted("math:add-9x2", 5.0),
               Weighted("lookup:keys-1*", 0.5), Weighted("lookup", 1.0)]
    found = expand(entries)
    adds = [(d, w) for i, d, w in found if i == 0]
    assert "math:add-9x2" not in [d for d, _ in adds]  # named on its own: taken out of the pattern
    assert len(adds) == len(match("math:add-*")) - 1 and sum(w for _, w in adds) == pytest.approx(6.0)
    assert (1, "math:add-9x2", 5.0) in found and (3, "lookup", 1.0) in found
    assert {d for i, d, w in found if i == 2} == {f"lookup:keys-{s}" for s in [1] + list(range(10, 20))}
    with pytest.raises(PatternError, match="is matched by envs.0") as caught:
        expand([Weighted("math:*", 1.0), Weighted("math:add-*", 1.0)])
    assert caught.value.index == 1


def test_a_run_config_names_domains_by_pattern(tmp_path, qa_jsonl):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"envs": [
        {"name": "math:*", "share": 2.0},
        {"name": "dataset:*", "kwargs": {"data_files": str(qa_jsonl)}, "weight": 3.0},
        {"name": "lookup"}]}))
    cfg = load_config(config)
    names = [e.name for e in cfg.envs]
    assert len(names) == len(family_domains("math")) + 3 and len(set(names)) == len(names)
    assert sum(e.weight for e in cfg.envs if e.name.startswith("math:")) == pytest.approx(2.0)
    assert [e.weight for e in cfg.envs if e.name.startswith("dataset:")] == [3.0, 3.0]
    assert all(e.share is None for e in cfg.envs)
    for override, message in [
            ("envs.0.name=mth:*", "'envs.0.name': no family matches 'mth' in 'mth:*'; did you mean 'math'?"),
            ("envs.0.name=math:zz*", "'envs.0.name': no domain matches 'math:zz*'; 'math' has"),
            ("envs.2.share=1.0", "'envs.2': share splits a pattern's weight over its domains"),
            ("envs.0.weight=1.0", "'envs.0': give a pattern a weight (each of its domains) or a share")]:
        with pytest.raises(ConfigError) as caught:
            load_config(config, [override])
        assert message in str(caught.value) and "\n" not in str(caught.value)
