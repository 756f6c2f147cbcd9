"""Make `import policy` resolve to the package, not to this tests/policy directory.

pytest (rootdir conftest, prepend import mode) puts tests/ on sys.path, where `policy` is a
namespace directory that shadows the editable install; the repo root must come first.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[2])
if sys.path[:1] != [ROOT]:
    sys.path.insert(0, ROOT)
mod = sys.modules.get("policy")
if mod is not None and getattr(mod, "__file__", None) is None:  # a namespace shadow got imported
    del sys.modules["policy"]

torch.set_num_threads(1)  # shared 2-core machine: tiny shapes, one thread
