"""The learner's ranks, driven as one learner.

`LearnerGroup` creates one `Learner` actor per rank (their Ray options, GPUs included, come from the
run's placement), asks rank 0 where the process group meets, starts every rank at once (DeepSpeed's
initialisation is a collective), and then calls each method on every rank, returning rank 0's
answer: the ranks compute the same metrics (combined over ranks inside the step), and only rank 0
holds whole weights when the experts are sharded.

Blocking calls wait for every rank and raise the first error as soon as any rank fails, instead of
waiting on ranks that are blocked in a collective with the failed one. `push_weights` and
`get_weights` return rank 0's reference at once (the rollout side consumes it); the other ranks'
parts of those calls are awaited at the next blocking call."""
from __future__ import annotations

from typing import Any, Mapping

from pathlib import Path

import ray

from rl.config import LevelShaping, TrainConfig
from rl.learner.learner import StepResult
from rl.shipping import ship_dir, this_node


def wait_all(refs: list) -> list:
    """Every result, in order; the first failure raises at once, whatever the others are doing."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready[0])
    return ray.get(refs)


class LearnerGroup:
    def __init__(self, model_spec: dict[str, Any], train_cfg: TrainConfig, seq_norm_tokens: int,
                 temperature: float, pad_id: int, seed: int, actor_options: list[dict[str, Any]],
                 name: str | None = None, shared_filesystem: bool = False,
                 shaping: Mapping[str, LevelShaping] | None = None) -> None:
        from rl.learner.learner import Learner

        self.shared_filesystem = shared_filesystem  # whether the ranks read and write the driver's paths
        world = len(actor_options)
        self.actors = [
            ray.remote(Learner).options(**opts, **({"name": f"{name}-{r}"} if name else {}))
            .remote(model_spec, train_cfg, seq_norm_tokens, temperature, pad_id, seed, r, world, shaping)
            for r, opts in enumerate(actor_options)
        ]
        self._inflight: list = []
        try:
            addr, port = ray.get(self.actors[0].rendezvous.remote())
            wait_all([a.start.remote(addr, port) for a in self.actors])
        except BaseException:
            self.kill()
            raise

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def _on_all(self, method: str, *args: Any) -> list:
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        earlier, self._inflight = self._inflight, []
        return wait_all(refs + earlier)[:len(refs)]

    def _rank0_ref(self, method: str, *args: Any):
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        self._inflight.extend(refs[1:])
        return refs[0]

    # -- the learner's interface ----------------------------------------------------------------------
    def sft_step(self, examples: list[dict[str, list[int]]], lr: float) -> StepResult:
        return self._on_all("sft_step", examples, lr)[0]

    def train_step(self, batch_ref) -> StepResult:
        """batch_ref: an ObjectRef of a RolloutBatch; Ray resolves it in each rank, never here."""
        return self._on_all("train_step", batch_ref)[0]

    def set_reference(self) -> None:
        """The KL reference becomes the policy as it is now (when the warm-up ends)."""
        self._on_all("set_reference")

    def startup_notes(self) -> list[str]:
        """What the ranks found at start that a user should know (each line once)."""
        lines = [line for notes in self._on_all("startup_notes") for line in notes]
        return list(dict.fromkeys(lines))

    def get_weights(self):
        """ObjectRef of the whole state dict (rank 0's)."""
        return self._rank0_ref("get_weights")

    def open_weight_sync(self, spec):
        """Rank 0 is the weight sync's source; returns the spec the workers join with."""
        return ray.get(self.actors[0].open_weight_sync.remote(spec))

    def push_weights(self, version: int, full: bool = False):
        """ObjectRef of rank 0's SyncTicket."""
        return self._rank0_ref("push_weights", version, full)

    def save(self, directory: str, tag: str, client_state: dict[str, Any]) -> None:
        """Every rank's checkpoint files into `directory/tag` on this (the driver's) node: ranks on
        other nodes send theirs back through Ray unless every node shares the filesystem."""
        driver = None if self.shared_filesystem else this_node()
        for packed in self._on_all("save", directory, tag, client_state, driver):
            if packed is not None:
                packed.unpack_into(Path(directory))

    def load(self, directory: str, tag: str) -> dict[str, Any]:
        """Restore every rank from `directory/tag` of this node (sent to the ranks on other nodes)."""
        return self._on_all("load", ship_dir(Path(directory) / tag, self.shared_filesystem))[0]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=timeout_s)
        except Exception:  # a rank already gone or stuck: it is killed next
            pass
        self.kill()

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
