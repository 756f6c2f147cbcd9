"""What the Triton kernel tests share: the device they run on, and a run of a test file's kernel
tests under Triton's interpreter in a subprocess. The venv has no Triton (it breaks `import vllm`
on a CPU torch): `make test` installs one beside it (.cache/triton-interp) for these runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
INTERPRETER_SITE = REPO / ".cache" / "triton-interp"
ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
needs_interpreter_site = pytest.mark.skipif(not (INTERPRETER_SITE / ".installed").exists(),
                                            reason="no Triton beside the venv for the interpreter (make test installs it)")


def run_under_interpreter(test_file: str, selection: str) -> subprocess.CompletedProcess:
    """pytest on `test_file`'s tests matching `selection` (-k) with TRITON_INTERPRET=1 and the Triton
    beside the venv first on the path; its output captured."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(INTERPRETER_SITE), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", test_file, "-k", selection],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
