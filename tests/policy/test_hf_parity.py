"""Parity with transformers' KimiLinearForCausalLM: same tiny random weights, same logits."""
from __future__ import annotations

import pytest
import torch

import policy

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    cfg = KimiLinearConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        linear_head_dim=8, linear_num_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        routed_scaling_factor=2.446,
    )
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # make every parameter matter: non-trivial bias, norms and gates
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    d = tmp_path_factory.mktemp("kimi_linear")
    model.save_pretrained(d)
    return d, model


def test_logits_match_transformers(hf_dir):
    d, hf = hf_dir
    ours = policy.from_pretrained(d)
    assert not ours.config.attn_res and ours.config.kda_gate == "softplus"
    x = torch.randint(0, 96, (2, 70))  # > one KDA chunk
    with torch.no_grad():
        ref = hf(x, use_cache=False).logits.float()
        out = ours(x).logits
    assert out.shape == ref.shape
    err = (out - ref).abs().max().item()
    assert err < 1e-4 * max(1.0, ref.abs().max().item()), err


def test_kimi_linear_round_trips_to_k3_layout(hf_dir, tmp_path):
    d, _ = hf_dir
    a = policy.from_pretrained(d)
    policy.save_pretrained(a, tmp_path)
    b = policy.from_pretrained(tmp_path)
    x = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        assert torch.equal(a(x).logits, b(x).logits)
