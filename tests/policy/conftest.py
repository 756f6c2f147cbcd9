"""Policy tests use tiny shapes on a shared 2-core machine: one intra-op thread."""
from __future__ import annotations

import torch

torch.set_num_threads(1)
