"""The learner: the policy inside a DeepSpeed engine, trained with GRPO (and an optional supervised
warm-up). One `Learner` is one DeepSpeed rank in a Ray actor; rl.learner_group.LearnerGroup makes the
ranks, joins them in one process group and drives them as one learner. With several ranks each
trains on its share of every batch (data parallel; losses are divided by the counts over all ranks),
and with train.expert_parallel > 1 groups of ranks split each MoE layer's routed experts
(rl/expert_shards.py)."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kimi_kernels.fusion import set_fusion
from policy.dtypes import device_precision, params_to
from rl.config import TrainConfig
from rl.grpo import (LossConfig, TrainBatch, accumulate_policy_gradient, collate, compute_advantages, global_sum,
                     inert_row, policy_forward, split_rows)
from rl.learner_flops import active_parameters, flops_metrics, peak_flops, step_flops
from rl.types import RolloutBatch, Sample

if TYPE_CHECKING:
    from rl.weight_sync import SyncSpec, SyncTicket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def sft_batch(examples: list[dict[str, list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T] right-padded, loss mask [B, T] float, real-token mask [B, T] bool)."""
    longest = max(len(e["tokens"]) for e in examples)
    ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), longest)
    real = torch.zeros(len(examples), longest, dtype=torch.bool)
    for i, e in enumerate(examples):
        ids[i, : len(e["tokens"])] = torch.tensor(e["tokens"])
        mask[i, : len(e["tokens"])] = torch.tensor(e["loss_mask"], dtype=torch.float32)
        real[i, : len(e["tokens"])] = True
    mask[:, 0] = 0
    return ids, mask, real


class Learner:
    def __init__(self, model_spec: dict[str, Any], train_cfg: TrainConfig, loss_cfg: LossConfig,
                 temperature: float, pad_id: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        torch.set_num_threads(train_cfg.threads)
        if not train_cfg.fused_ops:
            set_fusion(False)  # this process's compiled elementwise chains (KIMI_FUSED_OPS=0 turns off all)
        self.model_spec = model_spec
        self.cfg = train_cfg
        self.loss_cfg = loss_cfg
        self.temperature = temperature
        self.pad_id = pad_id
        self.seed = seed
        self.rank, self.world_size = rank, world_size

    def rendezvous(self) -> tuple[str, int]:
        """Where the ranks' process group meets (asked of rank 0 before any rank starts)."""
        import ray

        return (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"), free_port()

    def start(self, master_addr: str, master_port: int) -> None:
        """Join the process group, build the policy and its DeepSpeed engine (every rank at once)."""
        # inside an actor CUDA_VISIBLE_DEVICES shows only this rank's GPU: its local rank is 0
        os.environ.update({"RANK": str(self.rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(self.world_size),
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        from rl.placement import actor_device

        self.device = actor_device()  # cuda:0 when Ray gave this actor a GPU
        # DeepSpeed reads its accelerator when first imported: CUDA (NCCL) on a GPU, else CPU (gloo)
        os.environ["DS_ACCELERATOR"] = "cuda" if self.device.type == "cuda" else "cpu"
        import deepspeed
        import torch.distributed as dist
        from policy import build_policy

        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo", verbose=False)
        torch.manual_seed(self.seed)  # the same initial weights on every rank
        model = build_policy(self.model_spec)
        model.set_activation_checkpointing(self.cfg.activation_checkpointing)
        if self.world_size > 1 and hasattr(model, "set_data_parallel"):
            model.set_data_parallel(dist.group.WORLD)
        self.reference = None
        if self.loss_cfg.kl_coef > 0:
            self.reference = build_policy(self.model_spec)
            self.reference.load_state_dict(model.state_dict())
            self.reference.requires_grad_(False).eval()
        self.active_params = active_parameters(model)  # every expert counted, before any is sharded
        ep = self.cfg.expert_parallel
        expert_names = {name for name, _ in model.routed_expert_parameters()} if ep > 1 else set()
        adamw = {"lr": self.cfg.lr, "betas": tuple(self.cfg.betas), "eps": self.cfg.adam_eps,
                 "weight_decay": self.cfg.weight_decay}
        optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in expert_names], **adamw)
        bf16 = device_precision(self.device) == torch.bfloat16
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": self.cfg.micro_batches,
            "gradient_clipping": self.cfg.grad_clip,
            "zero_optimization": {"stage": self.cfg.zero_stage},
            "bf16": {"enabled": bf16},  # on a GPU: bf16 weights, fp32 master weights in the optimizer
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        if bf16:  # DeepSpeed casts buffers too; statistics and the router's bias need float32
            params_to(self.engine.module, torch.bfloat16)
        self.experts = None
        if ep > 1:  # after DeepSpeed's initial broadcast, which would copy rank 0's slice to every rank
            from rl.expert_shards import ExpertShards, expert_parallel_groups, fold_into_global_norm

            ep_group, replica_group = expert_parallel_groups(ep)
            self.engine.module.shard_experts(ep_group)
            self.experts = ExpertShards(self.engine.module.routed_expert_parameters(), adamw, ep_group, replica_group)
            fold_into_global_norm(self.optimizer, self.experts)
        if self.reference is not None:
            self.reference = params_to(self.reference.to(self.device), device_precision(self.device))
        self.peak_flops = peak_flops(self.device)
        self.optimizer_steps = 0
        self.policy_version = 0  # GRPO batches trained on (the weights' version label)
        self._last_train_end: float | None = None

    # -- weights ---------------------------------------------------------------------------------
    def _full_state(self) -> dict[str, torch.Tensor] | None:
        """Every expert gathered onto rank 0 when they are sharded (a collective), else None: the
        module's own tensors are whole."""
        return self.engine.module.full_state_dict() if self.experts is not None else None

    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole state dict on rank 0 (every rank calls it; the others return None)."""
        state = self._full_state()
        if self.rank:
            return None
        return {k: v.detach().clone() for k, v in (state or self.engine.module.state_dict()).items()}

    # -- weight sync in buckets (rl.weight_sync) --------------------------------------------------
    def open_weight_sync(self, spec: "SyncSpec") -> "SyncSpec":
        """Rank 0 becomes rank 0 of the weight sync; returns the spec the workers join with."""
        from rl.weight_sync import WeightSource

        if getattr(self, "weight_source", None) is not None:
            self.weight_source.close()
        self.weight_source = WeightSource(spec, self.device)
        return self.weight_source.spec

    def push_weights(self, version: int, full: bool = False) -> "SyncTicket | None":
        """Rank 0 sends what changed since the last push (everything when `full`), labelled `version`;
        the other ranks only hand in their experts when those are sharded."""
        state = self._full_state()
        if self.rank:
            return None
        return self.weight_source.push(self.engine.module, version, full, state)

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.experts is not None:
            self.experts.set_lr(lr)

    def _micro_backward(self, loss: torch.Tensor) -> None:
        # Losses are already divided by counts over all ranks, so DeepSpeed must not rescale them for
        # accumulation, and its average over ranks becomes the sum: times world_size.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # counts the micro-step; the boundary step is _complete_accumulation's

    def _complete_accumulation(self, micro_steps_done: int) -> float:
        """Pad to the configured micro-batch count (a small batch may split into fewer), take
        DeepSpeed's optimizer step at the boundary (and the experts' beside it), then run the
        model's post-step hooks. Returns the gradient norm before clipping."""
        for _ in range(self.cfg.micro_batches - micro_steps_done):
            self._micro_backward(sum((p * 0).sum() for p in self.engine.module.parameters()))
        norm = None
        if self.cfg.zero_stage == 0:  # whole gradients in p.grad, reduced over ranks in the last backward
            grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
            norm = float(torch.stack(grads).norm()) if grads else None
        if self.experts is not None:
            self.experts.reduce_gradients()
        self.engine.step()
        if norm is None:  # ZeRO keeps partitioned gradients out of p.grad; ask the engine
            reported = self.engine.get_global_grad_norm()
            norm = float(reported) if reported is not None else float("nan")
        if self.experts is not None:
            self.experts.step(norm, self.cfg.grad_clip)
        self.engine.module.after_optimizer_step()
        self.optimizer_steps += 1
        return norm

    def _my_rows(self, n: int) -> tuple[slice | None, int]:
        """This rank's contiguous share of n rows (None when there are fewer rows than ranks and it
        gets none) and the micro-batch count every rank uses for them: the same on all, since each
        forward and backward of an expert-parallel model is a collective."""
        shares = split_rows(n, self.world_size)
        return (shares[self.rank] if self.rank < len(shares) else None), max(1, min(self.cfg.micro_batches,
                                                                                    n // self.world_size))

    def _share(self, batch: TrainBatch) -> tuple[TrainBatch, int]:
        """This rank's share of a GRPO mini-batch (one inert row if it gets none) and the micro-batch count."""
        rows, micro = self._my_rows(len(batch))
        return (batch.slice(rows) if rows is not None else inert_row(batch)), micro

    # -- supervised warm-up ----------------------------------------------------------------------
    def sft_step(self, examples: list[dict[str, list[int]]], lr: float) -> dict[str, float]:
        """One cross-entropy step on reference episodes (the policy's own tokens only); every rank
        gets the whole batch and trains on its share."""
        started = time.perf_counter()
        self._set_lr(lr)
        self.engine.train()
        ids, mask, real = sft_batch(examples, self.pad_id)
        total_tokens = max(float(mask.sum()), 1.0)
        rows, micro = self._my_rows(len(ids))
        if rows is not None:
            ids, mask, real = ids[rows], mask[rows], real[rows]
        else:  # inert: one real token, no target
            ids, mask, real = ids[:1, :1], torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)
        ids, mask, real = ids.to(self.device), mask.to(self.device), real.to(self.device)
        loss_total, done = 0.0, 0
        for rows in split_rows(len(ids), micro):
            logp = self.engine(ids[rows], return_token_logprobs=True, token_mask=real[rows]).token_logprobs
            loss = -(logp * mask[rows]).sum() / total_tokens
            self._micro_backward(loss)
            loss_total += float(loss.detach())
            done += 1
        grad_norm = self._complete_accumulation(done)
        self._set_lr(self.cfg.lr)
        # the step is done once the loss and norm are on the host: their reads wait for the device
        return {"sft/loss": global_sum(loss_total), "sft/grad_norm": grad_norm, "sft/tokens": total_tokens,
                "sft/step_s": time.perf_counter() - started}

    # -- GRPO ------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch) -> dict[str, Any]:
        """One GRPO step on a batch of whole groups; returns metrics and the MoE expert load. Every
        rank gets the whole batch: advantages and normalisers need all of it; each trains on its
        share of every mini-batch."""
        started = time.monotonic()
        idle = None if self._last_train_end is None else started - self._last_train_end
        samples = batch.samples
        self.engine.train()
        metrics: dict[str, float] = {"train/groups": float(len({s.group_uid for s in samples}))}
        if idle is not None:
            metrics["time/learner_wait_s"] = idle
        metrics.update(staleness_metrics(samples, batch.step))
        adv = compute_advantages([s.reward for s in samples], [s.group_uid for s in samples], self.cfg.adv_std_norm,
                                 episode_keys=[s.episode for s in samples])
        if not samples or not np.any(adv != 0):
            # Nothing to learn from: no optimizer step (AdamW's momentum would still move the
            # weights on a zero gradient); the version advances so every step has its own.
            self.policy_version = batch.step + 1
            self._last_train_end = time.monotonic()
            metrics.update({"train/tokens": 0.0, "train/skipped": 1.0})
            return {"metrics": metrics, "moe_load": None}
        full = collate(samples, adv, self.pad_id)
        policy = _TemperatureScaled(self.engine, self.temperature)
        # each update's mini-batch (whole groups), this rank's share of it
        shares = [self._share(full.slice(rows)) for rows in group_rows(samples, self.cfg.updates_per_step)]
        shares = [(part.to(self.device), micro) for part, micro in shares]
        with torch.no_grad():
            for part, micro in shares:
                if self.reference is not None:
                    ref = _TemperatureScaled(self.reference, self.temperature)
                    part.ref_logprobs = torch.cat([policy_forward(ref, part.slice(r)).token_logprobs
                                                   for r in split_rows(len(part), micro)])
                if self.loss_cfg.proximal == "learner" and self.cfg.updates_per_step > 1:
                    # decoupled PPO: the proximal policy is the one this step starts from
                    part.prox_logprobs = torch.cat([policy_forward(policy, part.slice(r)).token_logprobs
                                                    for r in split_rows(len(part), micro)])
        totals: dict[str, float] = {}
        moe_load: dict[int, list[float]] = {}
        agreements: list[float] = []
        all_tokens = global_sum(sum(float(part.loss_mask.sum()) for part, _ in shares))
        for part, micro in shares:
            done = {"n": 0}

            def backward(loss: torch.Tensor) -> None:
                self._micro_backward(loss)
                done["n"] += 1

            stats = accumulate_policy_gradient(policy, part, self.loss_cfg, micro, backward)
            module = self.engine.module
            moe = module.moe_statistics() if hasattr(module, "moe_statistics") else {"load": {}}
            stats["grad_norm"] = self._complete_accumulation(done["n"])
            for layer, load in moe["load"].items():
                moe_load[layer] = [a + b / self.cfg.updates_per_step for a, b in
                                   zip(moe_load.get(layer, [0.0] * len(load)), load)]
            if moe.get("routing_agreement") is not None:
                agreements.append(moe["routing_agreement"])
            merge_update_stats(totals, stats, stats["tokens"] / max(all_tokens, 1.0), 1.0 / len(shares))
        metrics["train/advantage_abs"] = float(np.abs(adv).mean())
        for name, value in totals.items():
            metrics[f"train/{name}"] = value
        if agreements:
            metrics["train/routing_agreement"] = float(np.mean(agreements))
        for layer, load in moe_load.items():
            metrics[f"moe/imbalance/layer{layer}"] = max(load) * len(load) if load else 0.0
        self.policy_version = batch.step + 1
        self._last_train_end = time.monotonic()
        metrics["time/learner_step_s"] = self._last_train_end - started
        # every real token forwarded on every rank, prompt included (not padding)
        seq_tokens = int(global_sum(float(sum(int(part.token_mask.sum()) for part, _ in shares))))
        extra = int(self.reference is not None) + int(shares[0][0].prox_logprobs is not None)
        metrics["train/seq_tokens"] = float(seq_tokens)
        peak = None if self.peak_flops is None else self.peak_flops * self.world_size
        metrics.update(flops_metrics(step_flops(self.active_params, seq_tokens, extra),
                                     metrics["time/learner_step_s"], peak))
        return {"metrics": metrics, "moe_load": moe_load or None}

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, directory: str, tag: str, client_state: dict[str, Any]) -> None:
        """Every rank: DeepSpeed's state (its ZeRO partition), this rank's experts when sharded;
        rank 0 also exports the whole policy to `tag/hf`."""
        from policy import save_policy

        state = {**client_state, "optimizer_steps": self.optimizer_steps, "policy_version": self.policy_version}
        # no `latest` from DeepSpeed: the trainer writes it once the whole checkpoint (policy export,
        # tokenizer, scheduler state) is on disk, so a run killed mid-save resumes from the one before
        self.engine.save_checkpoint(directory, tag=tag, client_state=state, save_latest=False)
        if self.experts is not None:
            torch.save(self.experts.state_dict(), self._experts_file(directory, tag))
        whole = self._full_state()
        if self.rank == 0:
            save_policy(self.engine.module, str(Path(directory) / tag / "hf"), state=whole)

    def load(self, directory: str, tag: str) -> dict[str, Any]:
        _, client_state = self.engine.load_checkpoint(directory, tag=tag)
        if self.experts is not None:  # DeepSpeed's module file is rank 0's: its experts are rank 0's slice
            self.experts.load_state_dict(torch.load(self._experts_file(directory, tag), weights_only=False))
        self.optimizer_steps = int(client_state["optimizer_steps"])
        self.policy_version = int(client_state["policy_version"])
        return client_state

    def _experts_file(self, directory: str, tag: str) -> Path:
        return Path(directory) / tag / f"experts_rank{self.rank:03d}.pt"

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def merge_update_stats(totals: dict[str, float], stats: dict[str, float], token_share: float,
                       update_share: float) -> None:
    """Combine one update's statistics into the step's: token means by token share, sums and
    counts added, extremes kept, the gradient norm averaged over updates."""
    for name, value in stats.items():
        if name.endswith("_min"):
            totals[name] = min(totals.get(name, value), value)
        elif name.endswith("_max"):
            totals[name] = max(totals.get(name, value), value)
        elif name in ("loss", "tokens"):
            totals[name] = totals.get(name, 0.0) + value
        elif name == "grad_norm":
            totals[name] = totals.get(name, 0.0) + update_share * value
        else:
            totals[name] = totals.get(name, 0.0) + token_share * value


def group_rows(samples: list[Sample], parts: int) -> list[slice]:
    """Row ranges for `parts` mini-batches that never split a group (samples come group by group)."""
    starts = [i for i, s in enumerate(samples) if i == 0 or s.group_uid != samples[i - 1].group_uid]
    cuts = [starts[j] for j in np.linspace(0, len(starts), min(parts, len(starts)) + 1).astype(int)[:-1]]
    return [slice(a, b) for a, b in zip(cuts, cuts[1:] + [len(samples)])]


def staleness_metrics(samples: list[Sample], step: int) -> dict[str, float]:
    """How many policy versions behind the trained weights each sample's oldest token is."""
    if not samples:
        return {}
    lags = np.array([step - s.weight_version for s in samples])
    out = {"async/staleness_mean": float(lags.mean()), "async/staleness_max": float(lags.max())}
    for lag in np.unique(lags):
        out[f"async/staleness/{int(lag)}"] = float((lags == lag).mean())
    return out


class _TemperatureScaled(torch.nn.Module):
    """Learner logprobs must be of the same processed distribution the sampler drew from."""

    def __init__(self, engine, temperature: float) -> None:
        super().__init__()
        self.engine = engine
        self.temperature = temperature

    def forward(self, input_ids, **kwargs):
        return self.engine(input_ids, logit_scale=1.0 / self.temperature, **kwargs)
