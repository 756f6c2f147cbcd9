"""`rl train` and `rl eval` refuse an environment's bad kwargs (a nonsense count among them) in one line,
before Ray starts and, for eval, before the checkpoint is looked at."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rl.cli import app
from rl.config import ConfigError

BAD = [({"n_train": -5}, "environment 'code' refuses these kwargs: ValueError: code: n_train must be between 1 "
                         "and 1,000,000, got -5"),
       ({"n_heldout": 10**12}, "code: n_heldout must be between 1 and 1,000,000, got 1000000000000"),
       ({"bogus_kw": 1}, "environment 'code' takes no argument 'bogus_kw'")]


@pytest.fixture
def no_ray(monkeypatch):
    """Any start of Ray fails the test."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for a config that should have been refused")

    monkeypatch.setattr(ray, "init", refuse)


def config(tmp_path: Path, kwargs: dict) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"envs": [{"name": "code", "kwargs": kwargs}], "output_dir": str(tmp_path / "runs"),
                                    "logging": {"wandb_mode": "disabled", "progress": False}}))
    return str(path)


@pytest.mark.parametrize(("kwargs", "expected"), BAD)
def test_train_refuses_bad_counts_before_ray(tmp_path, no_ray, kwargs, expected):
    from rl.trainer import train

    with pytest.raises(ConfigError) as err:
        train(config(tmp_path, kwargs), [])
    assert str(err.value).startswith("config error: 'envs.0.kwargs': ") and expected in str(err.value)
    assert len(str(err.value).splitlines()) == 1 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("kwargs", "expected"), BAD)
def test_eval_refuses_bad_kwargs_before_ray_and_the_checkpoint(tmp_path, no_ray, kwargs, expected):
    from rl.evaluate_cmd import evaluate_checkpoint

    with pytest.raises(ConfigError) as err:  # the checkpoint does not exist: the environments are checked first
        evaluate_checkpoint(config(tmp_path, kwargs), str(tmp_path / "no-checkpoint"), [])
    assert str(err.value).startswith("config error: 'envs.0.kwargs': ") and expected in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_rl_eval_says_it_in_one_line(tmp_path, no_ray):
    result = CliRunner().invoke(app, ["eval", config(tmp_path, {"n_train": -5}), "--checkpoint", str(tmp_path / "x")])
    lines = result.output.splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0] == f"error: config error: 'envs.0.kwargs': {BAD[0][1]}"
