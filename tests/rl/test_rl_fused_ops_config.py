"""`train.fused_ops` / `rollout.fused_ops` switch the compiled elementwise chains off in the learner's or the
engines' process; the actors keep what torch.compile and Triton generate inside the checkout."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from kimi_kernels.fusion import set_fusion
from rl.cluster import REPO, actor_env
from rl.config import RolloutConfig, TrainConfig
from rl.learner import Learner
from rl.rollout.worker import build_engine
from tests.rl.test_rl_rollout_engine import TOY


@pytest.fixture
def fusion_restored() -> Iterator[None]:
    before = set_fusion(True)
    yield
    set_fusion(before)


def fusion_now() -> bool:
    now = set_fusion(True)
    set_fusion(now)
    return now


def test_fused_ops_are_on_by_default_and_the_configs_turn_them_off(fusion_restored):
    assert TrainConfig().fused_ops and RolloutConfig().fused_ops
    Learner(TOY, TrainConfig(), 512, 1.0, 0, 0)
    build_engine(TOY, RolloutConfig(), seed=0)
    assert fusion_now()
    Learner(TOY, TrainConfig(fused_ops=False), 512, 1.0, 0, 0)
    assert not fusion_now()
    set_fusion(True)
    build_engine(TOY, RolloutConfig(fused_ops=False), seed=0)
    assert not fusion_now()


def test_actors_keep_compile_caches_in_the_checkout_unless_told_otherwise(monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    env = actor_env()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(REPO / ".cache" / "torchinductor")
    assert env["TRITON_CACHE_DIR"] == str(REPO / ".cache" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    assert actor_env()["TRITON_CACHE_DIR"] == "/elsewhere"
