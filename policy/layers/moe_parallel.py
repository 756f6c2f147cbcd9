"""Expert parallelism: the routed experts split over the ranks of a process group.

Rank r of a group of size ep holds experts [r*E/ep, (r+1)*E/ep); router, shared experts and the
latent projections stay replicated. Each MoE layer then exchanges token rows twice:

    dispatch: every rank sends each of its (token, expert) rows to the rank holding the expert
    compute:  the holder runs its experts on the rows of all ranks, grouped by expert
    combine:  the outputs travel back the same way, to be weighted and summed where they came from

Both exchanges are all_to_all_single with variable splits (gloo on CPU supports it, NCCL on GPU);
the gradient of an exchange is the reverse exchange, so the backward mirrors the forward. Every
rank of the group must run the same layers in the same order: each one is a collective.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 whose backward sends the gradients back where the rows came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Send in_splits[j] rows of x (in order) to rank j; receive out_splits[j] rows from rank j."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def expert_parallel(compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], zs: torch.Tensor,
                    counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """zs: [M, dim] this rank's token rows sorted by expert, counts: [E] long, rows per expert (all
    E experts). `compute(rows, local_counts)` runs this rank's experts on rows sorted by local
    expert. Returns each row's expert output, [M, dim], in zs's order."""
    ep = dist.get_world_size(group)
    n_local = counts.numel() // ep
    # counts.view(ep, n_local)[j]: what this rank sends to rank j's experts; after the exchange,
    # recv_counts[s, e]: the rows rank s sends to this rank's expert e
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(ep, n_local)
    send = counts.view(ep, n_local).sum(1).tolist()  # split sizes are host ints: one sync per layer
    recv = recv_counts.sum(1).tolist()
    rows = all_to_all(zs, recv, send, group)  # source by source, each source's rows by expert
    block_expert = torch.arange(n_local, device=counts.device).repeat(ep)  # of each (source, expert) block
    expert = block_expert.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv))
    by_expert = torch.argsort(expert, stable=True)
    out = compute(rows[by_expert], recv_counts.sum(0))
    return all_to_all(out[torch.argsort(by_expert)], send, recv, group)  # argsort of a permutation: its inverse
