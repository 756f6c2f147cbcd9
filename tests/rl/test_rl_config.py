"""Config validation: every problem is one line naming the key."""
from pathlib import Path

import pytest
import yaml

from rl.config import ConfigError, load_config, validate
from rl.trainer import releases_rollout_caches

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


BASE = {"envs": [{"name": "math"}], "seed": 0}


def test_demo_config_is_valid():
    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert cfg.train.steps > 0 and len(cfg.envs) >= 2


def test_overrides_are_typed(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["train.lr=3e-4", "rollout.group_size=8", "logging.progress=false",
                                              "envs.0.weight=2"])
    assert cfg.train.lr == 3e-4 and cfg.rollout.group_size == 8 and cfg.logging.progress is False
    assert cfg.envs[0].weight == 2


def test_an_override_into_a_mapping_the_config_leaves_out_edits_its_default(tmp_path):
    """`effort.weights.max=2` on a config that lists no weights weights max twice and keeps the other
    levels at their default 1.0 (it had made the weights {max: 2}: a run at max only, silently);
    where the config lists the mapping, the override edits what it lists."""
    cfg = load_config(write(tmp_path, BASE), ["effort.weights.max=2", "effort.budgets.low=20"])
    assert cfg.effort.weights == {"low": 1.0, "medium": 1.0, "high": 1.0, "max": 2.0}
    assert cfg.effort.budgets == {"low": 20, "medium": 96, "high": 192, "max": 320}
    listed = {**BASE, "effort": {"budgets": {"low": 8, "max": 16}, "weights": {"low": 1.0, "max": 0.0}}}
    cfg = load_config(write(tmp_path, listed), ["effort.weights.max=3"])
    assert cfg.effort.weights == {"low": 1.0, "max": 3.0}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.lrr=1"], "config error: unknown key 'train.lrr'"),
        (["train.lr=fast"], "config error: 'train.lr': Input should be a valid number"),
        (["rollout.group_size=1"], "config error: 'rollout.group_size': Input should be greater than or equal to 2"),
        (["train.loss_agg=sum"], "config error: 'train.loss_agg'"),
        (["effort.budgets.huge=3"], "unknown effort level 'huge'"),
        (["train"], "is not of the form key=value"),
        (["train.lr.x=1"], "config error: 'train.lr': Input should be a valid number"),
        (["seed.x=1"], "config error: 'seed' is a value, not a section"),
        (["rollout.cache_gib=1", "rollout.cache_tokens=4096"],
         "config error: 'rollout': give rollout.cache_tokens (4096) or rollout.cache_gib (1.0), not both"),
        (["rollout.cache_gib=0.0001"], "rollout.cache_gib=0.0001 (107,374 bytes) cannot hold rollout.max_slots=64 "
                                       "slots (112,128 bytes each) plus one rollout.max_context=32768-token sequence"),
        (["rollout.gpu_memory_fraction=1.5", "resources.rollout_gpus=1"],
         "config error: 'rollout.gpu_memory_fraction': Input should be less than or equal to 1"),
        (["rollout.gpu_memory_fraction=0.5", "rollout.cache_gib=1", "resources.rollout_gpus=1"],
         "rollout.gpu_memory_fraction (0.5) sizes the cache when neither cache_tokens nor cache_gib is given"),
        (["rollout.gpu_memory_fraction=0.5"], "rollout.gpu_memory_fraction=0.5 sizes a GPU's cache, but the "
                                              "rollout workers run on CPU: give rollout.cache_tokens or cache_gib"),
        (["rollout.group_size=8", "rollout.max_sandboxes=4"],
         "rollout.max_sandboxes=4 cannot hold one group's 8 sandboxes (rollout.group_size)"),
        (["rollout.warm_sandboxes=65"], "rollout.warm_sandboxes=65 is over rollout.max_sandboxes=64"),
        (["rollout.compile_decode=true", "rollout.engine=transformers", "model.hf_path=/m", "rollout.record_routing=false"],
         "rollout.compile_decode is the native engine's; rollout.engine is transformers"),
        (["resources.learner_ranks=3", "train.expert_parallel=2", "train.zero_stage=1"],
         "train.expert_parallel=2 must divide the learner's ranks (resources.learner_ranks / learner_gpus: 3)"),
        (["resources.learner_ranks=2", "train.expert_parallel=2"],
         "train.expert_parallel=2 needs train.zero_stage 1 or 2"),
        (["resources.learner_ranks=3", "train.expert_parallel=3", "train.zero_stage=1"],
         "train.expert_parallel=3 must divide the model's 8 routed experts"),
        (["resources.learner_gpus=2", "resources.learner_ranks=4"],
         "learner_ranks=4: with learner_gpus=2 the learner runs one rank per GPU"),
        (["model.hf_path=/m", "rollout.engine=vllm", "rollout.record_routing=false", "resources.learner_ranks=2",
          "train.expert_parallel=2", "train.zero_stage=1"],
         "a transformers policy (model.hf_path) trains data-parallel only"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, BASE), overrides)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_a_cache_budget_is_checked_in_the_precision_the_engine_will_run_in(tmp_path):
    # toy, 64 slots, one 32,768-token sequence: 13,467,648 B in float32 (CPU), 9,879,552 B in bfloat16 (GPU)
    path = write(tmp_path, BASE)
    with pytest.raises(ConfigError, match="cannot hold"):
        load_config(path, ["rollout.cache_gib=0.01"])
    assert load_config(path, ["rollout.cache_gib=0.01", "resources.rollout_gpus=1"]).rollout.cache_gib == 0.01


def test_environment_workers_keep_a_sandbox_warm_for_each_episode_played_at_once(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["rollout.num_workers=2", "rollout.groups_per_worker=2",
                                              "rollout.group_size=4", "rollout.env_workers=3"])
    assert cfg.rollout.warm_sandboxes_per_env_worker() == 6  # 16 episodes over 3 workers, rounded up
    cfg = load_config(write(tmp_path, BASE), ["rollout.num_workers=4", "rollout.groups_per_worker=8",
                                              "rollout.group_size=8"])
    assert cfg.rollout.warm_sandboxes_per_env_worker() == 64  # capped at max_sandboxes
    cfg = load_config(write(tmp_path, BASE), ["rollout.warm_sandboxes=0"])
    assert cfg.rollout.warm_sandboxes_per_env_worker() == 0


def test_unknown_top_level_key_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trian'"):
        load_config(write(tmp_path, {**BASE, "trian": {}}))
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")


def test_duplicate_env_and_no_env(tmp_path):
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(write(tmp_path, {"envs": [{"name": "math"}, {"name": "math"}]}))
    with pytest.raises(ConfigError, match="'envs'"):
        load_config(write(tmp_path, {"envs": []}))


def test_invalid_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    cfg = load_config(path)
    assert cfg.envs


@pytest.mark.parametrize("resources, staleness, releases", [
    ({"learner_gpus": 1, "colocate": True}, 0, True),  # colocated and synchronous: the learner gets the memory
    ({"learner_gpus": 1, "colocate": True, "release_rollout_caches": False}, 0, False),  # kept (and graphs)
    ({"learner_gpus": 1, "colocate": True}, 1, False),  # asynchronous engines hold sequences through the step
    ({"learner_gpus": 1, "rollout_gpus": 1}, 0, False),  # engines on GPUs of their own
])
def test_rollout_caches_are_freed_for_the_learner_only_when_they_share_its_gpu(resources, staleness, releases):
    cfg = validate({"resources": resources, "rollout": {"max_staleness": staleness, "cache_tokens": 4096}})
    assert releases_rollout_caches(cfg) is releases
