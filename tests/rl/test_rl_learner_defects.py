"""Learner defects a numerics review found, each driven through the LearnerGroup a run uses: the KL
reference is the policy RL starts from (and survives a checkpoint), the proximal pre-pass adds nothing
to the MoE statistics, a rank without rows changes no normaliser, an update without a learning signal
takes no optimizer step."""
from __future__ import annotations

import sys

import pytest
import torch
from ray import cloudpickle

from rl.config import TrainConfig
from rl.types import RolloutBatch
from tests.rl.test_rl_learner_parallel import SPEC, assert_same_weights, grpo_batch, sft_examples

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # functions run inside the learner's actor
TRAIN = dict(lr=1e-2, adam_eps=1e-4)


def group_of(world: int = 1, **train):
    from rl.learner import LearnerGroup

    return LearnerGroup(SPEC, TrainConfig(**{**TRAIN, **train}), 512, 1.0, 0, 0, [{"num_cpus": 0.25}] * world)


def test_the_kl_reference_is_the_policy_rl_starts_from(ray_session, tmp_path):
    """After a warm-up the first GRPO step's KL is 0 (it read ~1 when the reference stayed the freshly
    built policy), and a resumed learner restores the reference instead of rebuilding it from the spec."""
    ray = ray_session
    group = group_of(kl_coef=0.1)
    restored = None
    try:
        for _ in range(3):
            group.sft_step(sft_examples(), 3e-2)
        stale = group.train_step(ray.put(grpo_batch(0))).metrics["train/kl"]
        assert stale > 1e-3  # the warm-up moved the policy away from the reference built with it
        group.set_reference()
        assert group.train_step(ray.put(grpo_batch(1))).metrics["train/kl"] == 0.0
        group.save(str(tmp_path), "step_1", {"step": 1})
        after = group.train_step(ray.put(grpo_batch(2))).metrics["train/kl"]
        assert after > 0
        restored = group_of(kl_coef=0.1)
        restored.load(str(tmp_path), "step_1")
        assert restored.train_step(ray.put(grpo_batch(2))).metrics["train/kl"] == pytest.approx(after, rel=1e-6)
    finally:
        group.shutdown()
        if restored is not None:
            restored.shutdown()


def _record_routed_tokens(learner) -> None:
    """Inside the learner's actor: note the tokens each optimizer step's MoE statistics counted."""
    module = learner.engine.module
    original, learner.routed = module.moe_statistics, []

    def recording():
        layer = next(layer.block_sparse_moe for layer in module.model.layers if layer.is_moe)
        learner.routed.append(float(layer.load.sum()) / layer.top_k)
        return original()

    module.moe_statistics = recording


def test_the_proximal_pre_pass_counts_in_no_statistic(ray_session):
    """Decoupled PPO over two updates recomputes the proximal logprobs of both mini-batches first: those
    forwards used to add to the expert load the first optimizer step balances by (722 tokens counted
    where 248 belong, in the review's run)."""
    ray = ray_session
    batch = grpo_batch(0)
    # each mini-batch's tokens whose experts were recorded (the last 3 of each sample were not)
    halves = [batch.samples[:8], batch.samples[8:]]
    expected = [float(sum(len(s.tokens) - 3 for s in half)) for half in halves]
    group = group_of(updates_per_step=2, off_policy={"proximal": "learner"})
    try:
        ray.get(group.actors[0].__ray_call__.remote(_record_routed_tokens))
        group.train_step(ray.put(batch))
        assert ray.get(group.actors[0].__ray_call__.remote(lambda learner: learner.routed)) == expected
    finally:
        group.shutdown()


def test_a_rank_without_rows_changes_no_normaliser(ray_session):
    """Two rows over three ranks (Dr.GRPO's seq_mean_token_sum): the rank without rows runs an inert
    micro-batch that used to count as a sequence, dividing the gradient by 3 sequences instead of 2."""
    ray = ray_session
    two = RolloutBatch(0, grpo_batch(0).samples[:2])
    assert two.samples[0].reward != two.samples[1].reward
    results = []
    for world in (1, 3):
        group = group_of(world, loss_agg="seq_mean_token_sum", grad_clip=1e9)
        try:
            metrics = group.train_step(ray.put(two)).metrics
            results.append((metrics, ray.get(group.get_weights())))
        finally:
            group.shutdown()
    (one, one_weights), (three, three_weights) = results
    assert three["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)
    assert three["train/loss"] == pytest.approx(one["train/loss"], rel=1e-5)
    assert_same_weights(three_weights, one_weights)


def test_an_update_without_a_learning_signal_takes_no_optimizer_step(ray_session):
    """The first mini-batch's groups all agree (advantages 0): AdamW's moments and weight decay would
    still move the weights, so that update is skipped and said in the metrics."""
    ray = ray_session
    batch = grpo_batch(0)
    for s in batch.samples[:8]:  # groups g0 and g1: the first of two mini-batches
        s.reward = 1.0
    group = group_of(updates_per_step=2, weight_decay=0.1)
    try:
        before = ray.get(group.get_weights())
        metrics = group.train_step(ray.put(batch)).metrics
        steps = ray.get(group.actors[0].__ray_call__.remote(lambda learner: learner.optimizer_steps))
        assert steps == 1 and metrics["train/skipped_updates"] == 1.0
        assert any(not torch.equal(before[k], v) for k, v in ray.get(group.get_weights()).items())
    finally:
        group.shutdown()
