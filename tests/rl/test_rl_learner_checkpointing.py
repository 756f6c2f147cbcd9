"""train.activation_checkpointing reaches the learner's policy: its training forward keeps less for
backward, and a supervised step gives the same loss and gradient norm as without it."""
from __future__ import annotations

import torch


def _stored_bytes(learner) -> int:
    """Bytes a training forward of the learner's DeepSpeed engine keeps for backward outside
    checkpointed layers."""
    def measure(self) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        self.engine.train()
        ids = torch.arange(3, 43).view(2, 20)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.engine(ids, return_token_logprobs=True)
        return total

    return learner.__ray_call__.remote(measure)


def test_the_learner_recomputes_layers_and_steps_alike(ray_session):
    ray = ray_session
    from rl.config import TrainConfig
    from rl.learner import LearnerGroup

    spec = {"preset": "toy", "overrides": {"vocab_size": 320}, "init_from": None}
    groups = [LearnerGroup(spec, TrainConfig(activation_checkpointing=on), 512, 1.0, 0, 0,
                           [{"num_cpus": 0.5}]) for on in (False, True)]
    try:
        stored, recomputed = ray.get([_stored_bytes(group.actors[0]) for group in groups])
        assert recomputed < stored / 2, (recomputed, stored)
        example = {"tokens": list(range(3, 40)), "loss_mask": [0] * 5 + [1] * 32}
        plain, ckpt = [group.sft_step([example], 1e-2).metrics for group in groups]
        assert ckpt["sft/loss"] == plain["sft/loss"]
        assert abs(ckpt["sft/grad_norm"] - plain["sft/grad_norm"]) <= 1e-6 * plain["sft/grad_norm"]
    finally:
        for group in groups:
            group.shutdown()
