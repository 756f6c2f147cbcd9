"""Fused elementwise chains on CUDA through torch.compile.

The reference ops compute in float32 as a chain of small elementwise kernels (an RMSNorm is
five); at the policy's sizes a training step is dominated by launching and streaming them.
`fused_on_cuda(fn)` keeps `fn` as the CPU path and the oracle and, for CUDA inputs, calls a
`torch.compile`d copy of the same function (one generated kernel per chain, compiled once per
input rank, dynamic sizes). `set_fusion(False)` or KIMI_FUSED_OPS=0 turns it off.

A fused op compiles one entry per input rank, dtype and gradient mode (AttnRes's mix also one per
number of sources): `small`'s learner fills eight, dynamo's default limit per function, past which
further variants would run eagerly without a word; the limit is raised for them.

Inductor's kernels assume a tensor that was 16-byte aligned when compiled stays aligned; it checks
ordinary inputs at each call but not parameters (static inputs), and a parameter that is a view into
a flat buffer (DeepSpeed's bf16 groups) may start anywhere: such arguments are passed as aligned copies.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable, TypeVar

import torch

__all__ = ["aligned", "fused_on_cuda", "fusion_enabled", "runs_fused", "set_fusion"]

F = TypeVar("F", bound=Callable[..., Any])
_enabled = os.environ.get("KIMI_FUSED_OPS", "1") != "0"
_ALIGNMENT = 16  # bytes: what inductor's generated kernels assume of their inputs' start
_VARIANTS_LIMIT = 64  # compiled entries per fused op (K3's 93 layers give AttnRes ~10 source counts, x2 grad modes)
_DEVICE_TYPES = ("cuda",)  # where the compiled copies run (elsewhere the reference; tests add "cpu")
_BACKEND = "inductor"  # tests trace with "eager": dynamo's caching without code generation


def aligned(value: Any) -> Any:
    """`value`, or an aligned copy of it where it is a tensor starting off a 16-byte boundary
    (gradients flow through the copy)."""
    if isinstance(value, torch.Tensor) and value.data_ptr() % _ALIGNMENT:
        return value.clone()
    return value


def fusion_enabled() -> bool:
    """Whether fused CUDA paths are on (`set_fusion`, KIMI_FUSED_OPS); kernels of their own ask it too."""
    return _enabled


def runs_fused(x: torch.Tensor) -> bool:
    """Whether a fused op given `x` as its main tensor runs the compiled copy."""
    return _enabled and x.device.type in _DEVICE_TYPES


def set_fusion(enabled: bool) -> bool:
    """Turn the compiled CUDA versions on or off; returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(enabled)
    return prev


def fused_on_cuda(fn: F) -> F:
    # one compiled copy per backend: a test that traces the module's ops with another backend leaves
    # the copy for inductor (and any other test's) as it was
    compiled_by_backend: dict[Any, Callable[..., Any]] = {}

    @functools.wraps(fn)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        x = args[0]  # every fused op takes its main tensor first
        if not runs_fused(x) or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        backend = _BACKEND
        compiled = compiled_by_backend.get(backend)
        if compiled is None:
            dynamo_config = torch._dynamo.config
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _VARIANTS_LIMIT)
            # not fullgraph: past the recompile limit Dynamo then runs fn eagerly instead of raising
            compiled = compiled_by_backend[backend] = torch.compile(fn, dynamic=True, backend=backend)
        try:
            return compiled(*map(aligned, args), **{name: aligned(v) for name, v in kwargs.items()})
        except torch._dynamo.exc.BackendCompilerFailed as e:
            # a chain the compiler fails on (a torch or driver version it was never tried with) runs
            # eagerly from now on, said once, rather than ending the run; a try costs nothing on the
            # hot path (a dynamo config patch around each call cost ~85 us)
            warnings.warn(f"{fn.__qualname__}: compiling it failed, running it unfused "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})", stacklevel=2)
            compiled_by_backend[backend] = fn
            return fn(*args, **kwargs)

    return dispatch  # type: ignore[return-value]
