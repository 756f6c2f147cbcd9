"""Run configuration: YAML file + dotted command-line overrides, validated before anything starts.

Every section forbids unknown keys, so a typo fails at once with the key's dotted path. Numbers are
finite, never booleans, and bounded; the model's preset and overrides are checked against the
model's config. Any input fails as one ConfigError line: no traceback, no hang.
"""
from __future__ import annotations

import copy
import difflib
import functools
import importlib.util
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from policy.config import PRESETS, ModelConfig, get_config
from kimi_vocab.effort import EFFORT_LEVELS
from rl.rollout.cache_budget import check_cache_gib
from sandbox import SandboxSpec

# Upper bounds: far above any real run, low enough that a typo (10^30, a few extra zeros) fails
# here rather than as an allocation or an endless loop minutes in
MAX_CPUS = 1 << 16
MAX_GPUS = 4096
MAX_WORKERS = 4096  # processes of one kind
MAX_ITEMS = 1 << 20  # groups, samples, tasks, slots, sandboxes; a model dimension
MAX_TOKENS = 1 << 24  # a context, a budget, a batch
MAX_STEPS = 10**7
MAX_GIB = 1 << 16
MAX_PLAIN_INT = 1 << 53  # an integer in a free-form mapping (env kwargs, sandbox): still exact as a JSON number
# the YAML a config may be: a run config is a few hundred lines
MAX_CONFIG_BYTES = 1 << 20
MAX_DEPTH = 32  # levels of nesting
MAX_NODES = 100_000  # values, every alias expanded: an anchor bomb ("billion laughs") stops here

_BREAKS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")  # what str.splitlines splits at, and other controls


def one_line(text: str) -> str:
    """`text` with line breaks and control characters escaped: whatever a key or a file name holds,
    an error stays one line."""
    return _BREAKS.sub(lambda m: repr(m.group())[1:-1], text)


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the key."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


def _numeric(annotation: Any) -> bool:
    """Whether an annotation admits only numbers (and None), wherever it holds a value."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _numeric(args[0])
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return bool(rest) and all(_numeric(a) for a in rest)
    if origin is dict:
        return _numeric(args[1])
    if origin in (list, tuple):
        return bool(args) and all(_numeric(a) for a in args if a is not Ellipsis)
    return annotation in (int, float)


def _holds_bool(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(item, bool) for item in items)


def _plain(value: Any, where: str = "") -> None:
    """Raise ValueError unless `value` is plain data: strings, finite numbers, booleans, null, lists and
    mappings with string keys; what config.yaml can hold again and an actor can be handed."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"key {key!r}{f' in {where!r}' if where else ''} is not a string")
            _plain(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _plain(item, f"{where}.{i}" if where else str(i))
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where!r} should be a finite number, got {value}")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_PLAIN_INT:
        raise ValueError(f"{where!r} should be at most 2**53 in size, got {_short(value)}")
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise ValueError(f"{where!r} holds a {type(value).__name__}, not a config value (quote it for a string)")


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: Any) -> str:
    try:
        return _clip(repr(value))
    except ValueError:  # an integer past Python's 4300 digits
        return "a number too long to print"


class Section(BaseModel):
    # inf and nan are never a setting: every float is finite
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic takes true for 1 and false for 0; a NUL in a path or name fails only where the OS reads it
        if _holds_bool(value) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError("Input should be a number, not a boolean")
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("Input should not hold a NUL character")
        return value


class RayConfig(Section):
    address: str | None = None  # None: start a local cluster; "auto" or "ray://host:port": join one
    num_cpus: int | None = Field(default=None, ge=1, le=MAX_CPUS)  # a local cluster's CPUs (None: the machine's)
    temp_dir: str | None = None  # a local cluster's: defaults to $RL_HOME/ray (RL_HOME unset: <repo>/.cache/ray)
    # whether every node reads the driver's paths (a shared filesystem, or the same container image):
    # false sends the directories actors need (tokenizer, model) through Ray's object store and brings
    # the learner's checkpoint files back to the driver's node (rl/shipping.py)
    shared_filesystem: bool = False


class ResourcesConfig(Section):
    """GPUs for the policy's actors (rl.placement). All zero, the default: everything on CPU.

    Separate (colocate: false): the learner holds `learner_gpus` GPUs and each rollout worker its
    own `rollout_gpus` (a fraction packs workers on one GPU: 0.5 puts two on each). Colocated
    (colocate: true): rollout workers have no GPUs of their own; they are spread over the
    learner's GPUs and share their memory with the learner. In a synchronous run
    (rollout.max_staleness 0) the native engines free their caches before each learner step and
    allocate them again for the next groups (memory/rollout_cache_released_mb), unless
    `release_rollout_caches` is false: a cache allocated again has new addresses, so the engines
    capture their CUDA graphs again, which a GPU with room for both can skip. Asynchronous rollouts
    run through the learner step, so their engines keep their caches: size rollout.cache_gib,
    cache_tokens or gpu_memory_fraction to leave the learner room. Weights then cannot travel over
    NCCL (one GPU cannot be two NCCL ranks)."""

    learner_gpus: int = Field(default=0, ge=0, le=MAX_GPUS)  # one DeepSpeed rank per GPU
    # the learner's DeepSpeed ranks (data parallel; train.expert_parallel of them share the experts):
    # None means one per learner GPU, or one CPU process without GPUs
    learner_ranks: int | None = Field(default=None, ge=1, le=MAX_GPUS)
    rollout_gpus: float = Field(default=0.0, ge=0, le=64)  # per rollout worker
    colocate: bool = False  # rollout workers on the learner's GPUs (then rollout_gpus is 0)
    release_rollout_caches: bool = True  # colocated, synchronous: free the engines' caches for each learner step
    # custom Ray resources each learner rank / rollout worker also asks for (e.g. {"learner_node": 1} to
    # keep the learner on the nodes started with `ray start --resources '{"learner_node": 8}'`)
    learner_resources: dict[str, float] = Field(default_factory=dict)
    rollout_resources: dict[str, float] = Field(default_factory=dict)
    # the same for environment workers: their sandboxes need a node with the sandbox backend (bubblewrap
    # or Docker)
    env_resources: dict[str, float] = Field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return self.learner_ranks or max(self.learner_gpus, 1)

    @model_validator(mode="after")
    def _coherent(self) -> "ResourcesConfig":
        if self.learner_gpus and self.learner_ranks not in (None, self.learner_gpus):
            raise ValueError(f"learner_ranks={self.learner_ranks}: with learner_gpus={self.learner_gpus} the "
                             f"learner runs one rank per GPU; leave learner_ranks out or make it equal")
        if self.rollout_gpus > 1 and self.rollout_gpus != int(self.rollout_gpus):
            raise ValueError(f"rollout_gpus={self.rollout_gpus}: above 1, a worker takes whole GPUs")
        if self.colocate and self.learner_gpus == 0:
            raise ValueError("colocate=true shares the learner's GPUs with the rollout workers: set learner_gpus >= 1")
        if self.colocate and self.rollout_gpus:
            raise ValueError(f"colocate=true: rollout workers use the learner's GPUs, so rollout_gpus must be 0, "
                             f"got {self.rollout_gpus}")
        return self


class ModelSection(Section):
    preset: str = "toy"  # policy.config.PRESETS
    overrides: dict[str, Any] = Field(default_factory=dict)  # fields of policy.config.ModelConfig
    vocab_size: int = Field(default=512, ge=300, le=MAX_ITEMS)  # BPE vocabulary trained on the environments' text
    init_from: str | None = None  # a save_pretrained directory to start from
    # a transformers causal LM directory (e.g. `rl model import smollm2`): the policy, its tokenizer
    # and chat template instead of a preset and a trained BPE tokenizer
    hf_path: str | None = None

    def shapes(self) -> ModelConfig:
        """The preset with its overrides, at the vocabulary the tokenizer is trained to (rl.cluster.model_spec)."""
        return get_config(self.preset, **{**self.overrides, "vocab_size": self.vocab_size})

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown preset {value!r}; known: {', '.join(PRESETS)}")
        return value

    @field_validator("overrides")
    @classmethod
    def _model_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        fields = _model_field_types()
        for key, item in value.items():
            if key == "vocab_size":
                raise ValueError("'vocab_size' is the tokenizer's: set model.vocab_size")
            if key not in fields:
                close = difflib.get_close_matches(key, list(fields), n=1)
                raise ValueError(f"unknown model field {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
            try:
                fields[key].validate_python(item)
            except ValidationError as exc:
                raise ValueError(f"{key!r}: {exc.errors()[0]['msg']}, got {_short(item)}") from None
            if isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_ITEMS:
                raise ValueError(f"{key!r}: should be at most {MAX_ITEMS:,} in size, got {_short(item)}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if self.hf_path and self.init_from:
            raise ValueError("give model.hf_path (a transformers model) or model.init_from (our checkpoint), not both")
        if self.hf_path and self.overrides:
            raise ValueError("model.overrides shape our presets; a transformers policy (model.hf_path) has its own "
                             "config.json")
        return self

    @model_validator(mode="after")
    def _a_valid_model(self) -> "ModelSection":
        # the model config's own checks (head and expert counts, layer types...) now, not in the learner
        if not self.hf_path:
            try:
                self.shapes()
            except (ValueError, TypeError) as exc:  # policy.config.ConfigError is a ValueError
                raise ValueError(f"model.overrides make no valid model: {exc}") from None
        return self


@functools.cache
def _model_field_types() -> dict[str, TypeAdapter]:
    """Each ModelConfig field's type, checked strictly: no boolean for a number, no string for either."""
    strict = ConfigDict(strict=True, allow_inf_nan=False)
    return {name: TypeAdapter(hint, config=strict) for name, hint in typing.get_type_hints(ModelConfig).items()}


class VLLMSection(Section):
    """rollout.engine: vllm (rl.rollout.vllm_engine.VLLMEngine)."""

    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"  # the dtype vLLM serves the model in
    # the longest sequence vLLM holds (prompt and generation), tokens
    max_model_len: int = Field(default=4096, ge=64, le=MAX_TOKENS)
    max_num_seqs: int = Field(default=64, ge=1, le=MAX_ITEMS)  # sequences vLLM decodes at once
    kv_cache_gib: int = Field(default=1, ge=1, le=MAX_GIB)  # on CPU: VLLM_CPU_KVCACHE_SPACE (whole GiB)
    memory_fraction: float = Field(default=0.05, gt=0, le=1)  # on CPU: the share of RAM vLLM reserves
    verify_every_update: bool = True  # probe logprobs after each weight update (MoE reloads drift on CPU)
    # false: vLLM compiles its forward (torch.compile) at start: SmolLM2 on two cores decodes 1.2x faster in
    # bfloat16, for ~40 s more at every engine build
    enforce_eager: bool = True


class EnvEntry(Section):
    # an environment, a family's domain (`math:add-9x2`) or a pattern over domains (`math:*`, `lookup:keys-*`):
    # load_config turns a pattern into one entry per domain (envs.families)
    name: str
    weight: float = Field(default=1.0, gt=0)  # each domain's, for a pattern
    share: float | None = Field(default=None, gt=0)  # a pattern's weight, split evenly over its domains
    kwargs: dict[str, Any] = Field(default_factory=dict)  # the environment's constructor arguments (its knobs)
    sandbox: dict[str, Any] | None = None  # overrides fields of the environment's SandboxSpec

    @model_validator(mode="after")
    def _share_of_a_pattern(self) -> "EnvEntry":
        if self.share is not None and not any(c in self.name for c in "*?["):
            raise ValueError(f"share splits a pattern's weight over its domains; {self.name!r} is one "
                             f"environment: give it a weight")
        if self.share is not None and "weight" in self.model_fields_set:
            raise ValueError("give a pattern a weight (each of its domains) or a share (all of them), not both")
        return self

    @field_validator("kwargs", "sandbox")
    @classmethod
    def _plain_data(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # checked against the environment's constructor by envs.registry.check_kwargs (rl.trainer.train)
        _plain(value)
        return value

    @field_validator("sandbox")
    @classmethod
    def _sandbox_spec(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            SandboxSpec.from_dict(value)  # a bad key or value fails here, naming it
        return value


class LevelShaping(Section):
    """Length shaping of one effort level's rewards, applied by the learner (rl/shaping.py) to the
    verifier's reward before advantages; it only ever lowers a reward."""

    # DAPO's soft overlong penalty against the level's budget B: none up to B - overlong_buffer tokens,
    # then linear down to -overlong_penalty at B (0: off)
    overlong_buffer: int = Field(default=0, ge=0, le=MAX_TOKENS)
    overlong_penalty: float = Field(default=0.0, ge=0, le=1)
    # -length_cost x (tokens / B) for every episode: short answers at a low level
    length_cost: float = Field(default=0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _never_a_verdict(self) -> "LevelShaping":
        # a reward of 1 (passed) must stay above 0 (failed) whatever the length: no verdict is bought with tokens
        if self.overlong_penalty + self.length_cost >= 1:
            raise ValueError(f"overlong_penalty + length_cost must stay below 1 (a pass's reward over a fail's), "
                             f"got {self.overlong_penalty} + {self.length_cost}")
        if self.overlong_penalty > 0 and self.overlong_buffer == 0:
            raise ValueError("overlong_penalty needs an overlong_buffer (the tokens before the budget it ramps over)")
        return self


class EffortConfig(Section):
    # Tokens the model may generate over a whole episode at each effort level: reasoning and response,
    # every turn (the rollout worker caps each turn at what the episode has left; rl/rollout/worker.py).
    budgets: dict[str, Annotated[int, Field(gt=0, le=MAX_TOKENS)]] = Field(
        default_factory=lambda: {"low": 48, "medium": 96, "high": 192, "max": 320})
    # how often the scheduler draws each level (relative; 0: never)
    weights: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=lambda: {lvl: 1.0 for lvl in EFFORT_LEVELS})
    # tokens of a budget kept back for an answer: reasoning cut off by the budget is closed by the worker
    # and the model answers within them (the turn counts as forced); 0: reasoning cut off by the budget
    # ends the episode, truncated
    answer_reserve: int = Field(default=0, ge=0, le=MAX_TOKENS)
    # length shaping per level (levels left out: none), logged per level as shaping/<level>/*
    shaping: dict[str, LevelShaping] = Field(default_factory=dict)

    @field_validator("budgets", "weights", "shaping")
    @classmethod
    def _known_levels(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        unknown = set(value) - set(EFFORT_LEVELS)
        if unknown:
            raise ValueError(f"unknown effort level {sorted(unknown)[0]!r}, expected one of {list(EFFORT_LEVELS)}")
        if not value and info.field_name != "shaping":
            raise ValueError("at least one effort level is needed")
        return value

    @model_validator(mode="after")
    def _weights_have_budgets(self) -> "EffortConfig":
        missing = [lvl for lvl, w in self.weights.items() if w > 0 and lvl not in self.budgets]
        if missing:
            raise ValueError(f"effort level {missing[0]!r} has a weight but no budget")
        if not any(w > 0 for w in self.weights.values()):
            raise ValueError(f"effort.weights: at least one level needs a weight > 0, got {self.weights}")
        for lvl, budget in self.budgets.items():
            if self.answer_reserve >= budget:
                raise ValueError(f"answer_reserve ({self.answer_reserve}) must be below every level's budget "
                                 f"({lvl}: {budget})")
            buffer = self.shaping[lvl].overlong_buffer if lvl in self.shaping else 0
            if buffer >= budget:
                raise ValueError(f"shaping.{lvl}.overlong_buffer ({buffer}) must be below the level's budget ({budget})")
        return self


class AdaptiveSamplingConfig(Section):
    """rl/rollout/adaptive.py: domains drawn by their training pass rate (off: the configured weights)."""

    enabled: bool = False  # off: domains are drawn by their configured weights
    low: float = Field(default=0.1, gt=0, lt=1)  # the useful band of pass rates: [low, high]
    high: float = Field(default=0.9, gt=0, lt=1)
    floor: float = Field(default=0.2, gt=0, le=1)  # the least factor on a domain's configured weight
    min_samples: float = Field(default=16.0, gt=0, le=MAX_ITEMS)  # decayed samples before a domain's rate counts
    decay: float = Field(default=0.8, gt=0, le=1)  # a domain's history, kept at each batch that holds it

    @model_validator(mode="after")
    def _a_band(self) -> "AdaptiveSamplingConfig":
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class RolloutConfig(Section):
    num_workers: int = Field(default=2, ge=1, le=MAX_WORKERS)  # rollout workers (Ray actors), one engine each
    # environment workers (Ray actors): the environments, their sandboxes and graders
    env_workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    groups_per_step: int = Field(default=8, ge=1, le=MAX_ITEMS)  # (prompt, effort) groups per training step
    group_size: int = Field(default=4, ge=2, le=MAX_ITEMS)  # samples per group (GRPO's G)
    temperature: float = Field(default=1.0, gt=0)  # sampling temperature; the learner scores at the same one
    # The learner scores tokens under the full (temperature-scaled) distribution, so a truncated
    # sampler would bias the importance ratio: training samples with top_p = 1 (evaluation may not).
    top_p: float = Field(default=1.0, gt=0, le=1)
    # an episode's tokens, prompt and tool results included
    max_context: int = Field(default=32768, ge=16, le=MAX_TOKENS)
    record_routing: bool = True  # routing replay: the learner reuses the experts chosen while sampling
    worker_cpus: float = Field(default=0.5, gt=0, le=MAX_CPUS)  # CPUs Ray reserves for each rollout worker
    max_retries: int = Field(default=3, ge=0, le=1000)  # re-issues of a group whose worker died or environment raised
    # asynchronous training: rollout runs up to this many policy versions ahead of the learner
    # (0: synchronous, every sample from the weights it is trained against)
    max_staleness: int = Field(default=0, ge=0, le=1000)
    drop_uniform_groups: bool = True  # groups whose rewards all agree carry no signal: drop, draw more
    adaptive: AdaptiveSamplingConfig = Field(default_factory=lambda: AdaptiveSamplingConfig())
    max_draws_per_step: float = Field(default=4.0, ge=1.0, le=1000)  # x groups_per_step: cap on drawing replacements
    # groups one worker plays at once (continuous batching)
    groups_per_worker: int = Field(default=8, ge=1, le=MAX_ITEMS)
    # each environment worker's sandboxes: started ahead of demand, so that an episode never waits for
    # one (a group opens all its members' at once, and a cold start takes ~60 ms on an idle CPU, more
    # beside busy engines: the demo's shell episodes waited 5-8 s each to start with 8 warm); None: as
    # many as the rollout plays at once (num_workers x groups_per_worker x group_size over env_workers),
    # at most max_sandboxes, the live sandboxes an environment worker may hold
    warm_sandboxes: int | None = Field(default=None, ge=0, le=MAX_ITEMS)
    max_sandboxes: int = Field(default=64, ge=1, le=MAX_ITEMS)
    # the native engine's memory: sequences in cache slots (each with its KDA state), latent keys in
    # blocks of the cache shared by all slots. Size the keys by tokens (cache_tokens) or by memory
    # (cache_gib: the slots' state first, then as many blocks as fit; it must hold one max_context
    # sequence), not both; neither: 131072 tokens on a CPU, and on a GPU gpu_memory_fraction (default
    # 0.9) of the memory free once the model is loaded, times the worker's Ray GPU share (colocated
    # workers share 0.5 of the GPU, so they take 0.45 of it in all; two packed workers 0.45 each),
    # never more than max_slots sequences of max_context tokens
    max_slots: int = Field(default=64, ge=1, le=MAX_ITEMS)
    cache_tokens: int | None = Field(default=None, ge=64, le=1 << 36)
    cache_gib: float | None = Field(default=None, gt=0, le=MAX_GIB)
    gpu_memory_fraction: float | None = Field(default=None, gt=0, le=1)
    # prefill tokens per forward (longer inputs in chunks)
    max_batch_tokens: int = Field(default=2048, ge=16, le=MAX_TOKENS)
    # native engine on a GPU: decode steps at fixed shapes, each captured once as a CUDA graph and replayed
    cuda_graphs: bool = True
    # native engine on a GPU: each step launched before the last one's tokens are read back (the host's
    # scheduling overlaps the GPU's step; turns end one step later); steps on a CPU run in order anyway
    overlap_decode: bool = True
    # native engine: inputs of at most this many tokens (tool results) join the decode batch a token a
    # step instead of a prefill forward of their own (eager on a GPU: ~0.1 s of launches for `small`);
    # meant for CUDA graphs; in configs/gpu_small.yaml's pipeline on an H200, 32 made rollout slower (each
    # result takes a decode step per token; benchmarks/RESULTS.md), so 0 (off)
    decode_feed_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    # native engine with CUDA graphs (ignored elsewhere): inputs of 2 to this many tokens (tool results)
    # are prefilled by a graph of their padded shape too, instead of an eager forward's launches. In
    # configs/gpu_small.yaml's pipeline on an H200, 64 made rollout 1.28x faster in steps 1-3 (1.59x over
    # steps 1-7 across two calls; the engines then wait on the GPU, not on launches; benchmarks/RESULTS.md);
    # 0 turns it off
    prefill_graph_tokens: int = Field(default=64, ge=0, le=256)
    # native engine: the fixed-shape decode step compiled by torch.compile (one graph, symbolic batch
    # and key length: two compiles per engine). On a CPU 1.15-1.7x on steady decode benchmarks, but the
    # demo's first step pays ~2 min of compiling on two cores and later steps gain ~5%; on a GPU the
    # compiled step is what the CUDA graphs capture (its fused kernels: 1.10-1.25x at the Kimi-Linear
    # shape), at ~25-35 s of compiling per engine
    compile_decode: bool = False
    # native engine on a GPU: the fp32 elementwise chains (norms, gates, SiTU-GLU, AttnRes) as compiled
    # kernels (kimi_kernels/fusion.py). On an H200 they cut the engines' GPU time a step 1.45-1.6x in
    # configs/gpu_small.yaml's pipeline and cost ~35 s of compiling per run; KIMI_FUSED_OPS=0 turns
    # them off in every process
    fused_ops: bool = True
    # weight pushes to every engine go in buckets of this size (through the object store)
    sync_bucket_mb: int = Field(default=256, ge=1, le=1 << 20)
    # native: our hybrid policy, continuous batching (rl.rollout.native_engine); vllm: vLLM's own model
    # classes on the policy's Hugging Face checkpoint; transformers: `generate`, the slow baseline
    engine: Literal["native", "vllm", "transformers"] = "native"
    # agentic episodes longer than max_context: "elide_tool_outputs" starts a new segment whose context
    # is the prompt and every turn, tool outputs older than the last `keep_tool_outputs` replaced by a
    # marker (each segment trains on the tokens generated in it; all share the episode's reward)
    context_policy: Literal["none", "elide_tool_outputs"] = "none"
    keep_tool_outputs: int = Field(default=1, ge=0, le=MAX_ITEMS)
    vllm: VLLMSection = Field(default_factory=lambda: VLLMSection())

    @model_validator(mode="after")
    def _training_samples_full_distribution(self) -> "RolloutConfig":
        if self.top_p < 1.0:
            raise ValueError(f"rollout.top_p={self.top_p} is not supported for training: the learner scores the "
                             f"full distribution, so a truncated sampler would bias the importance ratio; use 1.0")
        return self

    @model_validator(mode="after")
    def _one_cache_size(self) -> "RolloutConfig":
        if self.cache_tokens is not None and self.cache_gib is not None:
            raise ValueError(f"give rollout.cache_tokens ({self.cache_tokens}) or rollout.cache_gib "
                             f"({self.cache_gib}), not both")
        if self.gpu_memory_fraction is not None and (self.cache_tokens is not None or self.cache_gib is not None):
            raise ValueError(f"rollout.gpu_memory_fraction ({self.gpu_memory_fraction}) sizes the cache when "
                             f"neither cache_tokens nor cache_gib is given: give one of the three")
        return self

    @model_validator(mode="after")
    def _sandboxes_hold_a_group(self) -> "RolloutConfig":
        if self.max_sandboxes < self.group_size:
            raise ValueError(f"rollout.max_sandboxes={self.max_sandboxes} cannot hold one group's "
                             f"{self.group_size} sandboxes (rollout.group_size)")
        if self.warm_sandboxes is not None and self.warm_sandboxes > self.max_sandboxes:
            raise ValueError(f"rollout.warm_sandboxes={self.warm_sandboxes} is over rollout.max_sandboxes="
                             f"{self.max_sandboxes}")
        return self

    def warm_sandboxes_per_env_worker(self) -> int:
        """warm_sandboxes, or by default room for every episode the rollout plays at once."""
        if self.warm_sandboxes is not None:
            return self.warm_sandboxes
        at_once = self.num_workers * self.groups_per_worker * self.group_size
        return min(self.max_sandboxes, -(-at_once // self.env_workers))

    @model_validator(mode="after")
    def _slots_hold_the_groups(self) -> "RolloutConfig":
        if self.groups_per_worker * self.group_size > self.max_slots:
            raise ValueError(f"rollout.groups_per_worker x group_size = {self.groups_per_worker * self.group_size} "
                             f"sequences do not fit rollout.max_slots={self.max_slots}")
        return self


class GraderConfig(Section):
    num_workers: int = Field(default=1, ge=1, le=MAX_WORKERS)  # grader actors (Ray) in each grader pool
    # a grade taking longer has its actor replaced and is retried
    timeout_s: float = Field(default=30.0, gt=0, le=24 * 3600)
    # retries of a grade that timed out or whose actor died; then it fails with an error
    retries: int = Field(default=1, ge=0, le=1000)


class OffPolicyConfig(Section):
    """Corrections for samples drawn by other weights than the learner's (async training, kernel
    mismatch). proximal: behavior = PPO ratio against the sampler's logprobs; learner = decoupled
    PPO (ratio against the learner's policy at the step's start, each token weighted by
    pi_prox / pi_behaviour, shaped by is_correction: none | tis (capped at is_cap) | mis (zero
    outside is_band; at token level this is IcePop's masking); is_level token | sequence | geometric."""

    proximal: Literal["behavior", "learner"] = "behavior"
    is_correction: Literal["none", "tis", "mis"] = "none"
    is_level: Literal["token", "sequence", "geometric"] = "token"
    is_cap: float = Field(default=2.0, gt=0)
    is_band: tuple[float, float] = (0.5, 2.0)

    @model_validator(mode="after")
    def _coherent(self) -> "OffPolicyConfig":
        if self.is_correction != "none" and self.proximal != "learner":
            raise ValueError(f"is_correction={self.is_correction!r} weights tokens by pi_prox / pi_behaviour: "
                             f"it needs proximal='learner'")
        lo, hi = self.is_band
        if not 0 <= lo < 1 < hi:
            raise ValueError(f"is_band must satisfy 0 <= low < 1 < high, got {list(self.is_band)}")
        return self


Beta = Annotated[float, Field(ge=0, lt=1)]  # an Adam moment's decay


class TrainConfig(Section):
    steps: int = Field(default=20, ge=0, le=MAX_STEPS)  # GRPO steps
    lr: float = Field(default=1e-4, gt=0)  # AdamW's learning rate
    weight_decay: float = Field(default=0.0, ge=0)  # AdamW's weight decay
    betas: tuple[Beta, Beta] = (0.9, 0.99)  # AdamW's moment decays
    adam_eps: float = Field(default=1e-8, gt=0)  # AdamW's epsilon
    grad_clip: float = Field(default=1.0, gt=0)  # the gradient norm clipped to, one coefficient for every parameter
    # the learner's micro-batches: rows packed end to end into one row of at most this many tokens (a
    # longer row alone, never split), the ranks' shares balanced by tokens (rl/learner/batches.py)
    packing: bool = True
    max_tokens_per_micro_batch: int = Field(default=4096, ge=16, le=1 << 22)  # a packed micro-batch's tokens
    # with packing off (or a model that cannot pack): each rank's rows in this many right-padded slices
    micro_batches: int = Field(default=1, ge=1, le=MAX_ITEMS)
    eps_low: float = Field(default=0.2, gt=0, lt=1)  # the ratio's lower clip 1 - eps_low stays above 0
    eps_high: float = Field(default=0.28, gt=0)  # clip-higher
    dual_clip: float | None = Field(default=3.0, gt=1)  # bound on the ratio when the advantage is negative
    kl_coef: float = Field(default=0.0, ge=0)  # off by default; k3 with the ratio correction when on
    # advantage = reward - its group's mean, divided by none (Dr.GRPO), the group's or the batch's sample std
    adv_std_norm: Literal["none", "group", "batch"] = "none"
    # token_mean: over the mini-batch's valid tokens; seq_mean_token_sum: Dr.GRPO's (its sequences times a constant)
    loss_agg: Literal["token_mean", "seq_mean_token_sum"] = "token_mean"
    threads: int = Field(default=2, ge=1, le=1024)  # torch threads in the learner (rollouts idle while it trains)
    # a Hugging Face policy's learner on a CPU: its decoder's matrix products in this dtype (bfloat16:
    # autocast; weights, gradients, AdamW and the head's log-probabilities stay float32). On CPUs with
    # AMX bf16 is several times faster; train/mismatch shows what it costs against the rollout's logprobs
    cpu_matmul_dtype: Literal["float32", "bfloat16"] = "float32"
    zero_stage: int = Field(default=0, ge=0, le=2)  # ZeRO-3 partitions weights; the push reads whole ones
    updates_per_step: int = Field(default=1, ge=1, le=1024)  # optimizer steps per batch (mini-batches of whole groups)
    # recompute each decoder layer's activations in backward instead of storing them (less memory, ~1 more forward)
    activation_checkpointing: bool = False
    # the learner on a GPU: the fused elementwise chains (rollout.fused_ops). Each compiles on its first
    # calls, forward and backward, once per input rank and gradient mode: 77-164 s for `small` on an
    # H200, for 1.0-1.2x on steps of 64 short rows (benchmarks/learner_compile_gpu.py): they pay in long
    # runs and long rows, not in a ten-minute one
    fused_ops: bool = True
    # ranks that split each MoE layer's routed experts among them (1: every rank holds all); divides
    # resources.ranks and the model's expert count; needs zero_stage 1 or 2
    expert_parallel: int = Field(default=1, ge=1, le=MAX_GPUS)
    off_policy: OffPolicyConfig = Field(default_factory=lambda: OffPolicyConfig())


class WarmupConfig(Section):
    steps: int = Field(default=0, ge=0, le=MAX_STEPS)  # supervised steps on the environments' reference solutions
    batch_size: int = Field(default=32, ge=1, le=MAX_ITEMS)  # reference episodes per supervised step
    lr: float = Field(default=3e-3, gt=0)  # the warm-up's learning rate
    # reference episodes per environment for the tokenizer and the warm-up
    tasks_per_env: int = Field(default=200, ge=1, le=MAX_ITEMS)


class EvalConfig(Section):
    tasks_per_env: int = Field(default=32, ge=1, le=MAX_ITEMS)  # held-out tasks per environment, at each effort level
    efforts: list[str] = Field(default_factory=lambda: list(EFFORT_LEVELS), min_length=1)  # the effort levels evaluated
    temperature: float = Field(default=0.0, ge=0)  # 0 = greedy
    samples_per_task: int = Field(default=1, ge=1, le=MAX_ITEMS)  # decoded together, like a GRPO group
    before_and_after: bool = True  # evaluate before RL (after the warm-up) and after it

    @field_validator("efforts")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        for lvl in value:
            if lvl not in EFFORT_LEVELS:
                raise ValueError(f"unknown effort level {lvl!r}, expected one of {list(EFFORT_LEVELS)}")
        if len(set(value)) < len(value):
            raise ValueError("an effort level is listed twice")
        return value


class CheckpointConfig(Section):
    every: int = Field(default=10, ge=1, le=MAX_STEPS)  # GRPO steps between checkpoints (the last step is always saved)
    keep: int = Field(default=2, ge=1, le=1000)  # checkpoints kept in the run folder; older ones are removed
    # a copy of every checkpoint beyond the run folder's: a path or an fsspec URL (s3://bucket/prefix,
    # gs://...), under <dir>/<run name>/step_N; a resumed run takes it from there when the run folder's
    # is missing or torn (rl/checkpoint_store.py)
    dir: str | None = Field(default=None, min_length=1, max_length=1024)

    @field_validator("dir")
    @classmethod
    def _reachable_protocol(cls, value: str | None) -> str | None:
        """An fsspec URL whose protocol's package is installed (s3:// needs s3fs): checked before Ray."""
        if value is not None and "://" in value:
            import fsspec

            protocol = value.split("://", 1)[0]
            try:
                fsspec.get_filesystem_class(protocol)
            except (ImportError, ValueError) as exc:
                raise ValueError(f"{protocol}:// is not usable here: {exc}") from None
        return value


class LoggingConfig(Section):
    # auto: online when logged in to wandb, else offline into RUN_DIR/wandb
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    wandb_project: str = "kimi-rl"  # the wandb project
    # print wandb's own end-of-run history (a sparkline per metric) and summary; the run prints its own
    # short summary either way
    wandb_summary: bool = False
    tensorboard: bool = False  # also write scalars to RUN_DIR/tensorboard (needs the tensorboard package)
    progress: bool = True  # progress bars on a terminal (false, or output to a file or pipe: a line per step)
    # a console warning when a domain's groups all had rewards that agreed (no learning signal) for
    # this many consecutive steps in which it was played (0: never)
    no_signal_steps: int = Field(default=5, ge=0, le=1_000_000)

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, value: bool) -> bool:
        # checked here so a run does not fail minutes in, after the quality gate
        if value and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("needs the tensorboard package: pip install 'kimi-rl[tensorboard]'")
        return value


class GateConfig(Section):
    enabled: bool = True  # check every environment before training (rl env check)
    max_tasks: int = Field(default=8, ge=1, le=MAX_ITEMS)  # tasks checked per split of each environment
    allow_failing: bool = False  # train even when an environment fails the gate
    # Ray actors checking environments at once (None: rollout.env_workers); a passing report is kept under
    # the code, data and settings it was made with, and used again while none of them changes
    workers: int | None = Field(default=None, ge=1, le=MAX_WORKERS)
    cache: bool = True  # keep passing reports in the registry's directory and use them again


class RunConfig(Section):
    name: str = "run"  # the run folder is output_dir/<name>-<time stamp>
    # the same config and seed draw the same tasks, efforts and sampling seeds
    seed: int = Field(default=0, ge=0, lt=1 << 32)
    output_dir: str = Field(default="runs", min_length=1)  # where run folders are made
    ray: RayConfig = Field(default_factory=RayConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    model: ModelSection = Field(default_factory=ModelSection)
    # the environments, domains or patterns over domains to train on, each with its weight
    envs: list[EnvEntry] = Field(default_factory=list, min_length=1, max_length=1000)
    effort: EffortConfig = Field(default_factory=EffortConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    grader: GraderConfig = Field(default_factory=GraderConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    # episodes' sandboxes: docker, process (bubblewrap), or auto: docker when a daemon answers and has the image,
    # else process
    sandbox_backend: Literal["auto", "docker", "process"] = "auto"

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, value: str) -> str:
        # one folder inside output_dir ('../x' or 'a/b' would leave it), of a length every file system takes
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value):
            raise ValueError("a run name is 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value

    @model_validator(mode="after")
    def _engine_serves_the_policy(self) -> "RunConfig":
        if self.model.hf_path and self.rollout.engine == "native":
            raise ValueError("rollout.engine: native serves our hybrid presets; a transformers policy "
                             "(model.hf_path) needs rollout.engine: vllm or transformers")
        if self.rollout.engine != "native" and not self.model.hf_path:
            raise ValueError(f"rollout.engine: {self.rollout.engine} serves a transformers checkpoint "
                             f"(model.hf_path); our hybrid presets run on rollout.engine: native")
        if self.model.hf_path and self.rollout.record_routing:
            raise ValueError("rollout.record_routing: routing replay needs our hybrid policy; set it to false "
                             "for a transformers policy (model.hf_path)")
        return self

    @model_validator(mode="after")
    def _gpu_fraction_on_a_gpu(self) -> "RunConfig":
        fraction = self.rollout.gpu_memory_fraction
        if fraction is not None and self.rollout.engine != "native":
            raise ValueError(f"rollout.gpu_memory_fraction={fraction} sizes the native engine's cache; "
                             f"rollout.engine: {self.rollout.engine} sizes its own")
        if fraction is not None and not (self.resources.rollout_gpus > 0 or self.resources.colocate):
            raise ValueError(f"rollout.gpu_memory_fraction={fraction} sizes a GPU's cache, but the rollout "
                             f"workers run on CPU: give rollout.cache_tokens or cache_gib")
        return self

    @model_validator(mode="after")
    def _compile_native(self) -> "RunConfig":
        if self.rollout.compile_decode and self.rollout.engine != "native":
            raise ValueError(f"rollout.compile_decode is the native engine's; rollout.engine is {self.rollout.engine}")
        return self

    @model_validator(mode="after")
    def _cache_budget_holds_a_sequence(self) -> "RunConfig":
        """rollout.cache_gib checked now against the preset's shapes, not minutes in when an engine is built."""
        if self.rollout.cache_gib is None or self.rollout.engine != "native":
            return self
        on_gpu = self.resources.rollout_gpus > 0 or self.resources.colocate
        check_cache_gib(self.rollout, self.model.shapes(), on_gpu)
        return self

    @model_validator(mode="after")
    def _expert_parallel_fits(self) -> "RunConfig":
        ep, ranks = self.train.expert_parallel, self.resources.ranks
        if ep == 1:
            return self
        if ranks % ep:
            raise ValueError(f"train.expert_parallel={ep} must divide the learner's ranks "
                             f"(resources.learner_ranks / learner_gpus: {ranks})")
        if self.train.zero_stage not in (1, 2):
            raise ValueError(f"train.expert_parallel={ep} needs train.zero_stage 1 or 2 (DeepSpeed then reduces "
                             f"only the replicated parameters), got {self.train.zero_stage}")
        if self.model.hf_path:
            raise ValueError("train.expert_parallel > 1 shards our hybrid's LatentMoE experts; a transformers "
                             "policy (model.hf_path) trains data-parallel only")
        experts = self.model.shapes().num_experts
        if experts % ep:
            raise ValueError(f"train.expert_parallel={ep} must divide the model's {experts} routed experts")
        return self

    @model_validator(mode="after")
    def _unique_envs(self) -> "RunConfig":
        seen: set[str] = set()
        for entry in self.envs:
            if entry.name in seen:
                raise ValueError(f"environment {entry.name!r} is listed twice")
            seen.add(entry.name)
        return self


def _describe(error: dict[str, Any]) -> str:
    path = ".".join(_clip(str(p)) for p in error["loc"]) or "<root>"
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"config error: unknown key '{path}'"
    if kind == "missing":
        return f"config error: '{path}' is required"
    got = error.get("input")
    got_text = f", got {_short(got)}" if not isinstance(got, dict) and got is not None else ""
    message = error["msg"].removeprefix("Value error, ").rstrip(".")
    return f"config error: '{path}': {message}{got_text}"


class _TooLarge(Exception):
    """A YAML document past MAX_DEPTH or MAX_NODES (no YAMLError: an override's value is not then taken as text)."""


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a document nested deeper than MAX_DEPTH, or of more than MAX_NODES
    values once every alias is expanded, before constructing it. PyYAML composes recursively (a few
    hundred levels overflow the stack), and an alias is shared, not copied, until something walks the
    tree (validation, the dump of config.yaml): a few lines of anchors can stand for billions of values."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooLarge(f"is nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: Any) -> Any:
        _measure(node)
        return super().construct_document(node)


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return node.value if isinstance(node, yaml.SequenceNode) else []


def _measure(root: Any) -> None:
    """Raise _TooLarge where the composed document `root`, every alias expanded, holds more than MAX_NODES
    values or nests deeper than MAX_DEPTH, or where an alias refers to a node that contains it. Each node
    is measured once (a depth-first walk without recursion), so the expansion is counted, never made."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    walking: set[int] = set()  # entered, not yet measured: what is popped meanwhile lies inside it
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, inside_done = stack.pop()
        key = id(node)
        if inside_done:
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            walking.discard(key)
            if size[key] > MAX_NODES:
                raise _TooLarge(f"holds more than {MAX_NODES:,} values once its aliases are expanded")
            if depth[key] > MAX_DEPTH:
                raise _TooLarge(f"is nested deeper than {MAX_DEPTH} levels once its aliases are expanded")
        elif key in walking:
            raise _TooLarge("holds an alias to a node that contains it")
        elif key not in size:
            walking.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in _children(node))


def _load_yaml(text: str) -> Any:
    """YAML text as plain data. Raises _TooLarge, yaml.YAMLError, or ValueError / OverflowError (an integer
    past Python's 4300 digits, a date such as 2024-13-45)."""
    return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader


def _index(key: str, node: list[Any]) -> int | None:
    return int(key) if key.isascii() and key.isdigit() and len(key) < 10 and int(key) < len(node) else None


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    if len(keys) > MAX_DEPTH:
        raise ConfigError(f"config error: override key {_clip(dotted)!r} is nested deeper than {MAX_DEPTH} levels")
    node: Any = tree
    for i, key in enumerate(keys):
        where = ".".join(keys[: i + 1])
        if isinstance(node, list):
            index = _index(key, node)
            if index is None:
                raise ConfigError(f"config error: '{_clip(where)}' is not an index of the list")
            if i == len(keys) - 1:
                node[index] = value
                return
            nxt = node[index]
        elif i == len(keys) - 1:
            node[key] = value
            return
        else:
            if key not in node:  # e.g. effort.weights.max=2 edits the default weights, not an empty mapping
                node[key] = _default_mapping(keys[: i + 1])
            nxt = node[key]
        if not isinstance(nxt, (dict, list)):
            raise ConfigError(f"config error: '{_clip(where)}' is a value, not a section")
        node = nxt


def _default_mapping(path: list[str]) -> dict[str, Any]:
    """What a key the config leaves out starts as when an override reaches into it: a copy of the
    field's default where that is a mapping (effort.weights: every level at 1.0), else an empty one
    (a section: validation fills in its defaults)."""
    model: Any = RunConfig
    for i, key in enumerate(path):
        field = getattr(model, "model_fields", {}).get(key)
        if field is None:
            return {}
        if i == len(path) - 1:
            default = field.get_default(call_default_factory=True)
            return copy.deepcopy(default) if isinstance(default, dict) else {}
        model = field.annotation
    return {}


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML (so 3, 1e-4, true, [a, b] work)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config error: override {_short(item)} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"config error: override {_short(item)} has an empty key")
        try:
            value = _load_yaml(raw) if raw != "" else ""
        except _TooLarge as exc:
            raise ConfigError(f"config error: the value of override '{_clip(key)}' {exc}") from None
        except (yaml.YAMLError, ValueError, OverflowError):  # not YAML, or a number too long: the text itself
            value = raw
        _set_dotted(tree, key, value)
    return tree


def validate(tree: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc.errors()[0])) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The run config of a YAML file and dotted overrides; any problem is one ConfigError line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config error: no such file {str(path)!r}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config error: cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config error: {path} is {len(data):,} bytes; a run config is at most {MAX_CONFIG_BYTES:,}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config error: {path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                          f"{exc.start})") from None
    try:
        tree = _load_yaml(text)
    except _TooLarge as exc:
        raise ConfigError(f"config error: {path} {exc}") from None
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config error: {path} is not valid YAML{where}{f': {problem}' if problem else ''}") from None
    except (ValueError, OverflowError) as exc:
        raise ConfigError(f"config error: {path} holds a value YAML cannot read: {exc}") from None
    if tree is None:
        raise ConfigError(f"config error: {path} is empty; a run config lists at least its envs")
    if not isinstance(tree, dict):
        raise ConfigError(f"config error: {path} must hold a mapping at the top level")
    apply_overrides(tree, overrides or [])
    if "envs" not in tree:  # validate() takes partial trees (tests, tools); a run needs its environments
        raise ConfigError("config error: 'envs' is required: list the environments to train on")
    return expand_domains(validate(tree))


def expand_domains(config: RunConfig) -> RunConfig:
    """Entries naming domains by pattern become one entry per domain, each with the entry's weight, or its
    share split evenly (envs.families.expand); a run's saved config.yaml lists every domain."""
    from envs.families import PatternError, Weighted, expand, is_pattern

    if not any(is_pattern(e.name) for e in config.envs):
        return config
    try:
        found = expand([Weighted(e.name, e.weight, e.share, e.kwargs) for e in config.envs])
    except PatternError as exc:
        raise ConfigError(f"config error: 'envs.{exc.index}.name': {exc}") from None
    entries = [{**config.envs[i].model_dump(mode="json"), "name": domain, "weight": weight, "share": None}
               for i, domain, weight in found]
    return validate({**config.model_dump(mode="json"), "envs": entries})


def dump_config(config: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
