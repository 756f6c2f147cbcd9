"""Task data through the `datasets` library: build, load, and split into train / heldout."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import datasets

SPLITS = ("train", "heldout")
_HELDOUT_ALIASES = ("heldout", "test", "validation", "eval")


def from_rows(rows: Iterable[Mapping[str, Any]]) -> datasets.Dataset:
    """A Dataset from task dicts; every row needs a unique string `task_id`."""
    rows = list(rows)
    if not rows:
        raise ValueError("no tasks: the dataset is empty")
    ids = [r.get("task_id") for r in rows]
    if any(not isinstance(i, str) or not i for i in ids):
        raise ValueError("every task needs a non-empty string 'task_id'")
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"duplicate task_id {dup!r}")
    return datasets.Dataset.from_list([dict(r) for r in rows])


def load_tasks(source: str, split: str | None = None) -> datasets.Dataset | datasets.DatasetDict:
    """Load tasks from a local JSONL / JSON / parquet / arrow file, a save_to_disk folder, or a hub name.

    Hub names need network access; offline they fail with the datasets library's own error.
    """
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        return datasets.load_from_disk(str(path))
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    builders = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".parquet": "parquet", ".csv": "csv"}
    if path.exists() and suffix == ".arrow":
        return datasets.Dataset.from_file(str(path))
    if path.exists() and suffix in builders:
        return datasets.load_dataset(builders[suffix], data_files=str(path), split=split or "train")
    if path.exists():
        raise ValueError(f"unsupported task file type {path.suffix!r} for {source}; use .jsonl, .json, .parquet, .csv or .arrow")
    if source.startswith((".", "/", "~")) or suffix in builders or suffix == ".arrow":
        raise FileNotFoundError(f"task file not found: {source}")
    return datasets.load_dataset(source, split=split)  # a hub dataset name


def ensure_task_ids(ds: datasets.Dataset, prefix: str) -> datasets.Dataset:
    """Add `task_id` (prefix-rowindex) when a loaded dataset has none."""
    if "task_id" in ds.column_names:
        return ds
    return ds.add_column("task_id", [f"{prefix}-{i}" for i in range(len(ds))])


def split_by_id(ds: datasets.Dataset, heldout_fraction: float, salt: str = "") -> dict[str, datasets.Dataset]:
    """Deterministic train / heldout split by a hash of task_id (stable when rows are added)."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")

    def is_heldout(task_id: str) -> bool:
        h = int.from_bytes(hashlib.sha256((salt + task_id).encode()).digest()[:8], "big")
        return h / 2**64 < heldout_fraction

    flags = [is_heldout(t) for t in ds["task_id"]]
    train = [i for i, f in enumerate(flags) if not f]
    held = [i for i, f in enumerate(flags) if f]
    return {"train": ds.select(train), "heldout": ds.select(held)}


def normalise_splits(obj: Any, heldout_fraction: float, salt: str) -> dict[str, datasets.Dataset]:
    """Turn whatever an environment's `build_tasks` returned into {"train": ds, "heldout": ds}."""
    if isinstance(obj, (datasets.DatasetDict, dict)) and obj and all(
        isinstance(v, (datasets.Dataset, list)) for v in obj.values()
    ):
        parts = {k: (v if isinstance(v, datasets.Dataset) else from_rows(v)) for k, v in obj.items()}
        held_key = next((k for k in _HELDOUT_ALIASES if k in parts), None)
        if "train" in parts and held_key is not None:
            return {"train": parts["train"], "heldout": parts[held_key]}
        if len(parts) == 1:
            return split_by_id(next(iter(parts.values())), heldout_fraction, salt)
        raise ValueError(f"task splits {sorted(parts)} need a 'train' and one of {list(_HELDOUT_ALIASES)}")
    if isinstance(obj, datasets.Dataset):
        return split_by_id(obj, heldout_fraction, salt)
    if isinstance(obj, list):
        return split_by_id(from_rows(obj), heldout_fraction, salt)
    raise TypeError(f"build_tasks() returned {type(obj).__name__}; expected a list of dicts, Dataset or DatasetDict")
