"""save_pretrained / from_pretrained in the kimi_k3 layout."""
from __future__ import annotations

import json

import torch
from safetensors import safe_open

import policy
from policy.checkpoint import config_from_hf

from _policy_tiny import tiny


def _model(**kw):
    torch.manual_seed(0)
    m = policy.build_model(tiny(**kw))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return m.eval()


def test_round_trip_is_exact_and_layout_is_kimi_k3(tmp_path):
    m = _model(global_attn="dsa", q_lora_rank=12)
    policy.save_pretrained(m, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["architectures"] == ["KimiK3ForConditionalGeneration"]
    text = raw["text_config"]
    assert text["linear_attn_config"]["full_attn_layers"] == [4] and text["dsa_layers"] == [4]
    assert text["attn_res_block_size"] == 2 and text["routed_expert_hidden_size"] == 16
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for k in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
              "language_model.model.output_attn_res_proj.weight",
              "language_model.model.layers.0.mlp.gate_proj.weight",
              "language_model.model.layers.1.self_attention_res_norm.weight",
              "language_model.model.layers.1.self_attn.q_conv1d.weight",
              "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight",
              "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
              "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight",
              "language_model.model.layers.3.self_attn.indexer.wq_b.weight",
              "language_model.model.layers.3.self_attn.g_proj.weight"):
        assert k in keys, k
    b = policy.from_pretrained(tmp_path)
    assert b.config == m.config
    x = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        assert torch.equal(m(x).logits, b(x).logits)


def test_text_config_alone_describes_the_model():
    for kw in (dict(), dict(global_attn="dsa", q_lora_rank=12), dict(attn_res=False, kda_gate="softplus",
               use_full_rank_gate=False, routed_expert_hidden_size=None, hidden_act="silu")):
        cfg = tiny(**kw)
        raw = policy.checkpoint.hf_config_dict(cfg)
        del raw["policy_config"]  # what another K3 writer would give us
        back = config_from_hf(raw)
        for f in ("layer_types", "attn_res", "kda_gate", "use_full_rank_gate", "routed_expert_hidden_size",
                  "hidden_act", "q_lora_rank", "num_experts", "first_k_dense_replace",
                  "linear_num_heads", "kv_lora_rank", "mla_use_output_gate"):
            assert getattr(back, f) == getattr(cfg, f), f
        if "dsa" in cfg.layer_types:  # indexer fields are written only for DSA models
            assert (back.index_topk, back.index_n_heads) == (cfg.index_topk, cfg.index_n_heads)


def test_sharded_save_loads(tmp_path):
    m = _model()
    tok = policy.Tokenizer.train(["tiny corpus for a tiny tokenizer"] * 20, vocab_size=300)
    policy.save_pretrained(m, tmp_path, max_shard_bytes=20_000, tokenizer=tok)
    assert policy.Tokenizer.load(tmp_path).encode("tiny corpus") == tok.encode("tiny corpus")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    b = policy.from_pretrained(tmp_path)
    x = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        assert torch.equal(m(x).logits, b(x).logits)


def test_mxfp4_experts_and_bf16_save(tmp_path):
    from kimi_kernels.mx import dequantize_mx, quantize_mx

    m = _model(moe_intermediate_size=32, routed_expert_hidden_size=64)
    policy.save_pretrained(m, tmp_path, mxfp4_experts=True, dtype=torch.bfloat16)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["quantization_config"]["format"] == "mxfp4-pack-quantized"
    pre = "language_model.model.layers.1."
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        packed = f.get_tensor(pre + "block_sparse_moe.experts.2.w1.weight_packed")
        assert packed.dtype == torch.uint8 and packed.shape == (32, 32)  # [I, l / 2]
        assert f.get_tensor(pre + "block_sparse_moe.experts.2.w1.weight_scale").shape == (32, 2)
        assert f.get_tensor(pre + "self_attn.A_log").dtype == torch.float32  # K3 keeps it fp32
        assert f.get_tensor(pre + "self_attn.q_proj.weight").dtype == torch.bfloat16
    b = policy.from_pretrained(tmp_path)
    w = m.model.layers[1].block_sparse_moe.experts.w1.detach()[2]
    expect = dequantize_mx(quantize_mx(w, "fp4"))
    torch.testing.assert_close(b.model.layers[1].block_sparse_moe.experts.w1.detach()[2], expect, atol=0, rtol=0)
    assert not torch.equal(expect, w)
    x = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        ref, got = m(x).logits, b(x).logits
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_public_k3_config_parses_to_the_k3_preset():
    # the fields of the public Kimi-K3 config.json (text part) that define the architecture
    full = [*range(4, 93, 4), 93]
    raw = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
        "num_attention_heads": 96, "num_key_value_heads": 96, "intermediate_size": 33792,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True, "attn_res_block_size": 12,
        "linear_attn_config": {"full_attn_layers": full, "kda_layers": [i for i in range(1, 94) if i not in full],
                               "head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "pad_token_id": 163839, "bos_token_id": 163584, "eos_token_id": 163586}}
    got = config_from_hf(raw)
    want = policy.get_config("k3")
    diff = {k: (v, getattr(got, k)) for k, v in want.to_dict().items()
            if k not in ("name", "index_n_heads", "index_head_dim", "index_topk") and getattr(got, k) != v}
    assert not diff, diff


def test_k3_padded_a_log_and_router_load_and_bad_padding_is_named(tmp_path):
    """K3 checkpoints store A_log zero-padded to 128 entries (96 heads) and may pad the router to
    a round expert count: both load as the real heads / experts; non-zero padding is refused."""
    import pytest
    from safetensors.torch import load_file, save_file

    m = _model()
    policy.save_pretrained(m, tmp_path)
    f = tmp_path / "model.safetensors"
    raw = load_file(str(f))
    a_log = "language_model.model.layers.1.self_attn.A_log"
    gate = "language_model.model.layers.1.block_sparse_moe.gate"
    heads, experts = raw[a_log].numel(), raw[gate + ".weight"].shape[0]
    raw[a_log] = torch.cat([raw[a_log].reshape(-1), torch.zeros(6)])
    raw[gate + ".weight"] = torch.cat([raw[gate + ".weight"], torch.randn(4, raw[gate + ".weight"].shape[1])])
    raw[gate + ".e_score_correction_bias"] = torch.cat([raw[gate + ".e_score_correction_bias"], torch.full((4,), -9.0)])
    save_file(raw, str(f), metadata={"format": "pt"})
    b = policy.from_pretrained(tmp_path)
    assert b.model.layers[1].self_attn.A_log.numel() == heads
    assert b.model.layers[1].block_sparse_moe.gate.weight.shape[0] == experts
    x = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        assert torch.equal(m(x).logits, b(x).logits)
    raw[a_log][-1] = 0.5
    save_file(raw, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="A_log padding is not zero"):
        policy.from_pretrained(tmp_path)
