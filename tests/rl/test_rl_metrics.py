"""MetricsLogger: JSONL plus wandb, warm-up steps (negative) and GRPO steps on their own axes."""
from __future__ import annotations

import pytest

from rl.metrics import MetricsLogger, read_metrics


def test_warmup_and_grpo_steps_reach_wandb_without_step_warnings(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the suite defaults to disabled
    monkeypatch.setenv("WANDB_SILENT", "false")
    logger = MetricsLogger(tmp_path, "offline", "pytest", "metrics", {"a": 1}, resume=False)
    try:
        for step in (-20, -10, -1):
            logger.log(step, {"sft/loss": 1.0 / -step})
        for step in range(3):
            logger.log(step, {"rollout/reward": 0.1 * step, "train/loss": 1.0})
        summary = dict(logger._wandb.summary)
    finally:
        logger.close()
    out = capfd.readouterr()
    assert "less than the current step" not in out.out + out.err and "deprecated" not in out.out + out.err
    assert [r["step"] for r in read_metrics(tmp_path)] == [-20, -10, -1, 0, 1, 2]
    assert summary["grpo_step"] == 2 and summary["warmup_step"] == -1
    assert summary["sft/loss"] == 1.0 and summary["rollout/reward"] == pytest.approx(0.2)
