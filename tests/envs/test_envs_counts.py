"""Nonsense task counts are refused by the built-in environments' constructors, so the registry's check of a
run config's kwargs (before Ray) names the environment and the argument in one line."""
from __future__ import annotations

import pytest

from envs.domains import MAX_TASKS
from envs.registry import EnvRegistryError, check_kwargs

COUNTED = ["math", "math-word", "lookup", "lookup-docs", "multihop", "code", "code-generated", "humaneval",
           "shell", "shell-fix-test", "shell-sqlite"]


def refused(name: str, kwargs: dict) -> str:
    with pytest.raises(EnvRegistryError) as err:
        check_kwargs(name, kwargs)
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    return message


@pytest.mark.parametrize("name", COUNTED)
@pytest.mark.parametrize(("arg", "value"), [("n_train", -5), ("n_train", 0), ("n_train", 10**12),
                                            ("n_heldout", -1), ("n_heldout", 0), ("n_heldout", MAX_TASKS + 1)])
def test_nonsense_counts_are_refused_naming_the_environment_and_the_argument(name, arg, value):
    message = refused(name, {arg: value})
    assert message.startswith(f"environment {name!r} refuses these kwargs: ValueError: "), message
    assert f"{arg} must be between 1 and 1,000,000, got {value}" in message


@pytest.mark.parametrize("name", COUNTED)
def test_counts_at_the_bounds_are_accepted(name):
    check_kwargs(name, {"n_train": 1, "n_heldout": 1})
    check_kwargs(name, {"n_train": MAX_TASKS, "n_heldout": MAX_TASKS})  # tasks are built at first use, not here


def test_other_counts_of_the_builtins(tmp_path):
    assert "lookup: top_k must be at least 1, got 0" in refused("lookup", {"top_k": 0})
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    for fraction in (1.0, -0.5, 7.0):
        assert f"dataset: heldout_fraction must be in [0, 1), got {fraction}" in \
            refused("dataset", {"data_files": str(data), "heldout_fraction": fraction})
    for fraction in (0.0, 0.5):
        check_kwargs("dataset", {"data_files": str(data), "heldout_fraction": fraction})
