"""Dataset: single-turn questions from a user's local files, read through Hugging Face `datasets`
(JSONL, JSON, Parquet, CSV, a `save_to_disk` folder), one domain per subset.

The subsets of `data_files` are its domains: the values of its `subset_column` (the rows of one
file, as a dataset's configs), or, for a folder of data files, one per file (named by its stem).
Rows need a question and an answer column; `task_id` and a `split` column (train / heldout or
test) are used when present, else tasks are split by a hash of their id. Graded on the final
answer: exact after normalising case and spaces, or by math equivalence (`match="math"`).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import datasets

from envs.base import Environment
from envs.data import load_tasks
from envs.domains.lookup import normalise
from envs.domains.mathcheck import equivalent, extract_answer
from envs.grades import Grade, Grader

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
MATCHES = ("exact", "math")
_HELDOUT = ("heldout", "test", "validation", "eval")


class DatasetGrader(Grader):
    version = "1"
    timeout_s = 10.0

    def __init__(self, match: str = "exact") -> None:
        self.match = match
        self.version = f"1-{match}"  # another comparison: another version (no cache mix-up)

    def score(self, payload: dict[str, Any]) -> Grade:
        pred = extract_answer(payload.get("response"))
        gold = str(payload["gold"])
        if self.match == "math":
            ok = equivalent(pred, gold)
        else:
            ok = pred is not None and normalise(pred) == normalise(gold)
        return Grade(reward=float(ok), passed=ok, grader_version="", details={"extracted": pred})


def _files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and "".join(p.suffixes[-1:]) in DATA_SUFFIXES)


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())


@functools.lru_cache(maxsize=64)
def _load(path: str, _stamp: tuple[int, int]) -> dict[str, list[Any]]:
    """One file (or saved dataset) read through `datasets`, as its columns (read once per process and
    version of the file, the stamp: its modification time and size; a run's domains share it)."""
    data = load_tasks(path)
    if isinstance(data, datasets.DatasetDict):  # a saved DatasetDict: its splits as rows with a split column
        parts = [ds.add_column("split", [name] * len(ds)) for name, ds in data.items()]
        data = datasets.concatenate_datasets(parts)
    return data.to_dict()  # whole columns at once: a Dataset's column is read a row at a time


def _length(columns: dict[str, list[Any]]) -> int:
    return len(next(iter(columns.values()), []))


def load(path: Path) -> dict[str, list[Any]]:
    stat = path.stat()
    return _load(str(path), (stat.st_mtime_ns, stat.st_size))


class DatasetEnv(Environment):
    """Questions and answers from local files. Knobs: data_files, subset (a domain), subset_column,
    question_column, answer_column, match ("exact" | "math"), system_prompt, heldout_fraction."""

    name = "dataset"
    domain = "dataset"
    max_turns = 1

    def __init__(self, data_files: str, subset: str | None = None, subset_column: str = "subset",
                 question_column: str = "question", answer_column: str = "answer", match: str = "exact",
                 system_prompt: str = "Answer the question. End with: The answer is <answer>.",
                 heldout_fraction: float = 0.2, **kwargs: Any) -> None:
        path = Path(os.path.expanduser(data_files))
        if not path.exists():
            raise FileNotFoundError(f"dataset: data_files not found: {data_files}")
        if match not in MATCHES:
            raise ValueError(f"dataset: unknown match {match!r}; expected one of {MATCHES}")
        if not 0 <= heldout_fraction < 1:  # checked at first use too (envs.data.split_by_id): here, before Ray
            raise ValueError(f"dataset: heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.path, self.subset, self.subset_column = path, subset, subset_column
        self.question_column, self.answer_column, self.match = question_column, answer_column, match
        self.system_prompt, self.heldout_fraction = system_prompt, heldout_fraction
        super().__init__(**kwargs)

    @classmethod
    def domains(cls, data_files: str | None = None, subset_column: str = "subset",
                **kwargs: Any) -> dict[str, dict[str, Any]]:
        """A folder of files: one domain per file; a file: one per value of its subset column (the file's
        stem when it has none). None before data_files is given."""
        if not data_files:
            return {}
        path = Path(os.path.expanduser(data_files))
        if path.is_dir() and not _is_saved_dataset(path):
            return {p.stem: {"subset": p.stem} for p in _files_of(path)}
        if not path.exists():
            raise FileNotFoundError(f"dataset: data_files not found: {data_files}")
        columns = load(path)
        if subset_column not in columns:
            return {path.stem.split(".")[0]: {"subset": None}}
        return {v: {"subset": v} for v in sorted({str(v) for v in columns[subset_column]})}

    def make_grader(self) -> Grader:
        return DatasetGrader(self.match)

    def build_tasks(self) -> Any:
        if self.path.is_dir() and not _is_saved_dataset(self.path):
            files = {p.stem: p for p in _files_of(self.path)}
            if self.subset not in files:
                raise ValueError(f"dataset: {self.path} has no file for subset {self.subset!r}; it has {sorted(files)}")
            columns = load(files[self.subset])
            rows = list(range(_length(columns)))
        else:
            columns = load(self.path)
            rows = list(range(_length(columns)))
            if self.subset is not None:
                if self.subset_column not in columns:
                    raise ValueError(f"dataset: {self.path} has no column {self.subset_column!r} to pick "
                                     f"subset {self.subset!r} from")
                rows = [i for i in rows if str(columns[self.subset_column][i]) == self.subset]
        for column in (self.question_column, self.answer_column):
            if column not in columns:
                raise ValueError(f"dataset: {self.path} has no column {column!r}; columns: {list(columns)}")
        if not rows:
            raise ValueError(f"dataset: subset {self.subset!r} of {self.path} has no rows")
        if "task_id" in columns:
            ids = [str(columns["task_id"][i]) for i in rows]
        else:
            ids = [f"{self.subset or 'row'}-{k}" for k in range(len(rows))]
        tasks = [{"task_id": tid, "question": str(columns[self.question_column][i]),
                  "answer": str(columns[self.answer_column][i])} for tid, i in zip(ids, rows)]
        if "split" not in columns:
            return tasks  # split by a hash of task_id
        splits = [str(columns["split"][i]).lower() for i in rows]
        return {"train": [t for t, s in zip(tasks, splits) if s == "train"],
                "heldout": [t for t, s in zip(tasks, splits) if s in _HELDOUT]}

    def prompt(self, task: dict[str, Any]) -> str:
        return task["question"]

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        return [f"The answer is {task['answer']}."]

    def grade_payload(self, task: dict[str, Any], final_answer: str | None) -> dict[str, Any]:
        return {"response": final_answer, "gold": task["answer"]}

