"""A tiny run config shared by the end-to-end tests: seconds per step on 2 cores."""

TINY = {
    "name": "tiny",
    "model": {"preset": "toy", "vocab_size": 320},
    "envs": [
        {"name": "math", "weight": 1.0, "kwargs": {"max_operand": 9, "n_train": 40, "n_heldout": 8}},
        {"name": "lookup", "weight": 1.0, "kwargs": {"n_train": 40, "n_heldout": 8}},
        {"name": "shell", "weight": 1.0, "kwargs": {"n_train": 40, "n_heldout": 8}},
    ],
    "sandbox_backend": "process",
    "effort": {"budgets": {"low": 8, "medium": 12, "high": 16, "max": 24}},
    "rollout": {"num_workers": 2, "groups_per_step": 4, "group_size": 2, "max_context": 256},
    "train": {"steps": 3, "micro_batches": 2},
    "warmup": {"steps": 2, "batch_size": 8, "tasks_per_env": 12},
    "eval": {"tasks_per_env": 2, "efforts": ["low", "max"]},
    "checkpoint": {"every": 2, "keep": 2},
    "logging": {"wandb_mode": "disabled", "progress": False},
    "gate": {"max_tasks": 3},
}
