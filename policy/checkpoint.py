"""Checkpoints: safetensors + config.json in the Hugging Face `kimi_k3` layout.

Written layout (what K3 loaders expect):
  config.json   {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                 "text_config": {"model_type": "kimi_linear", ... K3 text fields ...},
                 "policy_config": {...}}   <- the full ModelConfig, read back first by from_pretrained
  model.safetensors (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
  tensors named language_model.model.layers.N.self_attn.q_proj.weight, ...,
  language_model.model.layers.N.block_sparse_moe.experts.J.w{1,2,3}.weight, language_model.lm_head.weight

Optional (save_pretrained(mxfp4_experts=True)): routed experts as K3 ships them, compressed-tensors
MXFP4: experts.J.w*.weight_packed + weight_scale, with a quantization_config; read back dequantised.

Also read: a transformers `KimiLinearForCausalLM` directory (model_type "kimi_linear", no prefix,
either the original names or transformers' runtime names: conv1d stacked, forget_gate.*, mlp.*
for MoE with experts.gate_up_proj / experts.down_proj).

K3.1's DSA fields are not public (UNVERIFIED): we write `dsa_layers` (1-based, a subset of
full_attn_layers) and DeepSeek-V3.2's index_n_heads / index_head_dim / index_topk.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kimi_kernels.mx import MXTensor, dequantize_mx, quantize_mx

from .config import ConfigError, ModelConfig
from .dtypes import keep_fp32
from .model import build_model

_K3_PREFIX = "language_model."
_EXPERT_STACK = re.compile(r"^(.*\.block_sparse_moe\.experts)\.(w[123])$")
_EXPERT_ONE = re.compile(r"^(.*\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.weight$")
_EXPERT_PACKED = re.compile(r"^(.*\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$")
_MX_BLOCK = 32
# tensors K3 keeps in float32 whatever the checkpoint dtype
_FP32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias", "o_norm.weight")
_MXFP4_CONFIG: dict[str, Any] = {  # compressed-tensors description of MXFP4 routed experts (as K3)
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
        "output_activations": None,
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": _MX_BLOCK,
                    "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8", "observer": "minmax",
                    "actorder": None, "block_structure": None, "observer_kwargs": {}, "zp_dtype": None}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*routed_expert_.*", "re:.*block_sparse_moe\\.gate$"],
}


# ------------------------------------------------------------------------------- config.json
def text_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The K3 / Kimi Linear text config for `cfg`."""
    full = [i + 1 for i, t in enumerate(cfg.layer_types) if t != "kda"]
    lac: dict[str, Any] = {
        "full_attn_layers": full,
        "kda_layers": [i + 1 for i, t in enumerate(cfg.layer_types) if t == "kda"],
        "head_dim": cfg.linear_head_dim,
        "num_heads": cfg.linear_num_heads,
        "short_conv_kernel_size": cfg.linear_conv_kernel_dim,
        "use_full_rank_gate": cfg.use_full_rank_gate,
    }
    if cfg.kda_gate == "lower_bound":
        lac["gate_lower_bound"] = cfg.gate_lower_bound
    if cfg.num_v_heads != cfg.linear_num_heads:
        lac["num_v_heads"] = cfg.num_v_heads
    if cfg.v_dim != cfg.linear_head_dim:
        lac["v_head_dim"] = cfg.v_dim
    d: dict[str, Any] = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_renormalize": cfg.moe_renormalize,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "hidden_act": cfg.hidden_act,
        "activation_situ_beta": cfg.activation_situ_beta,
        "activation_situ_linear_beta": cfg.activation_situ_linear_beta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "initializer_range": cfg.initializer_range,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": cfg.mla_use_output_gate,
        "linear_attn_config": lac,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "tie_word_embeddings": False,
    }
    if cfg.routed_expert_hidden_size is not None:
        d["routed_expert_hidden_size"] = cfg.routed_expert_hidden_size
        d["latent_moe_use_norm"] = cfg.latent_moe_use_norm
    if cfg.attn_res:
        d["attn_res_block_size"] = cfg.attn_res_block_size
    if "dsa" in cfg.layer_types:
        d["dsa_layers"] = [i + 1 for i, t in enumerate(cfg.layer_types) if t == "dsa"]
        d.update(index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk)
    return d


def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a kimi_k3 or kimi_linear config.json (either HF's flat or original form)."""
    if "policy_config" in raw:
        return ModelConfig.from_dict(raw["policy_config"])
    t = raw.get("text_config", raw)
    mt = t.get("model_type")
    if mt not in ("kimi_linear", "kimi_k3", None):
        raise ConfigError(f"config.json: model_type {mt!r} is not kimi_linear / kimi_k3")
    n = int(t["num_hidden_layers"])
    lac = t.get("linear_attn_config") or {}
    if "full_attn_layers" in lac:
        types = ["kda"] * n
        dsa = set(t.get("dsa_layers") or [])
        for i in lac["full_attn_layers"]:
            types[i - 1] = "dsa" if i in dsa else "mla"
    elif t.get("layer_types"):
        types = ["kda" if x == "linear_attention" else "mla" for x in t["layer_types"]]
    else:
        raise ConfigError("config.json: neither linear_attn_config.full_attn_layers nor layer_types is given")
    if t.get("mlp_layer_types"):
        mlp = t["mlp_layer_types"]
        first_dense = next((i for i, x in enumerate(mlp) if x != "dense"), n)
        if any(x == "dense" for x in mlp[first_dense:]):
            raise ConfigError("config.json: mlp_layer_types must be dense layers followed by sparse ones")
    else:
        first_dense = int(t.get("first_k_dense_replace", 1))
    if int(t.get("moe_layer_freq", 1)) != 1:
        raise ConfigError("config.json: moe_layer_freq != 1 is not supported")
    if int(_first(t, "num_expert_group", "n_group", default=1)) != 1:
        raise ConfigError("config.json: grouped routing (num_expert_group > 1) is not supported")
    if _first(t, "moe_router_activation_func", default="sigmoid") != "sigmoid":
        raise ConfigError("config.json: only the sigmoid router is supported")
    heads = int(t["num_attention_heads"])
    if int(_first(t, "num_key_value_heads", default=heads)) != heads:
        raise ConfigError("config.json: MLA needs num_key_value_heads == num_attention_heads")
    lb = lac.get("gate_lower_bound", t.get("gate_lower_bound"))
    kw: dict[str, Any] = dict(
        vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]), num_hidden_layers=n,
        layer_types=types, rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
        initializer_range=float(t.get("initializer_range", 0.02)),
        linear_num_heads=int(_first(lac, "num_heads", default=_first(t, "linear_num_heads", default=32))),
        linear_num_v_heads=lac.get("num_v_heads"),
        linear_head_dim=int(_first(lac, "head_dim", default=_first(t, "linear_head_dim", default=128))),
        linear_v_head_dim=lac.get("v_head_dim"),
        linear_conv_kernel_dim=int(_first(lac, "short_conv_kernel_size",
                                          default=_first(t, "linear_conv_kernel_dim", default=4))),
        kda_gate="lower_bound" if lb is not None else "softplus",
        gate_lower_bound=float(lb) if lb is not None else -5.0,
        use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        num_attention_heads=heads, q_lora_rank=t.get("q_lora_rank"), kv_lora_rank=int(t["kv_lora_rank"]),
        qk_nope_head_dim=int(t["qk_nope_head_dim"]), qk_rope_head_dim=int(t["qk_rope_head_dim"]),
        v_head_dim=int(t["v_head_dim"]), mla_use_output_gate=bool(t.get("mla_use_output_gate", False)),
        attn_res="attn_res_block_size" in t and t["attn_res_block_size"] is not None,
        attn_res_block_size=int(t.get("attn_res_block_size") or 1),
        first_k_dense_replace=first_dense, intermediate_size=int(t["intermediate_size"]),
        num_experts=int(_first(t, "num_experts", "num_local_experts", "n_routed_experts", default=0)),
        num_experts_per_token=int(_first(t, "num_experts_per_token", "num_experts_per_tok", default=1)),
        num_shared_experts=int(_first(t, "num_shared_experts", "n_shared_experts", default=0)),
        moe_intermediate_size=int(t.get("moe_intermediate_size", 1)),
        routed_expert_hidden_size=t.get("routed_expert_hidden_size"),
        latent_moe_use_norm=bool(t.get("latent_moe_use_norm", True)),
        routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(_first(t, "moe_renormalize", "norm_topk_prob", default=True)),
        hidden_act=str(t.get("hidden_act", "silu")),
        activation_situ_beta=float(t.get("activation_situ_beta", 4.0)),
        activation_situ_linear_beta=float(t.get("activation_situ_linear_beta", 25.0)),
        pad_token_id=_first(t, "pad_token_id", default=raw.get("pad_token_id")),
        bos_token_id=_first(t, "bos_token_id", default=raw.get("bos_token_id")),
        eos_token_id=_first(t, "eos_token_id", default=raw.get("eos_token_id")),
        name=str(raw.get("_name_or_path") or "pretrained"),
    )
    if isinstance(kw["eos_token_id"], list):
        kw["eos_token_id"] = kw["eos_token_id"][0]
    for k in ("index_n_heads", "index_head_dim", "index_topk"):
        if k in t:
            kw[k] = int(t[k])
    return ModelConfig(**kw)


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": False,
        "text_config": text_config_dict(cfg),
        "policy_config": cfg.to_dict(),
    }


# ----------------------------------------------------------------------------- tensor names
def to_hf_state_dict(state: dict[str, torch.Tensor], mxfp4_experts: bool = False) -> dict[str, torch.Tensor]:
    """Our names -> kimi_k3 names (prefix, one tensor per routed expert). With mxfp4_experts the
    routed experts are written as K3 ships them: w*.weight_packed (uint8, two E2M1 codes per
    byte, even element in the low nibble) + w*.weight_scale (E8M0 bytes, one per 32 inputs)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _EXPERT_STACK.match(name)
        if not m:
            out[_K3_PREFIX + name] = t
            continue
        for j in range(t.shape[0]):
            base = f"{_K3_PREFIX}{m.group(1)}.{j}.{m.group(2)}"
            if mxfp4_experts:
                q = quantize_mx(t[j].float(), "fp4", _MX_BLOCK)
                out[base + ".weight_packed"], out[base + ".weight_scale"] = q.data, q.scales
            else:
                out[base + ".weight"] = t[j]
    return out


def _expert_shape(cfg: ModelConfig, w: str) -> tuple[int, int]:
    inner = cfg.routed_expert_hidden_size or cfg.hidden_size
    return (inner, cfg.moe_intermediate_size) if w == "w2" else (cfg.moe_intermediate_size, inner)


def _unpad_a_log(name: str, t: torch.Tensor, heads: int) -> torch.Tensor:
    """K3 stores A_log padded with zeros to a round length (128 entries for 96 heads): keep the
    first `heads`; padding that is not zero means the config and the checkpoint disagree."""
    if t.numel() > heads:
        if bool(t[heads:].any()):
            raise ValueError(f"checkpoint: {name} has {t.numel()} entries for {heads} heads and its A_log padding "
                             f"is not zero: the config's head count does not match this checkpoint")
        t = t[:heads]
    return t


def from_hf_state_dict(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """kimi_k3 or kimi_linear tensors -> our names and shapes."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in raw.items():
        if name.startswith(_K3_PREFIX):
            name = name[len(_K3_PREFIX):]
        elif name.startswith(("vision_tower.", "mm_projector.")):
            continue  # the text model only
        name = name.replace(".self_attn.forget_gate.", ".self_attn.")
        # transformers renames mlp <-> block_sparse_moe for every layer (runtime names put MoE
        # under mlp., its saved files put the dense FFN under block_sparse_moe.): go by layer kind
        m = re.match(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.(.*)$", name)
        if m:
            ffn = "block_sparse_moe" if cfg.is_moe(int(m.group(1))) else "mlp"
            name = f"model.layers.{m.group(1)}.{ffn}.{m.group(3)}"
        if name.endswith(".self_attn.conv1d.weight"):  # stacked q/k/v convs
            base = name[: -len("conv1d.weight")]
            qk = cfg.linear_num_heads * cfg.linear_head_dim
            q, k, v = torch.split(t, [qk, qk, t.shape[0] - 2 * qk], dim=0)
            out[base + "q_conv1d.weight"], out[base + "k_conv1d.weight"], out[base + "v_conv1d.weight"] = q, k, v
            continue
        if name.endswith(".block_sparse_moe.experts.gate_up_proj"):
            base = name[: -len(".gate_up_proj")]
            inter = t.shape[1] // 2
            out[base + ".w1"], out[base + ".w3"] = t[:, :inter], t[:, inter:]
            continue
        if name.endswith(".block_sparse_moe.experts.down_proj"):
            out[name[: -len(".down_proj")] + ".w2"] = t
            continue
        m = _EXPERT_ONE.match(name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
            continue
        m = _EXPERT_PACKED.match(name)
        if m:
            if m.group(4) == "weight_scale":
                continue  # read together with its weight_packed
            scale_name = name[: -len("weight_packed")] + "weight_scale"
            scales = raw.get(scale_name, raw.get(_K3_PREFIX + scale_name))
            if scales is None:
                raise ValueError(f"checkpoint: {name} has no {scale_name}")
            shape = torch.Size(_expert_shape(cfg, m.group(3)))
            w = dequantize_mx(MXTensor(t, scales, shape, "fp4", _MX_BLOCK))
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = w
            continue
        if name.endswith(".self_attn.A_log"):
            t = _unpad_a_log(name, t.reshape(-1), cfg.num_v_heads)
        elif name.endswith((".block_sparse_moe.gate.weight", ".block_sparse_moe.gate.e_score_correction_bias")):
            t = t[: cfg.num_experts]  # routers may be stored padded to a round expert count
        out[name] = t
    for (base, w), parts in experts.items():
        n = len(parts)
        if sorted(parts) != list(range(n)):
            raise ValueError(f"checkpoint: experts of {base}.{w} are not numbered 0..{n - 1}")
        out[f"{base}.{w}"] = torch.stack([parts[j] for j in range(n)])
    return out


# ---------------------------------------------------------------------------------- save/load
def save_pretrained(model: torch.nn.Module, path: str | Path, tokenizer: Any = None,
                    max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
                    mxfp4_experts: bool = False, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write config.json + safetensors (sharded with an index above max_shard_bytes).
    dtype casts the floating tensors except those K3 keeps in float32; mxfp4_experts stores the
    routed experts as MXFP4 (compressed-tensors layout, as the K3 release does). `state` is written
    instead of the model's own (an expert-parallel model's `full_state_dict()`)."""
    cfg: ModelConfig = model.config
    state = {k: v.detach() for k, v in (model.state_dict() if state is None else state).items()}
    if any(v.is_meta for v in state.values()):
        raise ValueError("save_pretrained: the model is on the meta device; nothing to save")
    held = {v.shape[0] for k, v in state.items() if k.endswith(".experts.w1")}
    if held - {cfg.num_experts}:  # an expert-parallel rank (LatentMoE.shard_experts) holds a share
        raise ValueError(f"save_pretrained: the model holds {held.pop()} of its {cfg.num_experts} routed experts "
                         f"per layer (sharded over ranks); a checkpoint needs them all")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    hf = to_hf_state_dict(state, mxfp4_experts)

    def cast(k: str, v: torch.Tensor) -> torch.Tensor:
        keep = not v.is_floating_point() or k.endswith(_FP32_SUFFIXES)
        return (v if dtype is None or keep else v.to(dtype)).contiguous().cpu()

    hf = {k: cast(k, v) for k, v in hf.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(hf):
        nbytes = hf[k].numel() * hf[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = hf[k]
        size += nbytes
    meta = {"format": "pt"}
    for old in list(d.glob("model*.safetensors")) + list(d.glob("model.safetensors.index.json")):
        old.unlink()  # stale shards of an earlier save would shadow this one
    if len(shards) == 1:
        save_file(shards[0], str(d / "model.safetensors"), metadata=meta)
    else:
        weight_map, n = {}, len(shards)
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(sh, str(d / fname), metadata=meta)
            weight_map.update({k: fname for k in sh})
        total = sum(v.numel() * v.element_size() for v in hf.values())
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    conf = hf_config_dict(cfg)
    if mxfp4_experts:
        conf["quantization_config"] = conf["text_config"]["quantization_config"] = _MXFP4_CONFIG
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    if tokenizer is not None:
        tokenizer.save(d)


def check_safetensors(path: Path) -> None:
    """Refuse, with one ValueError line naming the file, a .safetensors file that is cut short or
    whose header is not one: what a copy or a save interrupted midway leaves behind."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < header_len <= size - 8 or header_len > 100 << 20:
            raise ValueError(f"checkpoint file {path} is not a whole safetensors file ({size} bytes)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        raise ValueError(f"checkpoint file {path} has no readable safetensors header") from None
    if 8 + header_len + end != size:
        raise ValueError(f"checkpoint file {path} is cut short: {size} bytes, its header promises "
                         f"{8 + header_len + end}")


def _read_tensors(d: Path) -> dict[str, torch.Tensor]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"from_pretrained: no .safetensors files in {d}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        check_safetensors(f)
        with safe_open(str(f), framework="pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def from_pretrained(path: str | Path, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None, strict: bool = True, **overrides: Any):
    """Load a checkpoint written by save_pretrained, a kimi_k3 directory, or a transformers
    KimiLinearForCausalLM directory. Returns a HybridForCausalLM in eval mode."""
    d = Path(path)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"from_pretrained: no config.json in {d}")
    cfg = config_from_hf(json.loads((d / "config.json").read_text()))
    if overrides:
        cfg = cfg.replace(**overrides)
    model = build_model(cfg)
    state = from_hf_state_dict(_read_tensors(d), cfg)
    own = model.state_dict()
    for k, v in list(state.items()):
        if k in own and own[k].shape != v.shape:
            raise ValueError(f"from_pretrained: {k} has shape {tuple(v.shape)} in the checkpoint, "
                             f"model expects {tuple(own[k].shape)}")
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise ValueError(f"from_pretrained: missing {missing[:5]} ({len(missing)}), "
                         f"unexpected {unexpected[:5]} ({len(unexpected)})")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    if device is not None:
        model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
        keep_fp32(model)
    return model.eval()
