"""Where the learner and the rollout workers run: GPUs by the config's `resources` section.

A plan lists the GPU bundles the run reserves as one Ray placement group (packed onto as few
nodes as possible, so the learner's ranks share a node) and, for each actor, its GPU share and its
bundle. A CPU-only config (the default) reserves nothing and places actors exactly as before.
Inside an actor, Ray's CUDA_VISIBLE_DEVICES shows only its own GPUs, so its device is cuda:0."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ray
import torch

from rl.config import ResourcesConfig
from rl.errors import RunRefused

LEARNER_CPUS = 0.5
# Ray counts GPU shares to 1e-4: shares are rounded down so that a bundle's shares never exceed it
_SHARE_STEP = 1e-4


@dataclass(frozen=True)
class Slot:
    num_gpus: float  # the actor's share of GPUs (0: a CPU actor)
    num_cpus: float
    bundle: int | None  # index into PlacementPlan.bundles; None: not in the placement group


@dataclass(frozen=True)
class PlacementPlan:
    bundles: tuple[dict[str, float], ...]  # empty: nothing to reserve
    learner: tuple[Slot, ...]  # one per learner rank
    rollout: tuple[Slot, ...]  # one per rollout worker
    summary: str  # what was asked, for error messages

    @property
    def gpus(self) -> float:
        return sum(b.get("GPU", 0.0) for b in self.bundles)


def _share(total: float, parts: int) -> float:
    return math.floor(total / parts / _SHARE_STEP) * _SHARE_STEP


def plan_placement(res: ResourcesConfig, num_workers: int, worker_cpus: float,
                   with_learner: bool = True) -> PlacementPlan:
    """The bundles to reserve and each actor's slot; pure (no Ray), so it is tested alone. Without
    the learner (`rl eval`), separate learner GPUs are not reserved."""
    bundles: list[dict[str, float]] = []
    learner: list[Slot] = []
    rollout: list[Slot | None] = [None] * num_workers
    ranks = res.ranks
    summary = (f"learner_gpus={res.learner_gpus}, {num_workers} rollout worker(s) x rollout_gpus={res.rollout_gpus}"
               f"{', colocated' if res.colocate else ''}")

    if res.colocate:
        # learner rank r on GPU r; worker i on GPU i mod learner_gpus; they split each GPU in halves
        for r in range(res.learner_gpus):
            mine = [i for i in range(num_workers) if i % res.learner_gpus == r]
            bundles.append({"GPU": 1.0, "CPU": LEARNER_CPUS + worker_cpus * len(mine)})
            learner.append(Slot(0.5 if mine else 1.0, LEARNER_CPUS, r))
            for i in mine:
                rollout[i] = Slot(_share(0.5, len(mine)), worker_cpus, r)
        return PlacementPlan(tuple(bundles), tuple(learner), tuple(rollout), summary)  # type: ignore[arg-type]

    for r in range(ranks):
        if res.learner_gpus and with_learner:
            bundles.append({"GPU": 1.0, "CPU": LEARNER_CPUS})
            learner.append(Slot(1.0, LEARNER_CPUS, len(bundles) - 1))
        else:  # CPU ranks share the learner's CPU share: on one machine they divide the same cores
            learner.append(Slot(0.0, _share(LEARNER_CPUS, ranks), None))
    if res.rollout_gpus >= 1:
        for i in range(num_workers):
            bundles.append({"GPU": float(res.rollout_gpus), "CPU": worker_cpus})
            rollout[i] = Slot(float(res.rollout_gpus), worker_cpus, len(bundles) - 1)
    elif res.rollout_gpus > 0:
        per_gpu = int(1.0 / res.rollout_gpus + 1e-9)  # workers packed on each GPU
        for start in range(0, num_workers, per_gpu):
            members = range(start, min(start + per_gpu, num_workers))
            bundles.append({"GPU": 1.0, "CPU": worker_cpus * len(members)})
            for i in members:
                rollout[i] = Slot(res.rollout_gpus, worker_cpus, len(bundles) - 1)
    else:
        rollout = [Slot(0.0, worker_cpus, None) for _ in range(num_workers)]
    return PlacementPlan(tuple(bundles), tuple(learner), tuple(rollout), summary)  # type: ignore[arg-type]


def check_custom_resources(asked: dict[str, dict[str, float]], count: dict[str, int]) -> None:
    """Refuse, in one line, a role (learner, rollout, env) that asks for a custom resource no node of the
    cluster offers enough of: its actors would wait forever. `asked`: role -> resources each actor asks
    for; `count`: role -> its actors."""
    have = ray.cluster_resources()
    for role, resources in asked.items():
        for name, amount in resources.items():
            need = amount * count[role]
            if have.get(name, 0.0) + 1e-9 < need:
                raise RunRefused(f"resources.{role}_resources: {count[role]} actor(s) x {name}={amount:g} need "
                                 f"{need:g}, the Ray cluster offers {have.get(name, 0.0):g} (start nodes with "
                                 f"ray start --resources '{{\"{name}\": N}}')")


def check_cluster(plan: PlacementPlan, other_cpus: float = 0.0) -> None:
    """Refuse, in one line naming the config section, a plan the Ray cluster's CPUs or GPUs cannot
    hold (an actor Ray cannot place waits forever). `other_cpus`: what the run's other actors ask."""
    asked = sum(s.num_cpus for s in (*plan.learner, *plan.rollout)) + other_cpus
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if asked > cpus + 1e-9:
        raise RunRefused(f"resources: the run's actors ask for {asked:g} CPUs ({plan.summary}, "
                         f"rollout.worker_cpus each, {other_cpus:g} for the environment workers), the Ray cluster "
                         f"has {cpus:g}: lower rollout.num_workers or worker_cpus, or raise ray.num_cpus")
    if not plan.bundles:
        return
    have = ray.cluster_resources().get("GPU", 0.0)
    if plan.gpus > have:
        raise RunRefused(f"resources: the config asks for {plan.gpus:g} GPUs ({plan.summary}), "
                         f"the Ray cluster has {have:g}")
    biggest = max(b.get("GPU", 0.0) for b in plan.bundles)
    per_node = max((n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["Alive"]), default=0.0)
    if biggest > per_node:
        raise RunRefused(f"resources: an actor asks for {biggest:g} GPUs on one node ({plan.summary}), "
                         f"the largest node has {per_node:g}")


class Placement:
    """A plan with its reservation in the cluster; `options(slot)` are an actor's Ray options."""

    def __init__(self, plan: PlacementPlan, timeout_s: float = 60.0) -> None:
        self.plan = plan
        self.group = None
        if not plan.bundles:
            return
        from ray.util.placement_group import placement_group, remove_placement_group

        check_cluster(plan)
        self.group = placement_group(list(plan.bundles), strategy="PACK")
        try:
            ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        except BaseException:  # a Ctrl-C while it waits: the reservation is not left behind
            remove_placement_group(self.group)
            raise
        if not ready:
            remove_placement_group(self.group)
            self.group = None
            raise RunRefused(f"resources: could not reserve {plan.gpus:g} GPUs and their CPUs ({plan.summary}) "
                             f"within {timeout_s:.0f} s: other jobs hold them, or too few CPUs per node")

    def options(self, slot: Slot, resources: dict[str, float] | None = None) -> dict[str, Any]:
        """Ray options of the actor in `slot`; `resources`: custom resources it also asks for."""
        opts: dict[str, Any] = {"num_cpus": slot.num_cpus}
        if slot.num_gpus:
            opts["num_gpus"] = slot.num_gpus
        if resources:
            opts["resources"] = dict(resources)
        if slot.bundle is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=slot.bundle)
        return opts

    def release(self) -> None:
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def actor_device() -> torch.device:
    """The device of the calling actor: cuda:0 when Ray gave it a GPU (CUDA_VISIBLE_DEVICES then
    lists only its GPUs), else cpu."""
    if not ray.is_initialized() or not ray.get_gpu_ids():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"Ray gave this actor GPU(s) {ray.get_gpu_ids()} but torch sees no CUDA device")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def actor_gpu_share() -> float:
    """The share of its GPU Ray gave the calling actor (at most 1; 1 outside Ray): what the native
    engine's default cache budget scales by."""
    if not ray.is_initialized():
        return 1.0
    return min(ray.get_runtime_context().get_assigned_resources().get("GPU", 1.0), 1.0)
