"""Weight sync: the learner's weights to the rollout workers, in buckets, with a version.

A sync is a manifest (version, the version it builds on, and where each tensor's bytes sit in which
bucket) and its buckets: flat uint8 tensors of at most `bucket_bytes`; a tensor that does not fit
the room left in a bucket starts a new one, and one larger than a bucket is cut into pieces over
several, so the memory a sync needs beyond the weights is two buckets on each side. Receivers copy
the bytes back into their own tensors (same dtype required), so a tensor arrives bit for bit. Only what changed since the last sync travels: trainable parameters always (the optimizer
may have moved any of them), frozen parameters and buffers when their fingerprint changed. Such a
delta applies only on top of the version it was computed from; a receiver holding another version
refuses it (WeightVersionError) and needs a full sync.

Two transports, one interface (`Transport.send` / `Transport.receive`):
- ObjectStoreTransport: buckets as Ray objects (CPU); the ticket carries their references.
- BroadcastTransport: a torch.distributed broadcast over a process group of its own (not the
  default group, which is DeepSpeed's): rank 0 the learner, ranks 1..N the rollout workers; NCCL
  between GPUs (each member on its own GPU), gloo on CPU. The manifest travels first, then the
  buckets, double-buffered so that packing or unpacking one bucket overlaps the next transfer.

Actor side: WeightSource (in the learner) and WeightSink (in a rollout worker). Driver side:
`open_weight_sync` and `sync_weights`."""
from __future__ import annotations

import abc
import pickle
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Iterator, Literal

import ray
import torch
import torch.distributed as dist

ALIGN = 64  # bytes: every piece starts at a multiple inside its bucket (aligned copies)
_FINGERPRINT_CHUNK = 1 << 24  # elements summed at once (bounds the int64 scratch memory)


class WeightVersionError(RuntimeError):
    """A sync that does not apply on top of the weights a receiver holds."""


@dataclass(frozen=True)
class TensorEntry:
    """One piece of a tensor's bytes: [start, start + nbytes) of the tensor at `offset` in `bucket`."""

    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int  # bytes into the bucket
    start: int  # bytes into the tensor
    nbytes: int


@dataclass(frozen=True)
class SyncManifest:
    version: int
    base_version: int | None  # None: a full sync; else tensors unchanged since base_version are left out
    entries: tuple[TensorEntry, ...]
    bucket_sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_sizes)


@dataclass(frozen=True)
class SyncTicket:
    """What receivers need to take a sync: the manifest, and for the object store the buckets'
    references. The broadcast transport's ticket is None: its manifest travels over the group."""

    manifest: SyncManifest
    refs: tuple | None = None


@dataclass(frozen=True)
class SyncSpec:
    transport: Literal["object_store", "broadcast"] = "object_store"
    bucket_bytes: int = 256 << 20
    backend: Literal["nccl", "gloo"] = "gloo"  # broadcast only
    host: str | None = None  # broadcast only: where rank 0's rendezvous store listens (filled by the source)
    port: int | None = None
    world_size: int = 1  # broadcast only: 1 + rollout workers
    timeout_s: float = 300.0


# ---- what is sent ------------------------------------------------------------------------------
def weight_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None
                   ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensors a sync covers (parameters once each, persistent buffers), by state_dict name,
    and the names of trainable ones. `state` holds tensors to send in place of the model's own under
    the same names (an expert-parallel learner's experts gathered from its ranks)."""
    kept = set(model.state_dict(keep_vars=True))
    tensors: dict[str, torch.Tensor] = {}
    trainable: set[str] = set()
    for name, p in model.named_parameters():
        tensors[name] = p.detach()
        if p.requires_grad:
            trainable.add(name)
    for name, b in model.named_buffers():
        if name in kept:
            tensors[name] = b.detach()
    if state is not None:
        tensors = {name: state[name] for name in tensors}
    return tensors, trainable


def fingerprint(t: torch.Tensor) -> tuple:
    """dtype, shape and two int64 checksums of the bytes (plain and position-weighted), computed
    where the tensor lives. An accidental change that keeps both sums is vanishingly unlikely;
    `full=True` syncs everything regardless."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    plain = weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _FINGERPRINT_CHUNK):
        chunk = words[start:start + _FINGERPRINT_CHUNK].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=t.device)
        plain = plain + chunk.sum()
        weighted = weighted + (chunk * pos).sum()
    return str(t.dtype), tuple(t.shape), int(plain), int(weighted)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def layout(tensors: dict[str, torch.Tensor], names: list[str], bucket_bytes: int, version: int,
           base_version: int | None) -> SyncManifest:
    """Tensors in order into buckets of at most bucket_bytes. A tensor that fits a bucket but not the
    room left starts the next one; a tensor larger than a bucket fills the room left and goes on in
    the next ones."""
    entries: list[TensorEntry] = []
    sizes: list[int] = []
    used = 0
    for name in names:
        t = tensors[name]
        total, start = t.numel() * t.element_size(), 0
        while True:
            offset = _align(used)
            rest = total - start
            if used and (offset >= bucket_bytes or (offset + rest > bucket_bytes and rest <= bucket_bytes)):
                sizes.append(used)  # close the bucket
                used = offset = 0
            take = min(rest, bucket_bytes - offset)
            entries.append(TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), len(sizes), offset,
                                       start, take))
            used, start = offset + take, start + take
            if start >= total:
                break
    if entries:
        sizes.append(used)
    return SyncManifest(version, base_version, tuple(entries), tuple(sizes))


class WeightSender:
    """Learner side: chooses what changed since the last sync and packs it into buckets."""

    def __init__(self, bucket_bytes: int) -> None:
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes} is below {ALIGN}")
        self.bucket_bytes = bucket_bytes
        self.version: int | None = None  # of the last sync planned
        self._fingerprints: dict[str, tuple] = {}

    def plan(self, model: torch.nn.Module, version: int, full: bool = False,
             state: dict[str, torch.Tensor] | None = None) -> SyncManifest:
        tensors, trainable = weight_tensors(model, state)
        prints = {n: fingerprint(t) for n, t in tensors.items() if n not in trainable}
        delta = not full and self.version is not None
        names = [n for n in tensors if not delta or n in trainable or prints[n] != self._fingerprints.get(n)]
        manifest = layout(tensors, names, self.bucket_bytes, version, self.version if delta else None)
        self.version, self._fingerprints = version, prints
        return manifest

    def pack(self, model: torch.nn.Module, manifest: SyncManifest,
             state: dict[str, torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
        """The buckets in order, in two staging buffers used in turn: a bucket's buffer is written
        again two buckets later, so a transport must finish sending a bucket before asking for the
        one after the next."""
        tensors, _ = weight_tensors(model, state)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        biggest = max(manifest.bucket_sizes, default=0)
        staging = [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(min(2, len(manifest.bucket_sizes)))]
        by_bucket = _by_bucket(manifest)
        for i, size in enumerate(manifest.bucket_sizes):
            buf = staging[i % 2][:size]
            for e in by_bucket[i]:
                buf[e.offset:e.offset + e.nbytes].copy_(_raw_bytes(tensors[e.name])[e.start:e.start + e.nbytes])
            yield buf


class WeightReceiver:
    """Rollout side: checks a manifest against the model and the version held, and copies bucket
    bytes into the model's own tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        tensors, _ = weight_tensors(model)
        for name, p in model.named_parameters(remove_duplicate=False):  # tied weights under every name
            tensors.setdefault(name, p.detach())
        self.tensors = tensors

    def check(self, manifest: SyncManifest, held_version: int) -> None:
        if manifest.base_version is not None and manifest.base_version != held_version:
            raise WeightVersionError(
                f"weight sync refused: the update to version {manifest.version} only carries what changed since "
                f"version {manifest.base_version}, but this worker holds version {held_version}; send a full sync")
        for e in manifest.entries:
            mine = self.tensors.get(e.name)
            if mine is None:
                raise ValueError(f"weight sync: the receiving model has no tensor {e.name!r} (different model specs?)")
            if tuple(mine.shape) != e.shape or str(mine.dtype).removeprefix("torch.") != e.dtype:
                raise ValueError(f"weight sync: {e.name!r} is {e.dtype} {list(e.shape)} in the update, "
                                 f"{mine.dtype} {list(mine.shape)} in the receiving model")
            if not mine.is_contiguous():
                raise ValueError(f"weight sync: {e.name!r} is not contiguous in the receiving model")

    def unpack(self, manifest: SyncManifest, index: int, bucket: torch.Tensor) -> None:
        for e in _by_bucket(manifest)[index]:
            mine = self.tensors[e.name].view(-1).view(torch.uint8)  # writes go to the tensor itself
            mine[e.start:e.start + e.nbytes].copy_(bucket[e.offset:e.offset + e.nbytes])


def receive_state(ticket: SyncTicket) -> dict[str, torch.Tensor]:
    """A whole object-store sync as a state dict, for engines that take one (vLLM, transformers): a
    tensor held in one bucket is a read-only view of the object store's copy (no copy is made on this
    node), one cut over buckets is put together. A delta would leave tensors out: refused."""
    manifest, buckets = ObjectStoreTransport().receive(ticket, torch.device("cpu"))
    if manifest.base_version is not None:
        raise WeightVersionError(f"weight sync refused: version {manifest.version} carries only what changed "
                                 f"since version {manifest.base_version}; an engine that takes a state dict "
                                 f"needs a full sync")
    pieces: dict[str, list[TensorEntry]] = {}
    for e in manifest.entries:
        pieces.setdefault(e.name, []).append(e)
    held = list(buckets)  # the state's views keep these (the object store's memory) alive
    state = {}
    for name, entries in pieces.items():
        e = entries[0]
        dtype = getattr(torch, e.dtype)
        if len(entries) == 1:
            raw = held[e.bucket][e.offset:e.offset + e.nbytes]
        else:
            raw = torch.empty(sum(p.nbytes for p in entries), dtype=torch.uint8)
            for p in entries:
                raw[p.start:p.start + p.nbytes] = held[p.bucket][p.offset:p.offset + p.nbytes]
        state[name] = raw.view(dtype).view(e.shape)
    return state


def _by_bucket(manifest: SyncManifest) -> list[list[TensorEntry]]:
    out: list[list[TensorEntry]] = [[] for _ in manifest.bucket_sizes]
    for e in manifest.entries:
        out[e.bucket].append(e)
    return out


# ---- transports ----------------------------------------------------------------------------------
class Transport(abc.ABC):
    @abc.abstractmethod
    def send(self, manifest: SyncManifest, buckets: Iterator[torch.Tensor]) -> SyncTicket:
        """Sender: deliver the manifest's buckets (packed lazily by `buckets`)."""

    @abc.abstractmethod
    def receive(self, ticket: SyncTicket | None, device: torch.device) -> tuple[SyncManifest, Iterator[torch.Tensor]]:
        """Receiver: the manifest, then its buckets in order on `device`. A receiver that refuses the
        manifest must still exhaust the iterator (a broadcast needs every member)."""

    def close(self) -> None:
        pass


class ObjectStoreTransport(Transport):
    """Buckets as Ray objects (uint8 arrays, copied into the object store as they are put)."""

    def send(self, manifest: SyncManifest, buckets: Iterator[torch.Tensor]) -> SyncTicket:
        refs = tuple(ray.put(b.cpu().numpy()) for b in buckets)
        return SyncTicket(manifest, refs)

    def receive(self, ticket: SyncTicket | None, device: torch.device) -> tuple[SyncManifest, Iterator[torch.Tensor]]:
        if ticket is None or ticket.refs is None:
            raise ValueError("object-store weight sync needs the sender's ticket (manifest and bucket references)")

        def buckets() -> Iterator[torch.Tensor]:
            for ref in ticket.refs:
                with warnings.catch_warnings():  # the object store's arrays are read-only; we only read
                    warnings.simplefilter("ignore", UserWarning)
                    yield torch.from_numpy(ray.get(ref)).to(device)

        return ticket.manifest, buckets()


class BroadcastTransport(Transport):
    """torch.distributed broadcast from rank 0 over a process group of its own."""

    def __init__(self, spec: SyncSpec, rank: int, device: torch.device, store: dist.Store | None = None) -> None:
        if store is None and (spec.host is None or spec.port is None):
            raise ValueError("broadcast weight sync needs the rendezvous address (SyncSpec.host/port)")
        timeout = timedelta(seconds=spec.timeout_s)
        self.rank, self.world_size = rank, spec.world_size
        self.device = device if spec.backend == "nccl" else torch.device("cpu")
        if spec.backend == "nccl" and device.type != "cuda":
            raise ValueError(f"broadcast over NCCL needs a CUDA device, this member is on {device}")
        if store is None:
            store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout)
        store = dist.PrefixStore("weight_sync", store)
        if spec.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, spec.world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)

    def _broadcast(self, tensor: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.group.broadcast([tensor], opts)

    def send(self, manifest: SyncManifest, buckets: Iterator[torch.Tensor]) -> SyncTicket:
        head = torch.frombuffer(bytearray(pickle.dumps(manifest)), dtype=torch.uint8).to(self.device)
        self._broadcast(torch.tensor([head.numel()], dtype=torch.int64, device=self.device)).wait()
        self._broadcast(head).wait()
        pending: deque = deque()
        for bucket in buckets:
            pending.append(self._broadcast(bucket.to(self.device)))
            if len(pending) == 2:  # the packer reuses this bucket's buffer next
                pending.popleft().wait()
        while pending:
            pending.popleft().wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return SyncTicket(manifest, None)

    def receive(self, ticket: SyncTicket | None, device: torch.device) -> tuple[SyncManifest, Iterator[torch.Tensor]]:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length).wait()
        head = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(head).wait()
        manifest: SyncManifest = pickle.loads(head.cpu().numpy().tobytes())
        return manifest, self._receive_buckets(manifest, device)

    def _receive_buckets(self, manifest: SyncManifest, device: torch.device) -> Iterator[torch.Tensor]:
        biggest = max(manifest.bucket_sizes, default=0)
        bufs = [torch.empty(biggest, dtype=torch.uint8, device=self.device) for _ in range(2)]
        pending = None
        for i, size in enumerate(manifest.bucket_sizes):
            view = bufs[i % 2][:size]  # its last bucket (i - 2) was unpacked before we came back here
            work = self._broadcast(view)
            if pending is not None:
                pending[0].wait()
                yield pending[1].to(device)
            pending = (work, view)
        if pending is not None:
            pending[0].wait()
            yield pending[1].to(device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()


# ---- actor side ----------------------------------------------------------------------------------
class WeightSource:
    """In the learner (rank 0): plans, packs and sends each sync."""

    def __init__(self, spec: SyncSpec, device: torch.device) -> None:
        self.sender = WeightSender(spec.bucket_bytes)
        self.device = device
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.transport: Transport | None = None
        if spec.transport == "object_store":
            self.spec = spec
            self.transport = ObjectStoreTransport()
            self._ready.set()
            return
        # rank 0 hosts the rendezvous store; joining the group waits for every member, so it runs
        # in a thread while the driver asks the workers to join
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self._store = dist.TCPStore(host, 0, spec.world_size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=spec.timeout_s))
        self.spec = replace(spec, host=host, port=self._store.port)
        threading.Thread(target=self._join, daemon=True).start()

    def _join(self) -> None:
        try:
            self.transport = BroadcastTransport(self.spec, 0, self.device, self._store)
        except BaseException as exc:  # reported at the next push
            self._error = exc
        finally:
            self._ready.set()

    def push(self, model: torch.nn.Module, version: int, full: bool = False,
             state: dict[str, torch.Tensor] | None = None) -> SyncTicket:
        if not self._ready.wait(self.spec.timeout_s) or self._error is not None:
            raise RuntimeError(f"weight sync: the learner could not join the broadcast group: {self._error}")
        manifest = self.sender.plan(model, version, full, state)
        return self.transport.send(manifest, self.sender.pack(model, manifest, state))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class WeightSink:
    """In a rollout worker (rank >= 1 for the broadcast): receives syncs into the engine's model."""

    def __init__(self, spec: SyncSpec, rank: int, device: torch.device) -> None:
        self.device = device
        self.transport: Transport = (ObjectStoreTransport() if spec.transport == "object_store"
                                     else BroadcastTransport(spec, rank, device))

    def take(self, model: torch.nn.Module, ticket: SyncTicket | None, held_version: int) -> SyncManifest:
        """Blocking: receive one sync into `model` (which holds `held_version`)."""
        manifest, buckets = self.transport.receive(ticket, self.device)
        receiver = WeightReceiver(model)
        try:
            receiver.check(manifest, held_version)
        except (WeightVersionError, ValueError):
            for _ in buckets:  # the other members of a broadcast still need this one
                pass
            raise
        with torch.no_grad():
            for i, bucket in enumerate(buckets):
                receiver.unpack(manifest, i, bucket)
        return manifest

    async def pull(self, engine, ticket: SyncTicket | None) -> int:
        """Into a rollout engine, between two of its forward passes; returns the version now held."""

        def load(model: torch.nn.Module) -> int:
            return self.take(model, ticket, engine.version).version

        await engine.load_weights_with(load)
        return engine.version

    def close(self) -> None:
        self.transport.close()


# ---- driver side ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SyncReport:
    version: int
    full: bool
    bytes: int
    buckets: int
    tensors: int
    seconds: float


class ActorSource:
    """A Ray actor with `open_weight_sync(spec)` and `push_weights(version, full)` methods (a
    WeightSource inside) as the source the driver functions below take; rl.learner.group's
    LearnerGroup is one natively."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def open_weight_sync(self, spec: SyncSpec) -> SyncSpec:
        return ray.get(self.actor.open_weight_sync.remote(spec))

    def push_weights(self, version: int, full: bool = False):
        return self.actor.push_weights.remote(version, full)


def open_weight_sync(learner, workers: list, spec: SyncSpec) -> SyncSpec:
    """Set up the transport in the learner (a LearnerGroup or an ActorSource) and every worker; for
    the broadcast, the group of the learner (rank 0) and the workers (ranks 1..N)."""
    spec = replace(spec, world_size=1 + len(workers))
    spec = learner.open_weight_sync(spec)
    ray.get([w.open_weight_sync.remote(spec, i + 1) for i, w in enumerate(workers)])
    return spec


def sync_weights(spec: SyncSpec, learner, workers: list, version: int, full: bool = False) -> SyncReport:
    """One sync, learner -> every worker; raises the first worker's error (WeightVersionError when
    a worker does not hold the version a delta builds on)."""
    started = time.perf_counter()
    push = learner.push_weights(version, full)
    # broadcast: every member takes part at once (the manifest comes over the group); object store:
    # Ray hands the workers the ticket once the learner has put the buckets
    pulls = [w.pull_weights.remote(None if spec.transport == "broadcast" else push) for w in workers]
    ticket = ray.get(push)
    ray.wait(pulls, num_returns=len(pulls))  # every worker done (or refused) before an error is raised
    ray.get(pulls)
    m = ticket.manifest
    return SyncReport(version, m.base_version is None, m.nbytes, len(m.bucket_sizes), len({e.name for e in m.entries}),
                      time.perf_counter() - started)


