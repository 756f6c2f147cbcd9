"""Weight sync (rl.weight_sync) timed against its wire bound: a sender actor pushes its whole state
(a full sync) to receiver actors, over the Ray object store and/or the torch.distributed
broadcast, in one run. Bound = bytes / link bandwidth; ratio = measured / bound (1.0 is the wire).

    # CPU (gloo): the `small` preset's fp32 state, object store vs broadcast
    python benchmarks/weight_sync.py --preset small --transports object_store broadcast
    # two GPUs (NCCL), one receiver, 2 GiB of bf16, against NVLink's measured broadcast bandwidth
    python3 benchmarks/weight_sync.py --bytes 2147483648 --device cuda --backend nccl \
        --transports broadcast --link-gbps 369

Without --link-gbps the bound is a same-process copy of the payload on the sender's device (the
memory bandwidth one copy gets), measured here first. Times: `sync` is the driver's wall time for
one sync (actor calls included), `push` the sender's own (plan + pack + send), median of --iters
after one warm-up sync. `state_dict` times the path rl.weight_sync replaces (the learner's
get_weights: a cloned state through the object store, then load_state_dict), for comparison.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray
import torch
from torch import nn

from bench_common import log, write_json


def build_state(preset: str | None, nbytes: int | None, dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if preset:
        from policy import build_model

        return build_model(preset).to(dtype)
    holder = nn.Module()  # one flat parameter of the asked size
    holder.flat = nn.Parameter(torch.randn(nbytes // torch.finfo(dtype).bits * 8).to(dtype))
    return holder


def actor_device(kind: str) -> torch.device:
    """The benchmark actor's device: its one visible GPU (made current), or the CPU."""
    if kind == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


@ray.remote
class Sender:
    def __init__(self, preset, nbytes, dtype, device) -> None:
        self.device = actor_device(device)
        self.model = build_state(preset, nbytes, dtype, 0).to(self.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def copy_bound_s(self, iters: int) -> float:
        """Seconds for one same-device copy of the payload (the bound when no link is given)."""
        flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in self.model.state_dict().values()])
        out = torch.empty_like(flat)
        times = []
        for _ in range(iters + 1):
            t = time.perf_counter()
            out.copy_(flat)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    def open_weight_sync(self, spec):
        from rl.weight_sync import WeightSource

        self.source = WeightSource(spec, self.device)
        return self.source.spec

    def push_weights(self, version: int, full: bool):
        t = time.perf_counter()
        ticket = self.source.push(self.model, version, full=full)
        self.push_s = time.perf_counter() - t
        return ticket

    def last_push_s(self) -> float:
        return self.push_s

    def state_dict_copy(self) -> dict[str, torch.Tensor]:
        """The path rl.weight_sync replaces: the whole state, cloned, through the object store."""
        t = time.perf_counter()
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.push_s = time.perf_counter() - t
        return state


@ray.remote
class Receiver:
    def __init__(self, preset, nbytes, dtype, device) -> None:
        self.device = actor_device(device)
        self.model = build_state(preset, nbytes, dtype, 1).to(self.device)
        self.version = -1

    def open_weight_sync(self, spec, rank: int) -> None:
        from rl.weight_sync import WeightSink

        self.sink = WeightSink(spec, rank, self.device)

    def pull_weights(self, ticket) -> int:
        self.version = self.sink.take(self.model, ticket, self.version).version
        return self.version

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.model.state_dict().values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", help="a policy preset's whole state (e.g. small)")
    what.add_argument("--bytes", type=int, help="one flat tensor of this many bytes")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--transports", nargs="+", default=["state_dict", "object_store", "broadcast"],
                    choices=["state_dict", "object_store", "broadcast"],
                    help="state_dict: the learner's get_weights + load_state_dict path, for comparison")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: each actor takes one GPU")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--link-gbps", type=float, help="link bandwidth in GB/s (1e9 bytes/s) for the wire bound")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    from rl.weight_sync import ActorSource, SyncSpec, open_weight_sync, sync_weights

    dtype = getattr(torch, args.dtype)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
             num_cpus=max(2, args.receivers + 1))
    gpus = 0.0
    if args.device == "cuda":  # one GPU per actor, or shares of too few (then no NCCL: one GPU, one rank)
        members, have = 1 + args.receivers, ray.cluster_resources().get("GPU", 0.0)
        gpus = 1.0 if have >= members else int(have / members * 1e4) / 1e4
        if gpus < 1 and "broadcast" in args.transports and args.backend == "nccl":
            raise SystemExit(f"NCCL broadcast needs one GPU per member: {members} members, {have:g} GPU(s)")
    what = (args.preset, args.bytes, dtype, args.device)
    sender = Sender.options(num_gpus=gpus, num_cpus=0).remote(*what)
    receivers = [Receiver.options(num_gpus=gpus, num_cpus=0).remote(*what) for _ in range(args.receivers)]
    nbytes = ray.get(sender.nbytes.remote())
    if args.link_gbps:
        bound_s, bound_name = nbytes / (args.link_gbps * 1e9), f"{args.link_gbps:g} GB/s link"
    else:
        bound_s = ray.get(sender.copy_bound_s.remote(args.iters))
        bound_name = f"one {args.device} copy ({nbytes / bound_s / 1e9:.1f} GB/s)"
    log(f"payload {nbytes / 2**20:.1f} MiB ({args.preset or 'flat'}, {args.dtype}), {args.receivers} receiver(s) on "
        f"{args.device}, buckets of {args.bucket_mb:g} MiB; bound = {bound_name}: {bound_s * 1e3:.2f} ms")
    results: dict[str, Any] = {"bytes": nbytes, "bound_s": bound_s, "bound": bound_name, "args": vars(args)}
    for transport in args.transports:
        if transport != "state_dict":
            spec = SyncSpec(transport=transport, bucket_bytes=int(args.bucket_mb * 2**20), backend=args.backend)
            spec = open_weight_sync(ActorSource(sender), receivers, spec)
        sync_times, push_times, buckets = [], [], 1
        for i in range(args.iters + 1):
            t = time.perf_counter()
            if transport == "state_dict":
                state = sender.state_dict_copy.remote()
                ray.get([r.load_state.remote(state) for r in receivers])
                del state
            else:
                buckets = sync_weights(spec, ActorSource(sender), receivers, version=i, full=True).buckets
            if i:  # the first sync warms up (NCCL communicators, allocator)
                sync_times.append(time.perf_counter() - t)
                push_times.append(ray.get(sender.last_push_s.remote()))
        sync_s, push_s = statistics.median(sync_times), statistics.median(push_times)
        results[transport] = {"sync_s": sync_s, "push_s": push_s, "buckets": buckets,
                              "ratio_sync": sync_s / bound_s, "ratio_push": push_s / bound_s}
        via = {"broadcast": args.backend}.get(transport, "Ray")
        log(f"{transport:>12} ({via}): sync {sync_s * 1e3:8.2f} ms ({nbytes / sync_s / 1e9:6.2f} GB/s, "
            f"{sync_s / bound_s:5.2f}x bound), push {push_s * 1e3:8.2f} ms ({push_s / bound_s:5.2f}x), "
            f"{buckets} bucket(s)")
        write_json(results, args.json)
    sums = ray.get([r.checksum.remote() for r in receivers])
    assert len(set(sums)) == 1, f"receivers disagree: {sums}"
    ray.shutdown()


if __name__ == "__main__":
    main()
