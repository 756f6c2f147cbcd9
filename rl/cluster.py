"""Starting Ray and the actors of one run (grader pool, environment workers, rollout workers,
learner, scheduler), with CPU shares that fit a laptop and restart policies for the workers."""
from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rl.config import RunConfig
from rl.errors import RunRefused
from rl.placement import Placement, check_cluster, check_custom_resources, plan_placement
from rl.shipping import ship_dir, this_node
from sandbox.home import home_dir

REPO = Path(__file__).resolve().parents[1]
ENV_WORKER_CPUS = 0.25


def _inductor_default() -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR holds only what torch put there itself: importing torch._dynamo
    (rl.config does) sets it to inductor's default in /tmp when unset, which is not a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    set_to = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return set_to is not None and os.path.abspath(set_to) == os.path.abspath(default_cache_dir())


def actor_env() -> dict[str, str]:
    """Environment for every actor: single-threaded torch (many actors share few cores), the compiled-
    kernel caches under $RL_HOME (sandbox.home: the checkout's .cache where it is unset; each unless
    set already), wandb off in workers. The learner picks DeepSpeed's accelerator itself, from the
    device Ray gave it."""
    env = {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": str(home_dir("torch_extensions", "TORCH_EXTENSIONS_DIR")),
        # what torch.compile and Triton generate (the fused ops, fla's tuned kernels), kept for the next
        # run: on an H200 the learner's first step compiled in 77 s with inductor's cache, 164 s without
        "TORCHINDUCTOR_CACHE_DIR": str(home_dir("torchinductor",
                                                None if _inductor_default() else "TORCHINDUCTOR_CACHE_DIR")),
        "TRITON_CACHE_DIR": str(home_dir("triton", "TRITON_CACHE_DIR")),
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return env


def start_ray(cfg: RunConfig) -> bool:
    """Join the cluster at `ray.address`, or start a local one, and check that it has the GPUs the
    `resources` section asks for (before any other work). Returns whether we started it."""
    if ray.is_initialized():
        started = False
    elif cfg.ray.address:
        join_cluster(cfg.ray.address)
        started = False
    else:
        temp_dir = cfg.ray.temp_dir or str(home_dir("ray"))  # $RL_HOME/ray
        # address="local": a new cluster of our own, never one a `ray start` left on this machine
        ray.init(address="local", num_cpus=cfg.ray.num_cpus or os.cpu_count(), include_dashboard=False,
                 log_to_driver=False, _temp_dir=temp_dir, configure_logging=False,
                 runtime_env={"env_vars": actor_env()})
        started = True
    try:
        check_cluster(plan_placement(cfg.resources, cfg.rollout.num_workers, cfg.rollout.worker_cpus),
                      ENV_WORKER_CPUS * cfg.rollout.env_workers)
        res = cfg.resources
        check_custom_resources({"learner": res.learner_resources, "rollout": res.rollout_resources,
                                "env": res.env_resources},
                               {"learner": res.ranks, "rollout": cfg.rollout.num_workers, "env": cfg.rollout.env_workers})
    except RunRefused:
        if started:
            ray.shutdown()
        raise
    return started


def join_cluster(address: str) -> None:
    """ray.init on an existing cluster; a failure is one line naming the fix. Ray's own retries
    print a warning a second while they last (twenty lines for a missing token): those go to a file,
    shown only if joining fails for a reason this function cannot name."""
    with tempfile.TemporaryFile(mode="w+") as noise:
        saved = os.dup(2)
        os.dup2(noise.fileno(), 2)
        try:
            ray.init(address=address, runtime_env={"env_vars": actor_env()}, log_to_driver=False)
            return
        except Exception as exc:  # noqa: BLE001 - ConnectionError, AuthenticationError, ValueError for a bad address
            failure = exc
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        noise.seek(0)
        said = noise.read()
    chain = f"{failure} {failure.__cause__ or ''} {said}"
    if "InvalidAuthToken" in chain or "Authentication" in chain:
        raise RunRefused(f"ray.address={address}: the cluster authenticates with a token this process does not "
                         f"hold: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the token its "
                         f"nodes were started with (docs/cluster.md)") from None
    reason = next((line.strip() for line in str(failure).splitlines() if line.strip()), type(failure).__name__)
    raise RunRefused(f"ray.address={address}: cannot join the cluster ({reason})") from None


@dataclass
class RunActors:
    env_workers: list
    rollout_workers: list
    scheduler: Any
    learner: Any | None  # a LearnerGroup
    placement: Placement | None = None
    # what the actors were given through the object store: held here so that an actor Ray restarts
    # (a lost node) can still read its constructor's directories
    shipped: tuple = ()

    def shutdown(self) -> None:
        if self.learner is not None:
            self.learner.shutdown()
        for worker in [*self.env_workers, *self.rollout_workers]:  # grader actors, sandboxes, engine processes
            try:
                ray.get((worker.close if worker in self.env_workers else worker.shutdown).remote(), timeout=30)
            except Exception:
                pass
        for actor in [*self.rollout_workers, *self.env_workers, self.scheduler]:
            ray.kill(actor, no_restart=True)
        if self.placement is not None:
            self.placement.release()


def ship_spec(spec: dict[str, Any], shared_filesystem: bool) -> dict[str, Any]:
    """A model spec whose directories (a transformers model, our checkpoint to start from or to
    evaluate) every node can read: rl/shipping.py."""
    return {k: ship_dir(v, shared_filesystem) if k in ("hf_path", "init_from", "path") and v else v
            for k, v in spec.items()}


def model_spec(cfg: RunConfig, vocab_size: int) -> dict[str, Any]:
    """What policy.build_policy builds: a transformers model (hf_path) or a preset sized to the
    run's tokenizer."""
    if cfg.model.hf_path:
        return {"hf_path": cfg.model.hf_path}
    overrides = {**cfg.model.overrides, "vocab_size": vocab_size}
    return {"preset": cfg.model.preset, "overrides": overrides, "init_from": cfg.model.init_from}


def env_kwargs(cfg: RunConfig, name: str) -> dict[str, Any]:
    """An environment's constructor kwargs; environments that open their own sandboxes (to grade,
    for instance) use the run's sandbox backend unless the config says otherwise. The entry's
    `sandbox` overrides fields of the sandbox the environment declares."""
    entry = next(e for e in cfg.envs if e.name == name)
    sandbox = {} if entry.sandbox is None else {"sandbox": entry.sandbox}
    return {"sandbox_backend": cfg.sandbox_backend, **sandbox, **entry.kwargs}


def env_worker_name(run_id: str, index: int) -> str:
    return f"env-{run_id}-{index}"


def start_env_side(cfg: RunConfig, run_id: str) -> list:
    """The environment workers (each owns its grader pool): needed before the policy exists
    (reference episodes train the tokenizer and feed the warm-up)."""
    from envs.registry import resolve
    from rl.rollout.env_worker import EnvWorker

    # resolved here: a class registered in this process (a decorator) reaches the workers by value
    env_specs = {e.name: resolve(e.name, env_kwargs(cfg, e.name)) for e in cfg.envs}
    grading = {"num_actors": cfg.grader.num_workers, "timeout_s": cfg.grader.timeout_s, "retries": cfg.grader.retries}
    # threaded: many rollout workers' episodes at once, one slow tool call never stalls the others
    workers: list = []
    with undone_if_interrupted(workers):
        for i in range(cfg.rollout.env_workers):
            workers.append(ray.remote(EnvWorker).options(
                num_cpus=ENV_WORKER_CPUS, name=env_worker_name(run_id, i), max_restarts=2, max_concurrency=64,
                resources=dict(cfg.resources.env_resources),
            ).remote(env_specs, grading, run_id, cfg.sandbox_backend, cfg.rollout.warm_sandboxes_per_env_worker(),
                     cfg.rollout.max_sandboxes))
    return workers


def start_policy_side(cfg: RunConfig, run_id: str, spec: dict[str, Any], tokenizer_dir: str, pad_id: int,
                      env_workers: list, with_learner: bool = True) -> RunActors:
    """Rollout workers, the learner and the scheduler that feeds the workers."""
    from rl.learner import LearnerGroup
    from rl.rollout.worker import RolloutWorker
    from rl.rollout.scheduler import RolloutScheduler, SamplingPlan

    # environment workers by name, not handle: a restartable actor whose constructor holds actor
    # handles is one Ray warns may fail to restart
    env_names = [env_worker_name(run_id, i) for i in range(len(env_workers))]
    placement = Placement(plan_placement(cfg.resources, cfg.rollout.num_workers, cfg.rollout.worker_cpus,
                                         with_learner))
    # what actors read from the driver's disk reaches them through Ray (no shared filesystem assumed)
    shared = cfg.ray.shared_filesystem
    tokenizer = ship_dir(tokenizer_dir, shared)
    spec = ship_spec(spec, shared)
    res = cfg.resources
    made: list = []
    with undone_if_interrupted(made, placement):
        rollout_workers = []
        for i in range(cfg.rollout.num_workers):
            rollout_workers.append(
                ray.remote(RolloutWorker).options(**placement.options(placement.plan.rollout[i], res.rollout_resources),
                                                  name=f"rollout-{run_id}-{i}",
                                                  max_restarts=cfg.rollout.max_retries + 1, max_task_retries=0)
                .remote(spec, tokenizer, env_names, cfg.rollout, cfg.seed + 1000 * (i + 1), cfg.effort))
            made.append(rollout_workers[-1])
        learner = None
        if with_learner:  # its ranks are its own to kill if they fail to start
            learner = LearnerGroup(spec, cfg.train, cfg.rollout.max_context, cfg.rollout.temperature, pad_id, cfg.seed,
                                   [placement.options(slot, res.learner_resources) for slot in placement.plan.learner],
                                   name=f"learner-{run_id}", shared_filesystem=shared, shaping=cfg.effort.shaping)
            made.extend(learner.actors)
        names = [e.name for e in cfg.envs]
        first = env_workers[0]
        task_ids = {name: {split: ray.get(first.task_ids.remote(name, split)) for split in ("train", "heldout")}
                    for name in names}
        plan = SamplingPlan(env_weights={e.name: e.weight for e in cfg.envs}, effort_weights=cfg.effort.weights,
                            effort_budgets=cfg.effort.budgets, group_size=cfg.rollout.group_size,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=cfg.seed,
                            shaping=cfg.effort.shaping)
        # the scheduler holds the stream's state and is not restarted: on the driver's node, which a run
        # cannot lose and go on
        here = NodeAffinitySchedulingStrategy(node_id=this_node(), soft=False)
        scheduler = ray.remote(RolloutScheduler).options(num_cpus=0, name=f"scheduler-{run_id}",
                                                         scheduling_strategy=here).remote(
            rollout_workers, env_workers, task_ids, plan, cfg.rollout)
    return RunActors(env_workers, rollout_workers, scheduler, learner, placement, (tokenizer, spec))


@contextmanager
def undone_if_interrupted(actors: list, placement: Placement | None = None) -> Iterator[list]:
    """The actors in `actors` (and the reservation) are given back if the block raises: a run stopped
    half-way through its set-up (Ctrl-C while the learner starts) leaves nothing under the run's
    names, which a run resumed in the same process (a notebook, the tests' Ray session) would find
    taken. Ray half gone may refuse a kill: the block's exception is the one that matters."""
    try:
        yield actors
    except BaseException:
        for actor in actors:
            with suppress(Exception):
                ray.kill(actor, no_restart=True)
        if placement is not None:
            with suppress(Exception):
                placement.release()
        raise


def names_released(run_id: str, timeout_s: float = 15.0) -> list[str]:
    """Wait until Ray holds no actor name of the run: it releases a killed actor's name only once the
    actor is dead, after ray.kill has returned, and a run resumed at once in the same process (a
    notebook, the tests' Ray session) would find `env-<run>-0` taken. Returns what is still held
    at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = [name for name in ray.util.list_named_actors() if run_id in name]
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.05)
