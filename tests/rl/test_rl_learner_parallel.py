"""The learner on several DeepSpeed ranks (LearnerGroup, gloo, ZeRO-0/1/2), packed or padded micro-batches,
against one rank on right-padded ones on the same batches: data parallel (every rank all experts) and expert
parallel (two ranks split the experts). A supervised step and a GRPO step must give the same losses,
gradient norms (clipping active), MoE statistics and weights afterwards; a checkpoint of the expert-parallel learner restores every rank's
experts and optimizer state, and its exported policy holds every expert."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rl.config import TrainConfig
from rl.types import RolloutBatch, Sample

SPEC = {"preset": "toy", "overrides": {"vocab_size": 320}, "init_from": None}
# a clip the first steps' gradients exceed, so the norm over every rank's parameters decides the step;
# AdamW's eps above the rounding noise of the gradients (its first step is lr * g / (|g| + eps))
TRAIN = dict(zero_stage=1, micro_batches=2, lr=1e-2, grad_clip=0.05, adam_eps=1e-4, weight_decay=0.1)


def sft_examples() -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(0)
    out = []
    for n in (18, 25, 12, 30, 21, 16):
        tokens = rng.integers(3, 320, n).tolist()
        out.append({"tokens": tokens, "loss_mask": [0] * 4 + [1] * (n - 4)})
    return out


def grpo_batch(step: int = 0) -> RolloutBatch:
    """4 groups x 4 samples of different lengths, rewards that differ within each group, routing
    recorded for part of the tokens (-1 elsewhere)."""
    rng = np.random.default_rng(1 + step)
    samples = []
    for g in range(4):
        prompt = rng.integers(3, 320, 6).tolist()
        for m in range(4):
            n = int(rng.integers(4, 14))
            tokens = prompt + rng.integers(3, 320, n).tolist()
            routing = rng.permuted(np.tile(np.arange(8), (len(tokens), 3, 1)), axis=-1)[..., :2].astype(np.int16)
            routing[-3:] = -1
            samples.append(Sample(
                uid=f"g{g}/{m}", group_uid=f"g{g}", env="lookup", domain="tool_use" if g % 2 else "math",
                task_id=str(g), effort="medium", tokens=tokens, loss_mask=[0] * 6 + [1] * n,
                behavior_logprobs=[0.0] * 6 + rng.uniform(-7, -4, n).tolist(), token_versions=[-1] * 6 + [step] * n,
                reward=float((m + g) % 3 == 0), routing=routing))
    return RolloutBatch(step=step, samples=samples)


def learner_group(world: int, ep: int, **train):
    from rl.learner import LearnerGroup

    cfg = TrainConfig(**{**TRAIN, **train, "expert_parallel": ep})
    return LearnerGroup(SPEC, cfg, 512, 1.0, 0, 0, [{"num_cpus": 0.25}] * world)


def steps(ray, group) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    sft = group.sft_step(sft_examples(), 1e-2).metrics
    grpo = group.train_step(ray.put(grpo_batch()))
    return sft, grpo, ray.get(group.get_weights())


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 2e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def one_rank(ray_session):
    group = learner_group(1, 1, packing=False)
    yield steps(ray_session, group)
    group.shutdown()


def test_the_first_steps_clip_by_the_global_norm(one_rank):
    sft, grpo, _ = one_rank
    assert sft["sft/grad_norm"] > TRAIN["grad_clip"] and grpo.metrics["train/grad_norm"] > TRAIN["grad_clip"]


# packed: micro-batches of at most 48 tokens, so that each rank runs several (rows are 10-30 tokens)
@pytest.mark.parametrize("world, ep, zero, packing", [(1, 1, 1, True), (2, 1, 1, True), (2, 1, 0, False),
                                                     (2, 2, 1, True), (2, 2, 2, False)],
                         ids=["one_rank_packed", "data_parallel_packed", "data_parallel_zero0_padded",
                              "expert_parallel_packed", "expert_parallel_zero2_padded"])
def test_ranks_and_packing_train_like_one_padded_rank(ray_session, one_rank, world, ep, zero, packing):
    ref_sft, ref_grpo, ref_weights = one_rank
    group = learner_group(world, ep, zero_stage=zero, packing=packing, max_tokens_per_micro_batch=48)
    try:
        sft, grpo, weights = steps(ray_session, group)
    finally:
        group.shutdown()
    for key in ("sft/loss", "sft/grad_norm", "sft/tokens"):
        assert sft[key] == pytest.approx(ref_sft[key], rel=1e-5), key
    m, ref = grpo.metrics, ref_grpo.metrics
    assert not packing or (m["train/padding_frac"] == 0 and m["train/micro_batches"] > 1)
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/tokens", "train/seq_tokens",
                "train/routing_agreement", "train/clipped", "train/ratio", "train/mismatch/domain/math",
                "train/mismatch/domain/tool_use", "moe/imbalance/layer1", "moe/imbalance/layer3"):
        assert m[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    for layer, load in ref_grpo.moe_load.items():
        assert grpo.moe_load[layer] == pytest.approx(load, abs=1e-7)
    assert_same_weights(weights, ref_weights)


def test_expert_parallel_checkpoint_restores_every_rank(ray_session, tmp_path):
    from policy import from_pretrained

    ray = ray_session
    group = learner_group(2, 2)
    restored = None
    try:
        group.sft_step(sft_examples(), 1e-2)
        group.save(str(tmp_path), "step_0", {"step": 0})
        saved = ray.get(group.get_weights())
        exported = from_pretrained(tmp_path / "step_0" / "hf").state_dict()
        assert_same_weights({k: v for k, v in exported.items() if k in saved}, saved, atol=0)
        assert exported["model.layers.1.block_sparse_moe.experts.w1"].shape[0] == 8  # every expert
        after = group.train_step(ray.put(grpo_batch())).metrics
        continued = ray.get(group.get_weights())

        restored = learner_group(2, 2)
        assert restored.load(str(tmp_path), "step_0")["step"] == 0
        assert_same_weights(ray.get(restored.get_weights()), saved, atol=0)
        again = restored.train_step(ray.put(grpo_batch())).metrics  # the optimizer state came back too
        assert again["train/loss"] == pytest.approx(after["train/loss"], rel=1e-6)
        assert_same_weights(ray.get(restored.get_weights()), continued, atol=1e-7)
    finally:
        group.shutdown()
        if restored is not None:
            restored.shutdown()


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_weight_sync_carries_every_ranks_experts_to_a_worker(ray_session, tmp_path, transport):
    """The rollout engine holds the whole model: rank 0 sends what the ranks gathered, bit for bit."""
    from policy import Tokenizer
    from rl.config import RolloutConfig
    from rl.rollout.worker import RolloutWorker
    from rl.shipping import ship_dir
    from rl.weight_sync import SyncSpec, open_weight_sync, sync_weights

    ray = ray_session
    Tokenizer.train(["the quick brown fox jumps over the lazy dog 0123456789"] * 20, vocab_size=320).save(str(tmp_path))
    group = learner_group(2, 2)
    worker = ray.remote(RolloutWorker).options(num_cpus=0.25).remote(SPEC, ship_dir(tmp_path), [], RolloutConfig(), 7)
    try:
        group.sft_step(sft_examples(), 1e-2)  # weights no rank was built with
        spec = open_weight_sync(group, [worker], SyncSpec(transport=transport, bucket_bytes=64 << 10, backend="gloo"))
        report = sync_weights(spec, group, [worker], version=3, full=True)
        assert report.full and report.buckets > 1
        held = ray.get(worker.__ray_call__.remote(lambda self: self.engine.model.state_dict()))
        learned = ray.get(group.get_weights())
        assert_same_weights({k: v for k, v in held.items() if k in learned}, learned, atol=0)
        assert ray.get(worker.__ray_call__.remote(lambda self: self.engine.version)) == 3
    finally:
        group.shutdown()
        ray.kill(worker)


def test_a_killed_rank_fails_the_step_at_once(ray_session):
    """A rank dies between steps: the next step raises its error within seconds (the group does not
    wait on the other ranks' collectives, whose timeout is half an hour)."""
    import time

    ray = ray_session
    group = learner_group(2, 2)
    try:
        ray.kill(group.actors[1], no_restart=True)
        started = time.monotonic()
        with pytest.raises(ray.exceptions.RayActorError):
            group.sft_step(sft_examples(), 1e-2)
        assert time.monotonic() - started < 30
    finally:
        group.kill()
