"""A run's set-up stopped half-way (Ctrl-C while its learner starts) gives back what it made: the
actors under the run's names and the resource reservation. A run resumed in the same process
(a notebook, the tests' Ray session) makes them again under the same names."""
from __future__ import annotations

import time

import pytest

from rl.cluster import model_spec, start_env_side, start_policy_side
from rl.config import validate

from tests_rl_config import TINY


def named_actors_of(ray, run_id: str, expected: list[str], timeout_s: float = 30.0) -> list[str]:
    """The run's actors Ray lists: `expected` once those killed are gone (a kill is asynchronous), or
    what is left after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = sorted(name for name in ray.util.list_named_actors() if run_id in name)
        if left == expected or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_a_set_up_stopped_while_the_learner_starts_gives_back_its_actors(ray_session, tmp_path, monkeypatch):
    ray = ray_session
    from policy import Tokenizer
    from ray.util.placement_group import placement_group_table

    run_id = "halfway-test"
    cfg = validate({**TINY, "envs": TINY["envs"][:1], "rollout": {**TINY["rollout"], "num_workers": 2}})
    Tokenizer.train(["what is 3 + 4? the answer is 7."] * 20, vocab_size=320).save(str(tmp_path))

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("rl.learner.LearnerGroup", ctrl_c)
    groups_before = {g for g, state in placement_group_table().items() if state["state"] != "REMOVED"}
    env_workers = start_env_side(cfg, run_id)
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:  # held: its frames would keep the workers' handles
            start_policy_side(cfg, run_id, model_spec(cfg, 320), str(tmp_path), 0, env_workers)
        assert stopped.value is not None
        kept = [f"env-{run_id}-0"]  # the environment side is the caller's to stop
        assert named_actors_of(ray, run_id, kept) == kept
        groups_after = {g for g, state in placement_group_table().items() if state["state"] != "REMOVED"}
        assert groups_after <= groups_before, "the reservation was not given back"
    finally:
        for worker in env_workers:
            ray.kill(worker, no_restart=True)


def test_a_name_ray_still_holds_after_the_shut_down_waited_is_said(tmp_path, monkeypatch):
    """A run on a cluster that outlives it waits for Ray to release its names; one still held after the
    wait is said on the console, not left for the next run to trip over."""
    import io

    from rich.console import Console

    import rl.trainer as trainer

    out = io.StringIO()
    run = trainer.Trainer(validate(TINY), tmp_path / "tiny-run", console=Console(file=out, width=200))
    monkeypatch.setattr(trainer.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(trainer, "names_released", lambda run_id: [f"env-{run_id}-0"])
    run._shut_down(None, stopped=False)
    assert "Ray still holds 1 actor name(s) of this run (env-tiny-run-0)" in out.getvalue()
