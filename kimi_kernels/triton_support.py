"""Whether this process runs our Triton kernels on a tensor, shared by the modules that have them.

Triton is optional (CPU-only installs lack it; then `triton` and `tl` are None and each op takes its
torch path). Its kernels run on CUDA tensors, or on any tensor under Triton's interpreter
(TRITON_INTERPRET=1), which is how CI tests them without a GPU."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

__all__ = ["runs_triton", "tl", "triton"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton reads it at import


def runs_triton(x: torch.Tensor) -> bool:
    """Triton importable and x where its kernels run (a CUDA tensor, or any under the interpreter)."""
    return triton is not None and (x.is_cuda or _INTERPRETED)
