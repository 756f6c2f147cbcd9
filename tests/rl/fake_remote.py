"""A stand-in for a Ray actor method in tests that drive a rollout worker without Ray."""
from __future__ import annotations

import asyncio


class LocalCall:
    """`obj.method.remote(*args)` answered at once: an awaitable already holding fn(*args)."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.fn(*args))
        return future
