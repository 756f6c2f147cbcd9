"""A colocated run's rollout workers free their engines' caches before the learner steps (through
the Ray actors, as rl.trainer asks them) and play the next groups as if they never had."""
from __future__ import annotations

from dataclasses import replace

import torch

from rl.cluster import env_worker_name, model_spec, start_env_side
from rl.config import validate
from rl.shipping import ship_dir
from rl.trainer import release_rollout_caches
from rl.types import WorkItem

from tests_rl_config import TINY


def test_a_worker_frees_its_cache_between_groups_and_plays_the_same_tokens(ray_session, tmp_path):
    ray = ray_session
    from policy import Tokenizer, build_policy
    from rl.rollout.worker import RolloutWorker

    cfg = validate({**TINY, "envs": TINY["envs"][:1], "rollout": {
        **TINY["rollout"], "num_workers": 1, "max_slots": 4, "groups_per_worker": 2, "cache_tokens": 1024}})
    env_workers = start_env_side(cfg, "release-test")
    Tokenizer.train(["what is 3 + 4? the answer is 7."] * 20, vocab_size=320).save(str(tmp_path))
    spec = model_spec(cfg, 320)
    worker = ray.remote(RolloutWorker).options(num_cpus=0.25).remote(
        spec, ship_dir(tmp_path), [env_worker_name("release-test", 0)], cfg.rollout, 7)
    try:
        assert release_rollout_caches([worker]) == 0.0  # no engine built yet: nothing to free
        torch.manual_seed(0)
        ray.get(worker.set_weights.remote(build_policy(spec).state_dict(), 1))
        task = ray.get(env_workers[0].task_ids.remote("math", "train"))[0]
        item = WorkItem("g0", "math", task, "low", 2, seed=5, max_new_tokens=8, temperature=1.0, top_p=1.0)

        def cache_bytes() -> int:
            return ray.get(worker.__ray_call__.remote(lambda self: self.engine.cache.nbytes))

        before = [s.tokens for s in ray.get(worker.run_group.remote(item))]
        held = cache_bytes()
        assert release_rollout_caches([worker]) == held / (1 << 20) > 0
        assert cache_bytes() == 0
        after = [s.tokens for s in ray.get(worker.run_group.remote(replace(item, attempt=1)))]
        assert after == before and cache_bytes() == held
    finally:
        for actor in [worker, *env_workers]:
            ray.kill(actor)
