"""Layer-level tests: incremental decode == full pass per mixer, DSA/AttnRes/LatentMoE identities,
bias balancing, QK-Clip, the DSA indexer loss."""
from __future__ import annotations

import pytest
import torch

from policy.config import ConfigError
from policy.layers.attnres import AttnRes, attn_res_mix
from policy.layers.kda import KDAMixer
from policy.layers.mla import MLAMixer
from policy.layers.moe import LatentMoE

from _policy_tiny import tiny


def _steps(layer, x, splits, **kw):
    """Run x through `layer` in pieces of the given lengths, carrying the cache."""
    outs, cache, s = [], None, 0
    for n in splits:
        y, cache, *_ = layer(x[:, s:s + n], cache, True, **kw)
        outs.append(y)
        s += n
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("kw", [
    dict(),  # K3 style: lower-bound gate, full-rank output gate
    dict(kda_gate="softplus", use_full_rank_gate=False, linear_num_v_heads=4, kda_allow_neg_eigval=True),
])
def test_kda_decode_matches_full(kw):
    torch.manual_seed(0)
    layer = KDAMixer(tiny(**kw), 0)
    x = torch.randn(2, 13, 32)
    full, _ = layer(x)
    inc, cache = _steps(layer, x, [5, 1, 1, 3, 1, 2])
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-4)
    assert cache.state.dtype == torch.float32 and cache.conv.shape == (2, 3, layer.conv_channels())


@pytest.mark.parametrize("kw", [dict(), dict(use_full_rank_gate=False)])
def test_kda_projections_as_one_gemm_equal_one_gemm_each(kw, monkeypatch):
    """Many rows take one GEMM over the concatenated weights, decoding one GEMM each: same layer."""
    from policy.layers import kda

    torch.manual_seed(0)
    layer = KDAMixer(tiny(**kw), 0)
    x = torch.randn(2, 13, 32, requires_grad=True)
    results = []
    for threshold in (0, 10_000):
        monkeypatch.setattr(kda, "ONE_GEMM_MIN_ROWS", threshold)
        layer.zero_grad()
        y, _ = layer(x)
        results.append((y, *torch.autograd.grad(y.sum(), [x, layer.q_proj.weight, layer.b_proj.weight])))
    for one, each in zip(*results):
        torch.testing.assert_close(one, each, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_gated_mlp_gate_and_up_as_one_gemm_equal_one_gemm_each(act, monkeypatch):
    """The dense and shared-expert MLPs: many rows take one GEMM over the stacked gate and up weights,
    decoding one GEMM each; same outputs and gradients (x's, and each weight's)."""
    from policy.layers import moe

    torch.manual_seed(0)
    mlp = moe.GatedMLP(32, 24, tiny(hidden_act=act))
    x = torch.randn(2, 13, 32, requires_grad=True)
    results = []
    for threshold in (0, 10_000):
        monkeypatch.setattr(moe, "ONE_GEMM_MIN_ROWS", threshold)
        y = mlp(x)
        weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        results.append((y, *torch.autograd.grad(y.square().sum(), [x, *weights])))
    for one, each in zip(*results):
        torch.testing.assert_close(one, each, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,kw", [
    ("mla", dict(q_lora_rank=None, mla_use_output_gate=False)),  # Kimi Linear form
    ("mla", dict(q_lora_rank=12, attention_sink=True)),  # gated, q low rank, sink
    ("dsa", dict(q_lora_rank=12, index_topk=3)),  # top-k smaller than the sequence
])
@pytest.mark.parametrize("train", [True, False])  # eval decode attends in the latent space (absorbed)
def test_global_decode_matches_full(kind, kw, train):
    torch.manual_seed(0)
    layer = MLAMixer(tiny(**kw), 0, sparse=kind == "dsa").train(train)
    with torch.no_grad():
        if layer.sinks is not None:
            layer.sinks.normal_()
    x = torch.randn(2, 11, 32)
    full, _, _ = layer(x)
    calls = []
    absorbed = layer._attend_absorbed
    layer._attend_absorbed = lambda *a: calls.append(1) or absorbed(*a)
    inc, cache = _steps(layer, x, [4, 1, 2, 1, 3])
    assert len(calls) == (0 if train else 4)  # eval decode steps take the absorbed path
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-4)
    assert cache.latent.shape == (2, 11, 8) and bool(cache.valid.all())
    if kind == "dsa":  # the top-k mask must bite: dense attention differs
        layer.dsa_stage = "warmup"
        dense, _, _ = layer(x)
        assert (dense - full).abs().max() > 1e-4


def test_dsa_topk_at_least_T_equals_dense():
    torch.manual_seed(0)
    cfg = tiny(q_lora_rank=12, index_topk=16)
    dsa = MLAMixer(cfg, 0, sparse=True)
    mla = MLAMixer(cfg, 0, sparse=False)
    missing = mla.load_state_dict({k: v for k, v in dsa.state_dict().items() if "indexer" not in k})
    assert not missing.missing_keys
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(dsa(x)[0], mla(x)[0], atol=0, rtol=0)


def test_dsa_indexer_kl_trains_only_the_indexer():
    torch.manual_seed(0)
    layer = MLAMixer(tiny(q_lora_rank=12, index_topk=4), 0, sparse=True)
    x = torch.randn(2, 12, 32)
    for stage in ("warmup", "sparse"):
        layer.dsa_stage = stage
        layer.zero_grad()
        _, _, kl = layer(x, indexer_loss=True)
        assert kl is not None and kl.item() >= 0
        kl.backward()
        grads = {n: p.grad for n, p in layer.named_parameters()}
        assert all(g is None for n, g in grads.items() if "indexer" not in n), stage
        assert grads["indexer.wq_b.weight"].abs().sum() > 0
    layer.dsa_stage = "warmup"
    opt = torch.optim.Adam(layer.indexer.parameters(), lr=3e-2)
    first = None
    for _ in range(30):
        opt.zero_grad()
        _, _, kl = layer(x, indexer_loss=True)
        first = kl.item() if first is None else first
        kl.backward()
        opt.step()
    assert kl.item() < 0.7 * first


def test_attnres_zero_query_is_mean():
    torch.manual_seed(0)
    mix = AttnRes(32)
    with torch.no_grad():
        mix.norm.normal_()  # the key norm must not matter when the query is zero
    srcs = [torch.randn(2, 5, 32) * (i + 1) for i in range(4)]
    torch.testing.assert_close(mix(srcs), torch.stack(srcs).mean(0), atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        mix.proj.weight.normal_()
    assert (mix(srcs) - torch.stack(srcs).mean(0)).abs().max() > 1e-3
    one = attn_res_mix(srcs[:1], mix.norm, mix.proj.weight, 1e-5)
    torch.testing.assert_close(one, srcs[0])


def _standard_moe(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """A plain full-dim MoE written out token by token: sigmoid router, biased top-k,
    renormalised unbiased weights times the scaling, SwiGLU/SiTU experts, plus shared experts."""
    from policy.layers._ops import glu

    act = moe.experts.act
    out = torch.zeros_like(x)
    scores = torch.sigmoid(x @ moe.gate.weight.t())
    for n in range(x.shape[0]):
        idx = torch.topk(scores[n] + moe.gate.e_score_correction_bias, moe.top_k).indices
        w = scores[n, idx] / scores[n, idx].sum() * moe.scaling
        for e, we in zip(idx.tolist(), w):
            h = glu(moe.experts.w1[e] @ x[n], moe.experts.w3[e] @ x[n], *act)
            out[n] += we * (moe.experts.w2[e] @ h)
    return out + moe.shared_experts(x)


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_latent_moe_with_identity_projections_is_standard_moe(act):
    torch.manual_seed(0)
    cfg = tiny(routed_expert_hidden_size=32, latent_moe_use_norm=False, hidden_act=act,
               routed_scaling_factor=2.5)
    moe = LatentMoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.routed_expert_down_proj.weight.copy_(torch.eye(32))
        moe.routed_expert_up_proj.weight.copy_(torch.eye(32))
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(3, 7, 32)
    y, idx = moe(x)
    torch.testing.assert_close(y.reshape(-1, 32), _standard_moe(moe, x.reshape(-1, 32)), atol=1e-5, rtol=1e-5)


def test_bias_changes_selection_only():
    torch.manual_seed(0)
    moe = LatentMoE(tiny())
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
    x = torch.randn(40, 32)
    w0, i0 = moe.route(x)
    with torch.no_grad():
        moe.gate.e_score_correction_bias[3] = 10.0  # force expert 3 everywhere
    w1, i1 = moe.route(x)
    assert bool((i1 == 3).any(-1).all()) and not torch.equal(i0, i1)
    scores = torch.sigmoid(x @ moe.gate.weight.t())
    picked = scores.gather(1, i1)
    torch.testing.assert_close(w1, picked / picked.sum(-1, keepdim=True) * moe.scaling)


@pytest.mark.parametrize("balance,rate", [("bias", 0.02), ("quantile", 0.0)])
def test_bias_balancing_shrinks_worst_violation(balance, rate):
    torch.manual_seed(0)
    moe = LatentMoE(tiny(num_experts=8, balance=balance, bias_update_rate=rate)).train()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.05)
        moe.gate.weight[0] += 0.5  # experts 0 and 1 attract almost every token
        moe.gate.weight[1] += 0.5
    x = torch.randn(256, 32).abs()

    def violation() -> float:
        _, idx = moe.route(x)
        load = torch.bincount(idx.reshape(-1), minlength=8).float()
        return (load - load.mean()).abs().max().item()

    moe.update_bias()  # clear statistics from the probe above
    before = violation()
    moe.update_bias()
    for _ in range(60):
        moe.route(x)
        moe.update_bias()
    after = violation()
    assert after < 0.5 * before, (before, after)


def test_qk_clip_caps_the_max_logit():
    torch.manual_seed(0)
    cfg = tiny(q_lora_rank=12)
    layer = MLAMixer(cfg, 0).train()
    with torch.no_grad():
        layer.q_b_proj.weight.mul_(40)
        layer.kv_b_proj.weight.mul_(40)
    x = torch.randn(2, 9, 32)

    def max_logit() -> torch.Tensor:
        layer.qk_max.fill_(float("-inf"))
        layer(x)
        return layer.qk_max.clone()

    tau = 5.0
    before = max_logit()
    assert before.max() > tau
    gamma = layer.qk_clip(tau)
    assert bool((gamma < 1).any())
    after = max_logit()
    assert after.max() <= tau * (1 + 1e-4)
    small = before <= tau  # heads already under tau are untouched
    torch.testing.assert_close(after[small], before[small])


def test_qk_max_statistic_in_query_blocks_equals_one_block(monkeypatch):
    """Query blocks skip the keys in their future (past the block's last position, after a
    cache); the statistic must not change."""
    from policy.layers import mla

    torch.manual_seed(1)
    layer = MLAMixer(tiny(q_lora_rank=12), 0).train()
    prefix, x = torch.randn(2, 5, 32), torch.randn(2, 3, 32)

    def stat(block: int) -> torch.Tensor:
        monkeypatch.setattr(mla, "_QK_STAT_CHUNK", block)
        _, cache, _ = layer(prefix, use_cache=True)
        layer.qk_max.fill_(float("-inf"))
        layer(x, cache=cache)
        return layer.qk_max.clone()

    torch.testing.assert_close(stat(2), stat(10_000), rtol=1e-6, atol=1e-6)


def test_bad_config_values_fail_with_one_line_messages():
    for kw, field in [(dict(hidden_size=0), "hidden_size"), (dict(num_experts_per_token=9), "num_experts_per_token"),
                      (dict(kda_gate="exp"), "kda_gate"), (dict(layer_types=["kda"] * 3), "layer_types"),
                      (dict(linear_num_v_heads=3), "linear_num_heads"), (dict(hidden_act="gelu"), "hidden_act")]:
        with pytest.raises(ConfigError, match=field) as e:
            tiny(**kw)
        assert "\n" not in str(e.value)


def test_lightning_indexer_formula():
    """I[t, s] = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s]), w = W_w x / sqrt(H_I d_I); heads in chunks."""
    from policy.layers.mla import LightningIndexer

    torch.manual_seed(0)
    ix = LightningIndexer(tiny(index_n_heads=11, index_head_dim=4), q_in_dim=32)
    with torch.no_grad():
        for p in ix.parameters():
            p.normal_()
    x = torch.randn(2, 5, 32)
    k = ix.keys(x)
    got = ix.scores(x, x, k)
    q = ix.wq_b(x).reshape(2, 5, 11, 4)
    w = ix.weights_proj(x) / (11 * 4) ** 0.5
    ref = torch.zeros(2, 5, 5)
    for b in range(2):
        for t in range(5):
            for s in range(5):
                ref[b, t, s] = sum(w[b, t, j] * torch.relu(q[b, t, j] @ k[b, s]) for j in range(11))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pairs", [1, 512, 2048, 2049, 5000])  # on CUDA compared in ranks up to 2048, sorted past
def test_expert_order_is_a_stable_argsort(pairs):
    from policy.layers.moe import expert_order, expert_order_by_ranking

    ids = torch.randint(0, 64, (pairs,), generator=torch.Generator().manual_seed(pairs))
    assert torch.equal(expert_order(ids), torch.argsort(ids, stable=True))
    if pairs <= 2048:  # the ranking CUDA's decode batches take, checked here on the CPU
        assert torch.equal(expert_order_by_ranking(ids), torch.argsort(ids, stable=True))


@pytest.mark.parametrize("k", [1, 2, 8])
def test_rows_by_expert_and_its_gradient_equal_indexing(k):
    """rows_by_expert (the routed experts' input rows, with a gradient that sums each token's k
    rows by a permutation) gives what indexing z[order // k] and autograd's gradient of it give."""
    from kimi_kernels.expert_rows import row_of_pair
    from policy.layers.moe import expert_order, rows_by_expert

    g = torch.Generator().manual_seed(k)
    z = torch.randn(37, 12, generator=g, dtype=torch.float64, requires_grad=True)
    order = expert_order(torch.randint(0, 9, (37 * k,), generator=g))
    upstream = torch.randn(37 * k, 12, generator=g, dtype=torch.float64)
    got = rows_by_expert(z, order, row_of_pair(order), k)
    want = z[order // k]
    assert torch.equal(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, z, upstream)[0], torch.autograd.grad(want, z, upstream)[0],
                               rtol=1e-12, atol=1e-12)


def test_row_of_pair_inverts_the_expert_order():
    from kimi_kernels.expert_rows import row_of_pair
    from policy.layers.moe import expert_order

    order = expert_order(torch.randint(0, 5, (60,), generator=torch.Generator().manual_seed(1)))
    rows = row_of_pair(order)
    assert torch.equal(order[rows], torch.arange(60)) and torch.equal(rows[order], torch.arange(60))


def test_expert_counts_equal_bincount():
    from policy.layers.moe import expert_counts

    ids = torch.tensor([3, 0, 3, 5, 3, 0])
    assert torch.equal(expert_counts(ids, 7), torch.bincount(ids, minlength=7))
    assert torch.equal(expert_counts(ids[:0], 4), torch.zeros(4, dtype=torch.long))


def test_the_experts_combine_equals_a_sum_over_each_tokens_pairs():
    """The routed experts' outputs gathered back to their tokens and weighted (StackedExperts.forward,
    the CPU path; the CUDA kernels are checked against it in tests/kernels/test_kernels_expert_rows.py):
    each token's sum of its k routing weights times its experts' outputs, values and gradients (rows
    and weights), in bf16."""
    from policy.layers import moe

    g = torch.Generator().manual_seed(5)
    experts = moe.StackedExperts(6, 16, 24, tiny()).bfloat16()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    z = torch.randn(9, 16, generator=g).bfloat16().requires_grad_(True)
    w = torch.rand(9, 2, generator=g).requires_grad_(True)
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(9)])
    y = experts(z, w, idx)
    single = [experts.grouped(z[i:i + 1], torch.eye(6, dtype=torch.long)[e]) for i, e in
              ((i, int(e)) for i in range(9) for e in idx[i])]
    want = sum(w.reshape(-1)[j::2, None] * torch.cat(single[j::2]).float() for j in range(2))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, want.bfloat16(), rtol=0, atol=0)  # summed in float32, rounded once
    upstream = torch.randn(9, 16, generator=g).bfloat16()
    got = torch.autograd.grad(y, (z, w), upstream)
    expected = torch.autograd.grad(want, (z, w), upstream.float())
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_the_per_expert_loops_backward_makes_each_weights_gradient_once():
    """The CPU experts' backward writes each stacked weight's gradient once: an index per expert
    (w1[e]) would zero-fill a whole [E, I, d] gradient for every used expert and sum them all (at the
    Kimi-Linear shape on this CPU, 45 s instead of 3 s a layer); the gradients equal per-expert products."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from policy.layers.moe import _per_expert_loop

    class WholeWeightBuffers(TorchDispatchMode):  # the distinct storages of weight-shaped outputs
        def __init__(self, shapes):
            super().__init__()
            self.shapes, self.storages = shapes, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and tuple(t.shape) in self.shapes:
                    self.storages.add(t.untyped_storage().data_ptr())
            return out

    torch.manual_seed(0)
    E, I, d = 6, 8, 4  # I != d, so no other tensor has a weight's shape
    w1, w3 = (torch.randn(E, I, d, requires_grad=True) for _ in range(2))
    w2 = torch.randn(E, d, I, requires_grad=True)
    counts = torch.tensor([3, 0, 2, 4, 1, 2])  # one expert unused
    zs = torch.randn(int(counts.sum()), d, requires_grad=True)
    out = _per_expert_loop(zs, counts, w1, w3, w2, "silu", 0.0, 0.0)
    mode = WholeWeightBuffers({(E, I, d), (E, d, I)})
    with mode:
        out.square().sum().backward()
    assert len(mode.storages) == 3, f"{len(mode.storages)} whole-weight buffers made in the backward, 3 expected"

    g1, g3, g2 = (torch.zeros_like(w) for w in (w1, w3, w2))
    for e, (ze, go) in enumerate(zip(zs.detach().split(counts.tolist()), (2 * out.detach()).split(counts.tolist()))):
        a, b = ze @ w1[e].detach().t(), ze @ w3[e].detach().t()
        h = torch.nn.functional.silu(a) * b
        g2[e] = go.t() @ h
        gh = go @ w2[e].detach()
        sa = torch.sigmoid(a)
        g1[e] = (gh * b * sa * (1 + a * (1 - sa))).t() @ ze
        g3[e] = (gh * torch.nn.functional.silu(a)).t() @ ze
    for got, want in ((w1.grad, g1), (w3.grad, g3), (w2.grad, g2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_fixed_capacity_experts_equal_the_per_expert_loop(act):
    """Inside fixed_capacity_experts() (what a CUDA graph captures in float32) the routed experts
    give the per-expert loop's output: each expert's rows in a padded block of one batched product."""
    from policy.layers.moe import fixed_capacity_experts

    torch.manual_seed(1)
    moe = LatentMoE(tiny(hidden_act=act)).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(5, 3, 32)  # 15 tokens; some experts get none
    with torch.no_grad():
        y_loop, idx_loop = moe(x)
        with fixed_capacity_experts():
            y_fixed, idx_fixed = moe(x)
    assert torch.equal(idx_loop, idx_fixed)
    torch.testing.assert_close(y_fixed, y_loop, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the switch is scoped: outside it the loop runs again
        assert torch.equal(moe(x)[0], y_loop)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fixed_capacity_experts_are_capturable_in_float32():
    """float32 experts in a CUDA graph: captured inside fixed_capacity_experts(), the replay gives
    the eager per-expert loop's output for new inputs."""
    from policy.layers.moe import fixed_capacity_experts

    torch.manual_seed(2)
    moe = LatentMoE(tiny()).cuda().eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(8, 1, 32, device="cuda")
    with torch.no_grad(), fixed_capacity_experts():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph, _ = moe(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    with torch.no_grad():
        y_eager, _ = moe(x)
    torch.testing.assert_close(y_graph, y_eager, atol=1e-5, rtol=1e-5)
