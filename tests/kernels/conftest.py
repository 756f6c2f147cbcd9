"""Kernel tests use tiny shapes: intra-op threads only add sync cost on a shared, loaded CPU."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
