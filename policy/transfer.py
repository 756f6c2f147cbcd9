"""Host-device copies that never make the host wait for the device's queue.

A plain copy between pageable host memory and a GPU waits for every kernel queued before it: a
serving loop that launches the next step before reading the last one's tokens would stall at each
such copy. Through pinned memory the copies are asynchronous and stream-ordered; on a CPU device
both are plain references."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (host) on `device`, queued behind the work already queued there."""
    if device.type != "cuda":
        return t.to(device)
    # the caching host allocator keeps the pinned copy until the transfer has read it
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host tensor that holds `t` once the device's queue has reached this point (the caller
    synchronises with an event recorded after it before reading)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
