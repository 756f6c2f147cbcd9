"""Bucketed weight sync (rl.weight_sync): the receiver reassembles the learner's state bit for bit,
deltas carry only what changed, and an update that does not fit the version held is refused.
Both transports (Ray object store, gloo broadcast) between a real Learner and real rollout workers."""
import pytest
import torch
from torch import nn

from rl.weight_sync import (ObjectStoreTransport, SyncSpec, WeightReceiver, WeightSender, WeightVersionError,
                            fingerprint, open_weight_sync, receive_state, sync_weights)


class Mixed(nn.Module):
    """Trainable fp32 and bf16 weights, a frozen weight, a tied weight, an int buffer and a
    non-persistent buffer (never synced)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(50, 7, generator=g))
        self.head = nn.Linear(7, 50, bias=False)
        self.head.weight = self.emb  # tied
        self.proj = nn.Parameter(torch.randn(13, 3, generator=g).to(torch.bfloat16))
        self.frozen = nn.Parameter(torch.randn(300, generator=g), requires_grad=False)
        self.register_buffer("counts", torch.randint(0, 1000, (5,), generator=g))
        self.register_buffer("flags", torch.rand(9, generator=g) > 0.5)
        self.register_buffer("scratch", torch.randn(4, generator=g), persistent=False)


def transfer(sender: WeightSender, src: nn.Module, dst: nn.Module, version: int, held: int, full: bool = False):
    manifest = sender.plan(src, version, full)
    receiver = WeightReceiver(dst)
    receiver.check(manifest, held)
    with torch.no_grad():
        for i, bucket in enumerate(sender.pack(src, manifest)):
            receiver.unpack(manifest, i, bucket.clone())
    return manifest


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_buckets_reassemble_exactly_and_deltas_skip_unchanged_frozen_tensors():
    src, dst = Mixed(0), Mixed(1)
    sender = WeightSender(bucket_bytes=256)  # emb (1400 B) and frozen (1200 B) are cut into pieces
    full = transfer(sender, src, dst, version=0, held=-1)
    assert full.base_version is None and max(full.bucket_sizes) <= 256
    assert len({e.bucket for e in full.entries if e.name == "emb"}) == 6
    every_byte = sum(t.numel() * t.element_size() for k, t in src.state_dict().items() if k != "head.weight")  # tied
    assert sum(e.nbytes for e in full.entries) == every_byte
    assert {e.name for e in full.entries} == {"emb", "proj", "frozen", "counts", "flags"}
    assert_same_state(src.state_dict(), dst.state_dict())
    assert not torch.equal(src.scratch, dst.scratch)  # non-persistent: not part of the weights

    with torch.no_grad():  # a training step moves trainable weights only
        src.emb.add_(0.5)
        src.proj.mul_(2)
    delta = transfer(sender, src, dst, version=1, held=0)
    assert delta.base_version == 0
    assert {e.name for e in delta.entries} == {"emb", "proj"}
    assert delta.nbytes < full.nbytes
    assert_same_state(src.state_dict(), dst.state_dict())

    src.counts[2] += 1  # a buffer changed: its fingerprint tells
    delta = transfer(sender, src, dst, version=2, held=1)
    assert {e.name for e in delta.entries} == {"emb", "proj", "counts"}
    assert_same_state(src.state_dict(), dst.state_dict())


def test_a_delta_is_refused_by_a_receiver_holding_another_version():
    src = Mixed(0)
    sender = WeightSender(bucket_bytes=1 << 20)
    sender.plan(src, version=3)
    delta = sender.plan(src, version=4)
    with pytest.raises(WeightVersionError, match="only carries what changed since version 3, but this worker "
                                                 "holds version 1; send a full sync"):
        WeightReceiver(Mixed(1)).check(delta, held_version=1)
    WeightReceiver(Mixed(1)).check(sender.plan(src, version=5, full=True), held_version=1)  # a full one is taken
    with pytest.raises(ValueError, match="'proj' is bfloat16 \\[13, 3\\] in the update, torch.float32 \\[13, 3\\]"):
        WeightReceiver(Mixed(1).float()).check(sender.plan(src, version=6, full=True), held_version=5)


def test_fingerprint_sees_a_swap_of_two_values():
    t = torch.arange(10, dtype=torch.float32)
    swapped = t.clone()
    swapped[[2, 7]] = swapped[[7, 2]]
    assert fingerprint(t) == fingerprint(t.clone()) != fingerprint(swapped)


def test_receive_state_gives_a_whole_sync_as_a_state_dict_of_views_into_the_object_store(ray_session):
    """What the vLLM and transformers engines take: every tensor synced, bit for bit; one held in one
    bucket is a view of the object store's copy; a tensor cut over buckets is put together."""
    src = Mixed(0)
    sender, transport = WeightSender(bucket_bytes=256), ObjectStoreTransport()
    full = sender.plan(src, version=3, full=True)
    state = receive_state(transport.send(full, sender.pack(src, full)))
    expected = {k: v for k, v in src.state_dict().items() if k != "head.weight"}  # the tie travels once
    assert_same_state(expected, state)
    bucket_of_proj = full.bucket_sizes[next(e.bucket for e in full.entries if e.name == "proj")]
    assert state["proj"].untyped_storage().nbytes() == bucket_of_proj  # a view, not a copy
    with torch.no_grad():
        src.proj.mul_(2)
    delta = sender.plan(src, version=4)
    with pytest.raises(WeightVersionError, match="needs a full sync"):
        receive_state(transport.send(delta, sender.pack(src, delta)))


# ---- through the actors: a real Learner (rank 0) and real rollout workers ---------------------------
SPEC = {"preset": "toy", "overrides": {"vocab_size": 320}, "init_from": None}


@pytest.fixture(scope="module")
def actors(ray_session, tmp_path_factory):
    from policy import Tokenizer
    from rl.config import RolloutConfig, TrainConfig
    from rl.learner import LearnerGroup
    from rl.rollout.worker import RolloutWorker
    from rl.shipping import ship_dir

    ray = ray_session
    tok_dir = tmp_path_factory.mktemp("tok")
    Tokenizer.train(["the quick brown fox jumps over the lazy dog 0123456789"] * 20, vocab_size=320).save(str(tok_dir))
    learner = LearnerGroup(SPEC, TrainConfig(), 512, 1.0, 0, 0, [{"num_cpus": 0.5}])
    workers = [ray.remote(RolloutWorker).options(num_cpus=0.25).remote(SPEC, ship_dir(tok_dir), [], RolloutConfig(), 7 + i)
               for i in range(2)]
    yield ray, learner, workers
    learner.shutdown()
    for actor in workers:
        ray.kill(actor)


def states(ray, learner, workers):
    learned = ray.get(learner.get_weights())
    held = ray.get([w.__ray_call__.remote(lambda self: self.engine.model.state_dict()) for w in workers])
    return learned, held


def sft_step(ray, learner):
    example = {"tokens": list(range(3, 40)), "loss_mask": [0] * 5 + [1] * 32}
    learner.sft_step([example], 1e-2)


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_sync_reassembles_the_learners_state_on_every_worker(actors, transport):
    ray, learner, workers = actors
    spec = open_weight_sync(learner, workers, SyncSpec(transport=transport, bucket_bytes=64 << 10, backend="gloo"))
    full = sync_weights(spec, learner, workers, version=10, full=True)
    assert full.full and full.buckets > 10
    learned, held = states(ray, learner, workers)
    for state in held:
        assert_same_state(learned, state)

    sft_step(ray, learner)
    delta = sync_weights(spec, learner, workers, version=11)
    assert not delta.full and delta.tensors > 0
    learned2, held = states(ray, learner, workers)
    assert any(not torch.equal(learned[k], learned2[k]) for k in learned)  # the step moved the weights
    for state in held:
        assert_same_state(learned2, state)
    assert ray.get([w.__ray_call__.remote(lambda self: self.engine.version) for w in workers]) == [11, 11]


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_worker_on_another_version_refuses_the_delta_and_the_rest_proceed(actors, transport):
    ray, learner, workers = actors
    spec = open_weight_sync(learner, workers, SyncSpec(transport=transport, bucket_bytes=64 << 10, backend="gloo"))
    sync_weights(spec, learner, workers, version=20, full=True)
    behind = workers[1]
    ray.get(behind.__ray_call__.remote(lambda self: setattr(self.engine, "version", 17)))
    sft_step(ray, learner)
    with pytest.raises(ray.exceptions.RayTaskError, match="holds version 17; send a full sync"):
        sync_weights(spec, learner, workers, version=21)
    # the other worker took it, the refusing one kept what it had; a full sync brings both level
    assert ray.get([w.__ray_call__.remote(lambda self: self.engine.version) for w in workers]) == [21, 17]
    sync_weights(spec, learner, workers, version=21, full=True)
    learned, held = states(ray, learner, workers)
    for state in held:
        assert_same_state(learned, state)
