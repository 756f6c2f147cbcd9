"""Smoke check of the stack on a GPU machine, after install.sh (run from the repo's root):

    bash benchmarks/gpu_setup/install.sh && . /tmp/site/env.sh && python3 benchmarks/gpu_setup/smoke.py

Ray starts and gives an actor a GPU; the learner (DeepSpeed, toy policy) is placed on a GPU by the
`resources` section and joins an NCCL group; a rollout worker is placed beside it (colocated: one
GPU) or on its own GPU (two GPUs); a bucketed weight sync carries the learner's weights to it bit
for bit, over the object store and, with two GPUs, over an NCCL broadcast. Each step's time is
printed; the first failure ends the check with its reason. No forward pass runs (fla-core would
spend minutes autotuning), so this checks the plumbing, not the kernels.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

T0 = time.perf_counter()


def step(name: str, started: float, detail: str = "") -> float:
    now = time.perf_counter()
    print(f"smoke: {name}: {now - started:.1f} s{'  ' + detail if detail else ''}", flush=True)
    return now


def main() -> None:
    import torch
    import torch.distributed as dist

    t = step("import torch", T0, f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): "
                                 f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    if not torch.cuda.is_available():
        sys.exit("smoke: no CUDA device visible")
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
             num_cpus=os.cpu_count())
    t = step("ray.init", t, f"ray {ray.__version__}, cluster GPUs {ray.cluster_resources().get('GPU', 0):g}")

    @ray.remote(num_gpus=1)
    class Probe:
        def check(self) -> str:
            x = torch.ones(1024, 1024, device="cuda")
            return f"gpu ids {ray.get_gpu_ids()}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}, " \
                   f"matmul ok={bool((x @ x).eq(1024).all())}"

    probe = Probe.remote()
    t = step("GPU actor", t, ray.get(probe.check.remote()))
    ray.kill(probe)

    from policy import Tokenizer
    from rl.config import RolloutConfig, TrainConfig, ResourcesConfig
    from rl.learner import LearnerGroup
    from rl.shipping import ship_dir
    from rl.placement import Placement, plan_placement
    from rl.rollout.worker import RolloutWorker
    from rl.weight_sync import SyncSpec, open_weight_sync, sync_weights

    two = torch.cuda.device_count() >= 2
    res = ResourcesConfig(learner_gpus=1, rollout_gpus=1) if two else ResourcesConfig(learner_gpus=1, colocate=True)
    placement = Placement(plan_placement(res, num_workers=1, worker_cpus=1))
    spec = {"preset": "toy", "overrides": {"vocab_size": 320}, "init_from": None}
    tok_dir = tempfile.mkdtemp()
    Tokenizer.train(["the quick brown fox jumps over the lazy dog 0123456789"] * 20, vocab_size=320).save(tok_dir)
    group = LearnerGroup(spec, TrainConfig(), RolloutConfig().max_context, 1.0, 0, 0, [placement.options(placement.plan.learner[0])])
    learner = group.actors[0]
    worker = ray.remote(RolloutWorker).options(**placement.options(placement.plan.rollout[0])).remote(
        spec, ship_dir(tok_dir), [], RolloutConfig(), 1)
    where = ray.get(learner.__ray_call__.remote(lambda self: (
        str(self.device), next(self.engine.module.parameters()).device.type, os.environ["DS_ACCELERATOR"],
        dist.get_backend(), ray.get_gpu_ids())))
    t = step("learner on GPU", t, f"device {where[0]}, weights on {where[1]}, DS_ACCELERATOR={where[2]}, "
                                  f"DeepSpeed backend {where[3]}, gpu ids {where[4]}")
    wdev = ray.get(worker.__ray_call__.remote(lambda self: (str(next(self.engine.model.parameters()).device),
                                                            ray.get_gpu_ids())))
    t = step("rollout worker", t, f"{'own GPU' if two else 'colocated'}: model on {wdev[0]}, gpu ids {wdev[1]}")

    def same() -> bool:
        a = ray.get(learner.__ray_call__.remote(lambda self: {k: v.cpu() for k, v in
                                                              self.engine.module.state_dict().items()}))
        b = ray.get(worker.__ray_call__.remote(lambda self: {k: v.cpu() for k, v in
                                                             self.engine.model.state_dict().items()}))
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    for transport in ["object_store"] + (["broadcast"] if two else []):
        sync = open_weight_sync(group, [worker], SyncSpec(transport=transport, bucket_bytes=1 << 20,
                                                            backend="nccl"))
        report = sync_weights(sync, group, [worker], version=0, full=True)
        again = sync_weights(sync, group, [worker], version=1)
        if not same():
            sys.exit(f"smoke: {transport} sync did not reproduce the learner's weights")
        t = step(f"weight sync ({transport})", t, f"{report.bytes / 2**20:.1f} MiB in {report.buckets} buckets: "
                                                  f"{report.seconds * 1e3:.0f} ms full, {again.seconds * 1e3:.0f} ms "
                                                  f"delta; weights identical")
    placement.release()
    ray.shutdown()
    step("all", T0)


if __name__ == "__main__":
    main()
