"""Packed rows: several sequences laid end to end in one row [1, T], their boundaries given as
`cu_seqlens` [N+1] (fla's and flash-attn's convention: cu_seqlens[0] = 0, cu_seqlens[N] = T,
sequence n holds positions cu_seqlens[n] .. cu_seqlens[n+1] - 1). The ops that mix tokens (KDA,
the short conv, attention) take it and never let one sequence see another; per-token ops need
nothing. This module holds the bookkeeping they share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Tensor = torch.Tensor

# a sequence re-padded beside longer ones takes at most this many slots per real token, or this
# many padding slots (fewer cost less than running another batch): one long sequence padded beside
# many short ones (a 4K episode among 32-token ones) would multiply the short ones' cost by the long
# one's length, and attention's by its square
PAD_SLACK = 1.25
PAD_ALLOWANCE = 16


def check_cu_seqlens(cu_seqlens: Tensor, batch: int, length: int, who: str) -> None:
    """cu_seqlens must describe a packed row [1, length]: start at 0, end at `length`, never decrease.
    A tensor is read once: every layer of a forward checks the same boundaries, and each host read of a
    CUDA tensor drains the GPU's queue (the launches after it then run exposed). The values are kept on
    the tensor with its version counter (host_boundaries), so an in-place change is read and checked again."""
    if batch != 1:
        raise ValueError(f"{who}: cu_seqlens packs sequences into one row: batch must be 1, got {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{who}: cu_seqlens must be an integer tensor [N+1] with N >= 1, "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    # one host read: the boundaries are built on the host by the learner's collator, and a wrong one
    # would silently mix sequences; the values are kept for the re-padding plans (host_boundaries)
    bounds = host_boundaries(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != length or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{who}: cu_seqlens must rise from 0 to the row's length {length}, got {bounds}")


def host_boundaries(cu_seqlens: Tensor) -> list[int]:
    """cu_seqlens' values on the host, read once per tensor (again after an in-place change): a read
    of a CUDA tensor drains the GPU's launch queue."""
    cached = getattr(cu_seqlens, "_host_values", None)
    if cached is None or cached[0] != cu_seqlens._version:
        cached = (cu_seqlens._version, [int(v) for v in cu_seqlens.tolist()])
        cu_seqlens._host_values = cached
    return cached[1]


def segment_ids(cu_seqlens: Tensor, length: int) -> Tensor:
    """[length] long: the sequence each position belongs to."""
    positions = torch.arange(length, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)


def segment_starts(cu_seqlens: Tensor, length: int) -> Tensor:
    """[length] bool: True at the first position of each sequence."""
    starts = torch.zeros(length + 1, dtype=torch.bool, device=cu_seqlens.device)
    # index_fill_ takes True as a kernel argument; `starts[i] = True` would copy it from the host's pageable
    # memory to the GPU, which drains the queue (the learner step's one synchronizing call, H100 profile)
    return starts.index_fill_(0, cu_seqlens[:-1].long(), True)[:length]


def positions_in_segment(cu_seqlens: Tensor, length: int) -> Tensor:
    """[length] long: each position's offset from the start of its sequence."""
    seg = segment_ids(cu_seqlens, length)
    return torch.arange(length, device=cu_seqlens.device) - cu_seqlens.long()[seg]


def repad_index(cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """(index [N, L], real [N, L] bool) on the host, L the longest sequence: index[n, i] is the packed
    position of token i of sequence n (0 where the sequence has ended), so packed[index] is the
    right-padded batch and real marks its tokens."""
    bounds = torch.tensor(host_boundaries(cu_seqlens), dtype=torch.long)
    lengths = bounds[1:] - bounds[:-1]
    offsets = torch.arange(max(int(lengths.max()), 1))
    real = offsets[None, :] < lengths[:, None]
    index = torch.where(real, bounds[:-1, None] + offsets[None, :], torch.zeros_like(offsets)[None, :])
    return index, real


def length_buckets(lengths: Sequence[int], slack: float = PAD_SLACK,
                   allowance: int = PAD_ALLOWANCE) -> list[list[int]]:
    """Sequences (by index into `lengths`) grouped so that, right-padded to its group's longest L, a
    sequence of length l takes at most `slack` * l slots or l + `allowance`. Longest first: sorted,
    each group takes the next sequences while they fit its first. Empty sequences are in no group."""
    if slack < 1:
        raise ValueError(f"length_buckets: slack must be >= 1, got {slack}")
    buckets: list[list[int]] = []
    for n in sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: -lengths[i]):
        longest = lengths[buckets[-1][0]] if buckets else 0
        if buckets and (longest <= slack * lengths[n] or longest - lengths[n] <= allowance):
            buckets[-1].append(n)
        else:
            buckets.append([n])
    return buckets


@dataclass(frozen=True)
class RepadBucket:
    """Rows of like lengths of a packed row, re-padded: index [N_b, L_b] (each row's packed positions),
    real [N_b, L_b] bool (the tokens a row owns: padding and a shared prefix's copies are not), and,
    for writing the owned outputs back without a host read, their packed positions `dest` [n] and
    their offsets `src` [n] in the bucket's flattened [N_b * L_b]."""

    index: Tensor
    real: Tensor
    dest: Tensor
    src: Tensor


def repad_buckets(index: Tensor, real: Tensor, cu_seqlens: Tensor) -> list[RepadBucket]:
    """repad_index's rows (index, real [N, L] on the host; row n holds sequence n of cu_seqlens from its
    start) cut into length_buckets, each moved to cu_seqlens' device. Everything is worked out on the
    host and copied in one go per bucket (pinned, without waiting, on CUDA), so a forward's layers
    reach the GPU with no read that would drain its queue."""
    bounds = host_boundaries(cu_seqlens)
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    index, real = index.cpu(), real.cpu()
    out = []
    for rows in length_buckets(lengths):
        pick = torch.tensor(rows)
        index_b, real_b = index[pick, :lengths[rows[0]]], real[pick, :lengths[rows[0]]]
        src = real_b.reshape(-1).nonzero().squeeze(1)
        out.append(RepadBucket(*(_to_device(t, cu_seqlens.device) for t in (index_b, real_b, index_b[real_b], src))))
    return out


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_padded(x: Tensor, index: Tensor) -> Tensor:
    """Packed x [1, T, ...] -> right-padded [N, L, ...] (padding holds copies of token 0: mask it)."""
    return x[0][index]


def to_packed(y: Tensor, bucket: RepadBucket, out: Tensor) -> Tensor:
    """A bucket's right-padded y [N_b, L_b, ...] -> `out` [T, ...] (unbatched: a packed row's positions)
    with the tokens the bucket owns in place, the rest of `out` as it was (out of place, for autograd)."""
    return out.index_copy(0, bucket.dest, y.flatten(0, 1)[bucket.src].to(out.dtype))
