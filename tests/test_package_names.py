"""Our top-level packages own their import names. A package named like another installed
distribution's shadows it or is shadowed by it, depending on the working directory: `kernels` did
both once transformers 5.25 began to depend on Hugging Face's `kernels` (inside the checkout
transformers imported ours and failed; elsewhere ours lost its `__init__` to theirs)."""
from __future__ import annotations

import importlib
import importlib.metadata as md
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").is_file())


def _normal(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def test_no_other_installed_distribution_provides_one_of_our_packages():
    assert {"rl", "policy", "kimi_kernels", "sandbox", "envs"} <= set(OURS), OURS
    providers = md.packages_distributions()
    clashes = {name: others for name in OURS
               if (others := sorted({d for d in providers.get(name, []) if _normal(d) != "kimi-rl"}))}
    assert not clashes, f"installed distributions that provide our packages' import names: {clashes}"


def test_our_packages_import_from_this_checkout():
    for name in OURS:
        assert Path(importlib.import_module(name).__file__).resolve().parent == REPO / name, name


def test_transformers_imports_beside_our_packages():
    importlib.import_module("kimi_kernels")
    importlib.import_module("transformers.activations")  # imports Hugging Face's `kernels` where installed
