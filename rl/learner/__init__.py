"""The learner wing: the policy trained with GRPO inside DeepSpeed.

    group.py     LearnerGroup: the learner's ranks (Ray actors) driven as one learner
    learner.py   Learner: one DeepSpeed rank (warm-up step, GRPO step, weights, checkpoints)
    batches.py   rows -> ranks -> micro-batches, packed into one row or right-padded
    loss.py      GRPO numerics as pure functions (advantages, clipped loss, normalisers)
    experts.py   expert-parallel shards of the MoE experts beside DeepSpeed
    flops.py     the step's FLOPs and MFU
"""
from rl.learner.group import LearnerGroup
from rl.learner.learner import Learner, StepResult

__all__ = ["Learner", "LearnerGroup", "StepResult"]
