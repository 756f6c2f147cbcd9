"""The routed experts an expert-parallel learner rank holds alone, trained beside DeepSpeed.

DeepSpeed's data parallelism averages every gradient it owns over all ranks; an expert's gradient
is already complete on the rank holding it (the token exchange brought every rank's rows there), and
the ranks of an expert-parallel group hold different experts, so averaging would mix them. DeepSpeed
reduces expert gradients correctly only for its own MoE module, so ours stay out of its optimizer:

- the learner builds DeepSpeed's optimizer over the replicated parameters only, then shards the
  experts (after DeepSpeed's initial broadcast, which would copy rank 0's slice everywhere);
- `ExpertShards` keeps float32 master copies of this rank's experts and an AdamW of the same settings;
  gradients are summed over the ranks holding the same experts (replicas, when there are more ranks
  than the expert-parallel size) and divided like DeepSpeed's, by the number of ranks;
- `fold_into_global_norm` adds the experts' squared norm, summed over the expert-parallel group, to
  the norm DeepSpeed's ZeRO optimizer clips by, so one coefficient clips every parameter, as on
  one rank.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def expert_parallel_groups(ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(this rank's expert-parallel group, its replica group or None) for `ep` consecutive ranks per
    group: ranks [k*ep, (k+1)*ep) split the experts; ranks with the same index mod ep hold the same
    ones. Every rank creates every group, in the same order (torch.distributed requires it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = replica = None
    for k in range(world // ep):
        group = dist.new_group(list(range(k * ep, (k + 1) * ep)))
        if k == rank // ep:
            mine = group
    if world > ep:
        for j in range(ep):
            group = dist.new_group(list(range(j, world, ep)))
            if j == rank % ep:
                replica = group
    return mine, replica


class ExpertShards:
    """This rank's routed experts: float32 masters, their optimizer, gradient reduction and clipping."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], optimizer: dict[str, Any],
                 ep_group: dist.ProcessGroup, replica_group: dist.ProcessGroup | None) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, **optimizer)
        self.ep_group, self.replica_group = ep_group, replica_group
        self.world = dist.get_world_size()

    def reduce_gradients(self) -> None:
        """After the last micro-batch's backward: sum over replicas, divide by the number of ranks
        (as DeepSpeed divides the replicated parameters' gradients; the loss is scaled to match)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.replica_group is not None:
                dist.all_reduce(p.grad, group=self.replica_group)
            p.grad.div_(self.world)

    def squared_norm(self) -> torch.Tensor:
        """Squared gradient norm of every expert of the job (summed over the expert-parallel group)."""
        total = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for p in self.params:
            total = total + p.grad.float().pow(2).sum()
        dist.all_reduce(total, group=self.ep_group)
        return total

    def step(self, global_norm: float, max_norm: float) -> None:
        """Clip by the job's global norm exactly as DeepSpeed's ZeRO optimizer does, step, write the
        masters back into the model's (possibly bfloat16) parameters and clear the gradients."""
        scale = 1.0 / max((global_norm + 1e-6) / max_norm, 1.0)
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float() * scale
            p.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"names": self.names, "masters": [m.detach().cpu() for m in self.masters],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["names"] != self.names:
            raise ValueError(f"expert shards: the checkpoint holds {state['names'][:3]}..., this rank "
                             f"{self.names[:3]}... (another model or expert-parallel size?)")
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                m.copy_(saved)
                p.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])


def fold_into_global_norm(zero_optimizer: Any, shards: ExpertShards) -> None:
    """Make DeepSpeed's ZeRO-1/2 optimizer clip by (and report) the norm over its parameters and
    every rank's experts: its `scaled_global_norm` (the norm times the loss scale, 1 in fp32 and bf16)
    gains the experts' term. DeepSpeed calls it once per optimizer step, on every rank, after the
    gradients are reduced, which is where `shards.reduce_gradients` must already have run."""
    dense_norm = zero_optimizer.scaled_global_norm

    def with_experts(norm_type: int = 2) -> torch.Tensor:
        dense = dense_norm(norm_type)
        experts = shards.squared_norm().to(dense.device) * float(zero_optimizer.loss_scale) ** 2
        return torch.sqrt(dense.float() ** 2 + experts)

    zero_optimizer.scaled_global_norm = with_experts
