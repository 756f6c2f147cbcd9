"""One model configuration for Kimi Linear, K3 and K3.1 style hybrids, plus named presets.

Field names follow the Hugging Face `kimi_linear` / `kimi_k3` text config where one exists, so
that checkpoint.py can map config.json both ways with few renames.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

LayerType = Literal["kda", "mla", "dsa"]
_ACTS = ("silu", "situ")
_KDA_GATES = ("softplus", "lower_bound")
_BALANCE = ("bias", "quantile", "none")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass
class ModelConfig:
    # ---- trunk
    vocab_size: int = 512
    hidden_size: int = 128
    num_hidden_layers: int = 4
    # per-layer mixer; None -> "kda" except every `global_every`-th layer (1-based) and the last
    layer_types: list[str] | None = None
    global_every: int = 4
    global_attn: str = "mla"  # mixer of the global layers when layer_types is derived: "mla" | "dsa"
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2

    # ---- KDA (linear attention)
    linear_num_heads: int = 2  # q/k heads
    linear_num_v_heads: int | None = None  # value heads (grouped); None -> linear_num_heads
    linear_head_dim: int = 64  # K
    linear_v_head_dim: int | None = None  # V; None -> linear_head_dim
    linear_conv_kernel_dim: int = 4
    kda_gate: str = "lower_bound"  # "softplus" (Kimi Linear) | "lower_bound" (K3: lb * sigmoid(...))
    gate_lower_bound: float = -5.0
    use_full_rank_gate: bool = True  # output gate: full-rank g_proj (K3) or g_a/g_b low rank (Kimi Linear)
    kda_allow_neg_eigval: bool = False  # beta = 2 * sigmoid(.) when True

    # ---- MLA / DSA (global attention, NoPE)
    num_attention_heads: int = 2
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16  # NoPE: an unrotated key part shared by all heads (checkpoint layout)
    v_head_dim: int = 32
    mla_use_output_gate: bool = True
    attention_sink: bool = False
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 2048

    # ---- Block Attention Residuals
    attn_res: bool = True
    attn_res_block_size: int = 2

    # ---- FFN / MoE
    first_k_dense_replace: int = 1
    intermediate_size: int = 256  # dense FFN hidden
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    moe_intermediate_size: int = 128  # routed (and per-shared) expert hidden
    routed_expert_hidden_size: int | None = 64  # LatentMoE latent dim l; None -> experts in full dim
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    balance: str = "bias"  # "bias" (sign update) | "quantile" | "none"
    bias_update_rate: float = 1e-3
    hidden_act: str = "situ"  # "silu" (SwiGLU) | "situ" (SiTU-GLU)
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0

    # ---- QK-Clip (after optimizer steps); None disables
    qk_clip_tau: float | None = 100.0

    name: str = "custom"

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers, self.global_every, self.global_attn)
        else:
            self.layer_types = list(self.layer_types)
        self.validate()

    # derived sizes -------------------------------------------------------------------------
    @property
    def num_v_heads(self) -> int:
        return self.linear_num_v_heads or self.linear_num_heads

    @property
    def v_dim(self) -> int:
        return self.linear_v_head_dim or self.linear_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers whose FFN is a routed MoE (the rest are dense)."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe(i)]

    def is_moe(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and self.num_experts > 0

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"ModelConfig: {msg}")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "linear_num_heads", "linear_head_dim",
                  "linear_conv_kernel_dim", "num_attention_heads", "kv_lora_rank", "v_head_dim",
                  "intermediate_size"):
            need(int(getattr(self, f)) > 0, f"{f} must be > 0, got {getattr(self, f)}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}")
        bad = [t for t in self.layer_types if t not in ("kda", "mla", "dsa")]
        need(not bad, f"layer_types entries must be 'kda', 'mla' or 'dsa', got {bad[:3]}")
        need(self.num_v_heads % self.linear_num_heads == 0,
             f"linear_num_heads={self.linear_num_heads} must divide linear_num_v_heads={self.num_v_heads}")
        need(self.kda_gate in _KDA_GATES, f"kda_gate must be one of {_KDA_GATES}, got {self.kda_gate!r}")
        need(self.gate_lower_bound < 0, f"gate_lower_bound must be < 0, got {self.gate_lower_bound}")
        need(self.qk_nope_head_dim + self.qk_rope_head_dim > 0, "qk_nope_head_dim + qk_rope_head_dim must be > 0")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, f"q_lora_rank must be None or > 0, got {self.q_lora_rank}")
        if "dsa" in self.layer_types:
            need(self.index_n_heads > 0 and self.index_head_dim > 0 and self.index_topk > 0,
                 "DSA layers need index_n_heads, index_head_dim and index_topk > 0")
        need(self.attn_res_block_size > 0, f"attn_res_block_size must be > 0, got {self.attn_res_block_size}")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
             f"first_k_dense_replace must be in [0, {self.num_hidden_layers}], got {self.first_k_dense_replace}")
        if self.num_experts > 0:
            need(0 < self.num_experts_per_token <= self.num_experts,
                 f"num_experts_per_token must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_token}")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be > 0")
            need(self.num_shared_experts >= 0, "num_shared_experts must be >= 0")
            need(self.routed_expert_hidden_size is None or self.routed_expert_hidden_size > 0,
                 "routed_expert_hidden_size must be None or > 0")
        need(self.num_experts >= 0, f"num_experts must be >= 0, got {self.num_experts}")
        need(self.balance in _BALANCE, f"balance must be one of {_BALANCE}, got {self.balance!r}")
        need(self.hidden_act in _ACTS, f"hidden_act must be one of {_ACTS}, got {self.hidden_act!r}")
        need(self.activation_situ_beta > 0 and self.activation_situ_linear_beta > 0, "SiTU betas must be > 0")
        need(self.qk_clip_tau is None or self.qk_clip_tau > 0, f"qk_clip_tau must be None or > 0, got {self.qk_clip_tau}")
        for f in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(self, f)
            need(v is None or 0 <= v < self.vocab_size, f"{f}={v} is outside the vocab (size {self.vocab_size})")

    # serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"ModelConfig: unknown fields {unknown}")
        return cls(**d)

    def replace(self, **overrides: Any) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"ModelConfig: unknown fields {unknown}")
        d = self.to_dict()
        # a new layer count re-derives the pattern unless one is given
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            d["layer_types"] = None
        d.update(overrides)
        return ModelConfig(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def default_layer_types(n_layers: int, global_every: int, global_attn: str) -> list[str]:
    """KDA everywhere except every `global_every`-th layer (1-based) and the last layer."""
    if global_attn not in ("mla", "dsa"):
        raise ConfigError(f"ModelConfig: global_attn must be 'mla' or 'dsa', got {global_attn!r}")
    if global_every <= 0:
        raise ConfigError(f"ModelConfig: global_every must be > 0, got {global_every}")
    return [global_attn if ((i + 1) % global_every == 0 or i == n_layers - 1) else "kda" for i in range(n_layers)]


def _toy() -> ModelConfig:
    # ~1-3M params with a few-hundred-token vocab: 3 KDA + 1 gated MLA, MoE after layer 0, AttnRes on.
    return ModelConfig(name="toy")


def _small() -> ModelConfig:
    # ~100M total: a GPU-benchmark shape with every K3.1 feature switched on.
    return ModelConfig(
        name="small", vocab_size=32768, hidden_size=512, num_hidden_layers=12, global_attn="dsa",
        linear_num_heads=4, linear_head_dim=128, num_attention_heads=4, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=128, index_n_heads=4, index_head_dim=64,
        index_topk=2048, attn_res_block_size=4, intermediate_size=2048, num_experts=16,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=256,
        routed_expert_hidden_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _kimi_linear_48b() -> ModelConfig:
    # Public Kimi-Linear-48B-A3B config: MLA on layers 4, 8, ..., 24 and 27 (1-based).
    n = 27
    types = ["mla" if ((i + 1) % 4 == 0 or i == n - 1) else "kda" for i in range(n)]
    return ModelConfig(
        name="kimi-linear-48b", vocab_size=163840, hidden_size=2304, num_hidden_layers=n, layer_types=types,
        linear_num_heads=32, linear_head_dim=128, kda_gate="softplus", use_full_rank_gate=False,
        num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_output_gate=False, attn_res=False, intermediate_size=9216, num_experts=256,
        num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024,
        routed_expert_hidden_size=None, routed_scaling_factor=2.446, hidden_act="silu",
        pad_token_id=163839, bos_token_id=163584, eos_token_id=163586,
    )


def _k3(global_attn: str, name: str) -> ModelConfig:
    # Public Kimi-K3 text config (93 layers, global on 4, 8, ..., 92 and 93); K3.1 Pro swaps MLA for DSA.
    return ModelConfig(
        name=name, vocab_size=163840, hidden_size=7168, num_hidden_layers=93, global_attn=global_attn,
        linear_num_heads=96, linear_head_dim=128, kda_gate="lower_bound", gate_lower_bound=-5.0,
        use_full_rank_gate=True, num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=True,
        index_n_heads=64, index_head_dim=128, index_topk=2048, attn_res=True, attn_res_block_size=12,
        intermediate_size=33792, num_experts=896, num_experts_per_token=16, num_shared_experts=2,
        moe_intermediate_size=3072, routed_expert_hidden_size=3584, latent_moe_use_norm=True,
        routed_scaling_factor=1.0, hidden_act="situ", pad_token_id=163839, bos_token_id=163584,
        eos_token_id=163586,
    )


PRESETS: dict[str, Any] = {
    "toy": _toy,
    "small": _small,
    "kimi-linear-48b": _kimi_linear_48b,
    "k3": lambda: _k3("mla", "k3"),
    "k3.1-pro": lambda: _k3("dsa", "k3.1-pro"),
}


def get_config(preset: str | ModelConfig, **overrides: Any) -> ModelConfig:
    """A preset by name (or a given config) with field overrides applied."""
    if isinstance(preset, ModelConfig):
        return preset.replace(**overrides) if overrides else preset
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    cfg = PRESETS[preset]()
    return cfg.replace(**overrides) if overrides else cfg
