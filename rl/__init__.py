"""rl: the RL core — config, CLI, Ray actors, rollout, GRPO learner, metrics and checkpoints."""
__version__ = "0.1.0"
