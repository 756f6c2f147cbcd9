"""Methods vLLM mixes into its worker (`worker_extension_cls`), called by name through
`collective_rpc` from VLLMEngine. They run inside vLLM's engine process, so this module imports
nothing of ours.

Weights cross the process boundary as plain (name, dtype, shape, bytes) tuples: msgpack carries
bytes natively, while a tensor inside an untyped RPC argument arrives as an unresolved buffer
reference. The names are the checkpoint's (what the model's `load_weights` reads)."""
from __future__ import annotations

import warnings

import torch

PackedTensor = tuple[str, str, list[int], bytes]


def pack_tensors(weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[PackedTensor]:
    """Tensors -> RPC-safe tuples; floating tensors are cast to `dtype` (the engine's) first."""
    out = []
    for name, t in weights.items():
        t = t.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        out.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), raw.numpy().tobytes()))
    return out


def unpack_tensors(items: list[PackedTensor]) -> list[tuple[str, torch.Tensor]]:
    with warnings.catch_warnings():  # frombuffer warns that bytes are read-only; loaders copy them
        warnings.simplefilter("ignore", UserWarning)
        return [(name, torch.frombuffer(data, dtype=getattr(torch, dtype)).reshape(shape))
                for name, dtype, shape, data in items]


class WeightSyncExtension:
    """Mixed into vLLM's Worker: `self.model_runner` is the worker's."""

    def load_policy_weights(self, items: list[PackedTensor]) -> int:
        """Reload the given checkpoint-named tensors in place (vLLM's layerwise reload re-runs
        each layer's post-load processing). Returns how many tensors were loaded."""
        weights = unpack_tensors(items)
        self.model_runner.reload_weights(weights_iterator=weights)
        return len(weights)

    def worker_pid(self) -> int:
        import os

        return os.getpid()
