"""rollouts.jsonl's line: rollout_record writes exactly the keys rl.types.RolloutRecord names."""
import json

from rl.rollout.scheduler import rollout_record
from rl.types import RolloutRecord, Sample


def test_rollout_record_keys_are_the_typed_ones():
    s = Sample(uid="g0/1", group_uid="g0", env="math", domain="math", task_id="t3", effort="low",
               tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], behavior_logprobs=[0, 0, -0.1, -0.2],
               token_versions=[-1, -1, 2, 3], reward=1.0, passed=True, transcript=[{"role": "user", "content": "q"}])
    record = rollout_record(5, s, trained=True)
    assert list(record) == [k for k in RolloutRecord.__annotations__ if k != "shaped_reward"]
    assert (record["version"], record["versions"], record["staleness"], record["tokens"]) == (2, [2, 3], 3, 2)
    json.dumps(record)  # a JSON line as it stands
