"""The learner: the policy inside a DeepSpeed engine, trained with GRPO (and an optional supervised
warm-up). One `Learner` is one DeepSpeed rank in a Ray actor; rl.learner.group.LearnerGroup makes the
ranks, joins them in one process group and drives them as one learner. Every rank receives the
whole batch and trains on its share of each mini-batch (rl/learner/batches.py: packed micro-batches
balanced by tokens); losses are divided by normalisers of the whole mini-batch (rl/learner/loss.py).
With train.expert_parallel > 1 groups of ranks split each MoE layer's routed experts
(rl/learner/experts.py)."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch

from kimi_kernels.fusion import set_fusion
from policy.dtypes import device_precision, params_to
from rl.config import LevelShaping, TrainConfig
from rl.learner.batches import MicroBatch, Row, collate, plan_packed, plan_padded, rows_from_samples
from rl.learner.flops import active_parameters, flops_metrics, peak_flops, step_flops
from rl.learner.heap import keep_freed_memory
from rl.learner.loss import accumulate_policy_gradient, compute_advantages, global_sum, loss_normaliser, policy_forward
from rl.run_folder import CHECKPOINT_HF
from rl.shaping import shape_rewards
from rl.shipping import PackedFiles, ShippedDir, files_under, localize, pack_files, this_node
from rl.types import RolloutBatch, Sample

if TYPE_CHECKING:
    from rl.weight_sync import SyncSpec, SyncTicket


@dataclass
class StepResult:
    """What a learner step reports: metrics by name, and for a GRPO step each MoE layer's expert load
    (share of routed tokens per expert, averaged over the step's updates; None without MoE)."""

    metrics: dict[str, float]
    moe_load: dict[int, list[float]] | None = None
    # a GRPO step's reward per sample uid after effort shaping (rl/shaping.py), as trained on
    shaped_rewards: dict[str, float] | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Learner:
    def __init__(self, model_spec: dict[str, Any], train_cfg: TrainConfig, seq_norm_tokens: int,
                 temperature: float, pad_id: int, seed: int, rank: int = 0, world_size: int = 1,
                 shaping: Mapping[str, LevelShaping] | None = None) -> None:
        torch.set_num_threads(train_cfg.threads)
        if not train_cfg.fused_ops:
            set_fusion(False)  # this process's compiled elementwise chains (KIMI_FUSED_OPS=0 turns off all)
        self.model_spec = model_spec
        self.cfg = train_cfg
        self.seq_norm_tokens = seq_norm_tokens  # Dr.GRPO's constant length (loss_agg: seq_mean_token_sum)
        self.temperature = temperature
        self.pad_id = pad_id
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.shaping = dict(shaping or {})  # effort.shaping: length shaping per effort level

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

        self.notes: list[str] = []  # what the trainer says on the console once the learner is up
        if self.device.type == "cpu":
            self._without_unbuildable_comm_op()
            keep_freed_memory()  # each step's activations reuse the last step's memory (rl/learner/heap.py)
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo", verbose=False)
        torch.manual_seed(self.seed)  # the same initial weights on every rank
        spec = localize(self.model_spec)  # a transformers model or our checkpoint, on this node
        model = build_policy(spec)
        model.set_activation_checkpointing(self.cfg.activation_checkpointing)
        if self.world_size > 1 and hasattr(model, "set_data_parallel"):
            model.set_data_parallel(dist.group.WORLD)
        # packed rows need every layer to keep sequences apart (a transformers model with recurrent
        # layers cannot: it trains on padded rows, and the trainer says so)
        self.packing = self.cfg.packing and getattr(model, "packs_rows", True)
        if self.cfg.packing and not self.packing:
            self.notes.append(f"learner: {type(model).__name__} has layers that would carry state across packed "
                              f"sequences: its micro-batches are right-padded (train.micro_batches)")
        # the KL reference: a second copy, set to the policy RL starts from by set_reference()
        self.reference = build_policy(spec).requires_grad_(False).eval() if self.cfg.kl_coef > 0 else None
        # the KL reference runs as the policy does: a float32 reference beside a bf16 body would read
        # bf16's rounding as divergence
        note = set_cpu_matmul_dtype([model, self.reference], self.cfg.cpu_matmul_dtype, self.device)
        if note:
            self.notes.append(note)
        self.active_params = active_parameters(model)  # every expert counted, before any is sharded
        ep = self.cfg.expert_parallel
        expert_names = {name for name, _ in model.routed_expert_parameters()} if ep > 1 else set()
        # on a CPU torch's fused AdamW: one pass over each tensor, where its default loops op by op over
        # them (SmolLM2's 135M parameters on two cores: 0.08 vs 0.29 s a step)
        adamw = {"lr": self.cfg.lr, "betas": tuple(self.cfg.betas), "eps": self.cfg.adam_eps,
                 "weight_decay": self.cfg.weight_decay, "fused": True if self.device.type == "cpu" else None}
        optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in expert_names], **adamw)
        bf16 = device_precision(self.device) == torch.bfloat16
        ds_config = {
            # the number of micro-batches varies from update to update (packing by tokens): the learner
            # marks the accumulation boundary itself (_backward, _optimizer_step)
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
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
            from rl.learner.experts import ExpertShards, expert_parallel_groups, fold_into_global_norm

            ep_group, replica_group = expert_parallel_groups(ep)
            self.engine.module.shard_experts(ep_group)
            if self.reference is not None:  # the same slices as the policy: set_reference copies rank by rank
                self.reference.shard_experts(ep_group)
            self.experts = ExpertShards(self.engine.module.routed_expert_parameters(), adamw, ep_group, replica_group)
            fold_into_global_norm(self.optimizer, self.experts)
        if self.reference is not None:
            self.reference = params_to(self.reference.to(self.device), device_precision(self.device))
            self.set_reference()
        self.peak_flops = peak_flops(self.device)
        self.optimizer_steps = 0
        self.policy_version = 0  # GRPO batches trained on (the weights' version label)
        self._last_train_end: float | None = None

    def _without_unbuildable_comm_op(self) -> None:
        """DeepSpeed's shared-memory allreduce for CPU ranks is a C++ op built on first use: on a node
        that can neither load a built copy nor build one (a slim image without a compiler, a read-only
        cache), the ranks allreduce through gloo instead, and the trainer says so."""
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            return
        try:
            builder.load(verbose=False)
        except Exception as exc:  # noqa: BLE001 - a failed build raises anything from OSError to RuntimeError
            deepspeed.ops.__compatible_ops__[builder.NAME] = False
            reason = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            self.notes.append(f"learner rank {self.rank}: DeepSpeed's {builder.NAME} op cannot be loaded or built "
                              f"on its node ({reason[:160]}): its CPU allreduce goes through gloo")

    def startup_notes(self) -> list[str]:
        return self.notes

    def set_reference(self) -> None:
        """The KL term's reference becomes the policy as it is now: the trainer calls it when the
        warm-up ends, so the KL pulls toward the weights GRPO starts from (checkpoints keep it)."""
        if self.reference is not None:
            self.reference.load_state_dict(self.engine.module.state_dict())

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

    # -- micro-batches and optimizer steps --------------------------------------------------------
    def _micro_batches(self, rows: Sequence[Row]) -> list[MicroBatch]:
        """This rank's micro-batches of one mini-batch, on the device; as many on every rank."""
        if self.packing:
            plan = plan_packed([len(r.tokens) for r in rows], self.world_size, self.cfg.max_tokens_per_micro_batch)
        else:
            plan = plan_padded(len(rows), self.world_size, self.cfg.micro_batches)
        shape = None
        recorded = next((r.routing for r in rows if r.routing is not None), None)
        if recorded is not None:
            shape = tuple(recorded.shape[1:])
        return [collate([rows[i] for i in micro], self.pad_id, self.packing, shape).to(self.device)
                for micro in plan[self.rank]]

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        # Losses are already divided by normalisers of the whole mini-batch, so DeepSpeed must not
        # rescale them, and its average over ranks becomes the sum: times world_size. Gradients are
        # reduced over ranks in the backward of an update's last micro-batch.
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def _optimizer_step(self) -> float:
        """DeepSpeed's optimizer step (and the experts' beside it) after an update's micro-batches,
        then the model's post-step hooks. Returns the gradient norm before clipping."""
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

    def _padding_metrics(self, micro_batches: Sequence[MicroBatch], prefix: str) -> dict[str, float]:
        """Token slots the forwards ran over all ranks, and the share of them that was padding."""
        slots = global_sum(float(sum(mb.input_ids.numel() for mb in micro_batches)))
        real = global_sum(float(sum(int(mb.token_mask.sum()) for mb in micro_batches)))
        return {f"{prefix}/token_slots": slots, f"{prefix}/padding_frac": 1.0 - real / max(slots, 1.0),
                f"{prefix}/micro_batches": float(len(micro_batches))}

    # -- supervised warm-up ----------------------------------------------------------------------
    def sft_step(self, examples: list[dict[str, list[int]]], lr: float) -> StepResult:
        """One cross-entropy step on reference episodes (the policy's own tokens only); every rank
        gets the whole batch and trains on its share."""
        started = time.perf_counter()
        self._set_lr(lr)
        self.engine.train()
        rows = [Row(e["tokens"], e["loss_mask"]) for e in examples]
        total_tokens = float(max(sum(r.targets for r in rows), 1))
        micro_batches = self._micro_batches(rows)
        loss_total = 0.0
        for i, mb in enumerate(micro_batches):
            logp = policy_forward(self.engine, mb).token_logprobs
            loss = -(logp * mb.loss_mask).sum() / total_tokens
            self._backward(loss, last=i == len(micro_batches) - 1)
            loss_total += float(loss.detach())
        grad_norm = self._optimizer_step()
        self._set_lr(self.cfg.lr)
        # the step is done once the loss and norm are on the host: their reads wait for the device
        metrics = {"sft/loss": global_sum(loss_total), "sft/grad_norm": grad_norm, "sft/tokens": total_tokens,
                   **self._padding_metrics(micro_batches, "sft"), "sft/step_s": time.perf_counter() - started}
        return StepResult(metrics)

    # -- GRPO ------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch) -> StepResult:
        """One GRPO step on a batch of whole groups: `updates_per_step` optimizer steps, one per
        mini-batch of whole groups. Every rank gets the whole batch (advantages and normalisers
        need all of it) and trains on its share of every mini-batch."""
        started = time.monotonic()
        idle = None if self._last_train_end is None else started - self._last_train_end
        samples = batch.samples
        self.engine.train()
        metrics: dict[str, float] = {"train/groups": float(len({s.group_uid for s in samples}))}
        if idle is not None:
            metrics["time/learner_wait_s"] = idle
        metrics.update(staleness_metrics(samples, batch.step))
        # the verifier's rewards, shaped by length per effort level: the trainer's, never the environments'
        rewards, shaping = shape_rewards(samples, self.shaping)
        metrics.update(shaping)
        shaped = {s.uid: r for s, r in zip(samples, rewards)}
        adv = compute_advantages(rewards, [s.group_uid for s in samples], self.cfg.adv_std_norm,
                                 episode_keys=[s.episode for s in samples])
        rows = rows_from_samples(samples, adv)
        minis = [rows[part] for part in group_rows(samples, self.cfg.updates_per_step)]
        # an update whose advantages are all zero has no policy gradient (and, without KL, no
        # gradient at all): AdamW would still move the weights (momentum, weight decay), so none is taken
        learns = [self.cfg.kl_coef > 0 or any(r.advantage != 0 for r in mini) for mini in minis]
        if not any(learns):
            self.policy_version = batch.step + 1  # every step has its own version, trained or not
            self._last_train_end = time.monotonic()
            metrics.update({"train/tokens": 0.0, "train/skipped": 1.0, "train/skipped_updates": float(len(minis))})
            return StepResult(metrics, shaped_rewards=shaped)
        plans = [self._micro_batches(mini) if go else [] for mini, go in zip(minis, learns)]
        self._prepare_logprobs([mb for plan in plans for mb in plan])
        policy = _TemperatureScaled(self.engine, self.temperature)
        totals: dict[str, float] = {}
        moe_load: dict[int, list[float]] = {}
        agreements: list[float] = []
        all_tokens = float(sum(r.targets for mini, go in zip(minis, learns) if go for r in mini))
        updates = sum(learns)
        for mini, micro_batches in zip(minis, plans):
            if not micro_batches:
                continue
            stats = accumulate_policy_gradient(policy, micro_batches, self.cfg,
                                               loss_normaliser(mini, self.cfg, self.seq_norm_tokens), self._backward)
            module = self.engine.module
            moe = module.moe_statistics() if hasattr(module, "moe_statistics") else {"load": {}}
            stats["grad_norm"] = self._optimizer_step()
            for layer, load in moe["load"].items():
                moe_load[layer] = [a + b / updates for a, b in zip(moe_load.get(layer, [0.0] * len(load)), load)]
            if moe.get("routing_agreement") is not None:
                agreements.append(moe["routing_agreement"])
            merge_update_stats(totals, stats, sum(r.targets for r in mini) / max(all_tokens, 1.0), 1.0 / updates)
        metrics["train/advantage_abs"] = float(np.abs(adv).mean())
        metrics["train/skipped_updates"] = float(len(minis) - updates)
        for name, value in totals.items():
            metrics[f"train/{name}"] = value
        if agreements:
            metrics["train/routing_agreement"] = float(np.mean(agreements))
        for layer, load in moe_load.items():
            metrics[f"moe/imbalance/layer{layer}"] = max(load) * len(load) if load else 0.0
        self.policy_version = batch.step + 1
        self._last_train_end = time.monotonic()
        metrics["time/learner_step_s"] = self._last_train_end - started
        every = [mb for plan in plans for mb in plan]
        metrics.update(self._padding_metrics(every, "train"))
        # every real token forwarded on every rank, prompt included (not padding)
        seq_tokens = int(global_sum(float(sum(int(mb.token_mask.sum()) for mb in every))))
        extra = int(self.reference is not None) + int(self._needs_proximal())
        metrics["train/seq_tokens"] = float(seq_tokens)
        peak = None if self.peak_flops is None else self.peak_flops * self.world_size
        metrics.update(flops_metrics(step_flops(self.active_params, seq_tokens, extra),
                                     metrics["time/learner_step_s"], peak))
        return StepResult(metrics, moe_load or None, shaped)

    def _needs_proximal(self) -> bool:
        return self.cfg.off_policy.proximal == "learner" and self.cfg.updates_per_step > 1

    @torch.no_grad()
    def _prepare_logprobs(self, micro_batches: Sequence[MicroBatch]) -> None:
        """The logprobs every update of the step needs before the first one changes the weights: the
        KL reference's, and (decoupled PPO over several updates) the proximal policy's. These
        forwards run in eval mode: only training forwards add to the MoE and QK-Clip statistics."""
        if self.reference is not None:
            ref = _TemperatureScaled(self.reference, self.temperature)
            for mb in micro_batches:
                mb.ref_logprobs = policy_forward(ref, mb).token_logprobs
        if self._needs_proximal():
            self.engine.eval()
            try:
                policy = _TemperatureScaled(self.engine, self.temperature)
                for mb in micro_batches:
                    mb.prox_logprobs = policy_forward(policy, mb).token_logprobs
            finally:
                self.engine.train()

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, directory: str, tag: str, client_state: dict[str, Any],
             driver_node: str | None = None) -> PackedFiles | None:
        """Every rank: DeepSpeed's state (its ZeRO partition), this rank's experts when sharded, the KL
        reference (this rank's slices of it); rank 0 also exports the whole policy to `tag/hf`. Into
        `directory` itself on the driver's node (`driver_node`; None: every node sees it); a rank
        elsewhere writes them on its own disk and returns them packed, for the driver to unpack."""
        if driver_node is None or this_node() == driver_node:
            self._save(Path(directory), tag, client_state)
            return None
        staging = Path(tempfile.mkdtemp(prefix="rl-checkpoint-"))
        try:
            self._save(staging, tag, client_state)
            return pack_files(staging, files_under(staging))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _save(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        from policy import save_policy

        state = {**client_state, "optimizer_steps": self.optimizer_steps, "policy_version": self.policy_version}
        # no `latest` from DeepSpeed: the trainer writes it once the whole checkpoint (policy export,
        # tokenizer, scheduler state) is on disk, so a run killed mid-save resumes from the one before
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=state, save_latest=False)
        if self.experts is not None:
            torch.save(self.experts.state_dict(), self._rank_file(directory, tag, "experts"))
        if self.reference is not None and (self.rank == 0 or self.experts is not None):
            torch.save(self.reference.state_dict(), self._rank_file(directory, tag, "reference"))
        whole = self._full_state()
        if self.rank == 0:
            save_policy(self.engine.module, str(directory / tag / CHECKPOINT_HF), state=whole)

    def load(self, checkpoint: ShippedDir) -> dict[str, Any]:
        """Restore every rank from a checkpoint folder (`.../step_N`) of the driver's node."""
        tag_dir = checkpoint.local()
        directory, tag = str(tag_dir.parent), tag_dir.name
        _, client_state = self.engine.load_checkpoint(directory, tag=tag)
        if self.experts is not None:  # DeepSpeed's module file is rank 0's: its experts are rank 0's slice
            self.experts.load_state_dict(torch.load(self._rank_file(directory, tag, "experts"), weights_only=False))
        if self.reference is not None:
            path = self._rank_file(directory, tag, "reference", self.rank if self.experts is not None else 0)
            if not path.exists():
                raise RuntimeError(f"{Path(directory) / tag} holds no KL reference ({path.name}): it was saved "
                                   f"with train.kl_coef 0; resume it with train.kl_coef=0")
            self.reference.load_state_dict(torch.load(path, weights_only=True, map_location=self.device))
        self.optimizer_steps = int(client_state["optimizer_steps"])
        self.policy_version = int(client_state["policy_version"])
        return client_state

    def _rank_file(self, directory: str, tag: str, what: str, rank: int | None = None) -> Path:
        return Path(directory) / tag / f"{what}_rank{self.rank if rank is None else rank:03d}.pt"

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def set_cpu_matmul_dtype(models: Sequence[torch.nn.Module | None], dtype: str, device: torch.device) -> str | None:
    """train.cpu_matmul_dtype onto a CPU learner's policy and its KL reference (None: no reference); a note
    for the console where the policy has no such path (our hybrid model, whose CPU runs are the toy's)
    and trains in float32."""
    models = [m for m in models if m is not None]
    if dtype == "float32" or device.type != "cpu":
        return None
    if not hasattr(models[0], "set_body_dtype"):
        return (f"learner: train.cpu_matmul_dtype={dtype} applies to Hugging Face policies; "
                f"{type(models[0]).__name__} trains in float32")
    for m in models:
        m.set_body_dtype(getattr(torch, dtype))
    return None


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
    """How many policy versions behind the trained weights each sample's oldest token is. A sample
    with no generated token was sampled by no weights: it has no staleness and is left out."""
    lags = np.array([step - s.weight_version for s in samples if s.weight_version >= 0])
    if not len(lags):
        return {}
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
