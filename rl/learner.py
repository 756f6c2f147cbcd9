"""The learner: the policy inside a DeepSpeed engine, trained with GRPO (and an optional supervised
warm-up). Runs as a Ray actor; DeepSpeed's process-group variables are set before it is imported."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl.grpo import LossConfig, accumulate_policy_gradient, collate, compute_advantages
from rl.types import Sample


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_group() -> None:
    """DeepSpeed wants a torch.distributed group; outside a launcher we make a 1-rank gloo group."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def sft_batch(examples: list[dict[str, list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(e["tokens"]) for e in examples)
    ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), longest)
    for i, e in enumerate(examples):
        ids[i, : len(e["tokens"])] = torch.tensor(e["tokens"])
        mask[i, : len(e["tokens"])] = torch.tensor(e["loss_mask"], dtype=torch.float32)
    mask[:, 0] = 0
    return ids, mask


class Learner:
    def __init__(self, model_spec: dict[str, Any], train_cfg: dict[str, Any], loss_cfg: LossConfig,
                 temperature: float, pad_id: int, seed: int) -> None:
        torch.set_num_threads(train_cfg["threads"])
        init_single_process_group()
        import deepspeed
        from policy import build_model

        torch.manual_seed(seed)
        self.model_spec = model_spec
        model = build_model(model_spec["preset"], **model_spec["overrides"])
        if model_spec.get("init_from"):
            from policy import from_pretrained

            model.load_state_dict(from_pretrained(model_spec["init_from"]).state_dict())
        self.cfg = train_cfg
        self.loss_cfg = loss_cfg
        self.temperature = temperature
        self.pad_id = pad_id
        self.reference = None
        if loss_cfg.kl_coef > 0:
            self.reference = build_model(model_spec["preset"], **model_spec["overrides"])
            self.reference.load_state_dict(model.state_dict())
            self.reference.requires_grad_(False).eval()
        optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg["lr"], betas=tuple(train_cfg["betas"]),
                                      weight_decay=train_cfg["weight_decay"])
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": train_cfg["micro_batches"],
            "gradient_clipping": train_cfg["grad_clip"],
            "zero_optimization": {"stage": train_cfg["zero_stage"]},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.version = 0

    # -- weights ---------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _micro_backward(self, loss: torch.Tensor) -> None:
        # Losses are already divided by global counts, so DeepSpeed must not rescale them.
        self.engine.backward(loss, scale_wrt_gas=False)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # counts the micro-step; the boundary step is _complete_accumulation's

    def _complete_accumulation(self, micro_steps_done: int) -> float:
        """Pad to the configured micro-batch count (a small batch may split into fewer), take
        DeepSpeed's optimizer step at the boundary, then run the model's post-step hooks."""
        for _ in range(self.cfg["micro_batches"] - micro_steps_done):
            self._micro_backward(sum((p * 0).sum() for p in self.engine.module.parameters()))
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        norm = float(torch.stack(grads).norm()) if grads else None  # before clipping
        self.engine.step()
        if norm is None:  # ZeRO keeps partitioned gradients out of p.grad; ask the engine
            reported = self.engine.get_global_grad_norm()
            norm = float(reported) if reported is not None else float("nan")
        self.engine.module.after_optimizer_step()
        self.version += 1
        return norm

    # -- supervised warm-up ----------------------------------------------------------------------
    def sft_step(self, examples: list[dict[str, list[int]]], lr: float) -> dict[str, float]:
        """One cross-entropy step on reference episodes (the policy's own tokens only)."""
        self._set_lr(lr)
        self.engine.train()
        ids, mask = sft_batch(examples, self.pad_id)
        total_tokens = max(float(mask.sum()), 1.0)
        loss_total, done = 0.0, 0
        bounds = np.linspace(0, len(ids), min(self.cfg["micro_batches"], len(ids)) + 1).astype(int)
        for a, b in zip(bounds[:-1], bounds[1:]):
            logp = self.engine(ids[a:b], return_token_logprobs=True).token_logprobs
            loss = -(logp * mask[a:b]).sum() / total_tokens
            self._micro_backward(loss)
            loss_total += float(loss.detach())
            done += 1
        grad_norm = self._complete_accumulation(done)
        self._set_lr(self.cfg["lr"])
        return {"sft/loss": loss_total, "sft/grad_norm": grad_norm, "sft/tokens": total_tokens}

    # -- GRPO ------------------------------------------------------------------------------------
    def train_step(self, samples: list[Sample], std_norm: str, filter_uniform: bool) -> dict[str, float]:
        self.engine.train()
        keys = [s.group_uid for s in samples]
        adv = compute_advantages([s.reward for s in samples], keys, std_norm)
        metrics: dict[str, float] = {}
        if filter_uniform:
            # A group whose rewards all agree has zero advantages: it only dilutes the token mean.
            informative = {k for k, a in zip(keys, adv) if a != 0}
            keep = [i for i, k in enumerate(keys) if k in informative]
            metrics["train/groups_filtered"] = float(len(set(keys)) - len(informative))
            samples, adv = [samples[i] for i in keep], adv[keep]
        if not samples:
            # Nothing to learn from: no optimizer step (AdamW's momentum would still move the
            # weights on a zero gradient); the version advances so every step has its own.
            self.version += 1
            metrics.update({"train/tokens": 0.0, "train/skipped": 1.0})
            return metrics
        batch = collate(samples, adv, self.pad_id)
        policy = _TemperatureScaled(self.engine, self.temperature)
        if self.reference is not None:
            with torch.no_grad():
                ref = _TemperatureScaled(self.reference, self.temperature)
                out = ref(batch.input_ids, routing=batch.routing, return_token_logprobs=True)
                batch.ref_logprobs = out.token_logprobs
        done = {"n": 0}

        def backward(loss: torch.Tensor) -> None:
            self._micro_backward(loss)
            done["n"] += 1

        stats = accumulate_policy_gradient(policy, batch, self.loss_cfg, self.cfg["micro_batches"], backward)
        metrics["train/grad_norm"] = self._complete_accumulation(done["n"])
        metrics["train/advantage_abs"] = float(np.abs(adv).mean())
        for name, value in stats.items():
            metrics[f"train/{name}"] = value
        return metrics

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, directory: str, tag: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(directory, tag=tag, client_state={**client_state, "version": self.version})
        from policy import save_pretrained

        save_pretrained(self.engine.module, str(Path(directory) / tag / "hf"))

    def load(self, directory: str, tag: str) -> dict[str, Any]:
        _, client_state = self.engine.load_checkpoint(directory, tag=tag)
        self.version = int(client_state["version"])
        return client_state

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class _TemperatureScaled(torch.nn.Module):
    """Learner logprobs must be of the same processed distribution the sampler drew from."""

    def __init__(self, engine, temperature: float) -> None:
        super().__init__()
        self.engine = engine
        self.temperature = temperature

    def forward(self, input_ids, **kwargs):
        return self.engine(input_ids, logit_scale=1.0 / self.temperature, **kwargs)
