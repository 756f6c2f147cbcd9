"""Packed rows (cu_seqlens): KDA and the short conv over several sequences laid end to end equal each
sequence run alone, in float64 to 1e-10, chunks straddling the boundaries or not, gradients included;
bad boundaries are refused in one line."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kimi_kernels.kda import kda, kda_chunk, kda_recurrent
from kimi_kernels.ops import short_conv
from kimi_kernels.varlen import (PAD_ALLOWANCE, PAD_SLACK, RepadBucket, check_cu_seqlens, length_buckets,
                                 positions_in_segment, repad_buckets, repad_index, segment_ids, segment_starts,
                                 to_packed, to_padded)
from test_kernels_kda import make_inputs

LENGTHS = [[70], [5, 64, 1, 30], [64, 64], [1, 1, 1], [10, 0, 50, 3], [130, 7, 65]]


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def each_alone(fn, lengths, *xs):
    bounds = cu(lengths).tolist()
    return torch.cat([fn(*(x[:, a:b] for x in xs)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], 1)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("chunk_size", [64, 16, 8])
def test_kda_packed_equals_each_sequence_alone(lengths, chunk_size):
    q, k, v, g, beta, _ = make_inputs(B=1, T=sum(lengths), gate="lb", seed=sum(lengths))
    alone = each_alone(lambda *x: kda_recurrent(*x)[0], lengths, q, k, v, g, beta)
    packed, _ = kda_chunk(q, k, v, g, beta, cu_seqlens=cu(lengths), chunk_size=chunk_size)
    assert (packed - alone).abs().max().item() < 1e-10
    oracle, _ = kda_recurrent(q, k, v, g, beta, cu_seqlens=cu(lengths))
    assert (oracle - alone).abs().max().item() < 1e-10
    whole, _ = kda_chunk(q, k, v, g, beta, chunk_size=chunk_size)
    assert len(lengths) == 1 or (whole - alone).abs().max().item() > 1e-3  # the boundaries mattered


def test_kda_packed_gradients_equal_each_sequence_alone():
    lengths = [37, 64, 9]
    inputs = [x.requires_grad_(True) for x in make_inputs(B=1, T=110, gate="softplus", seed=5)[:5]]
    weight = torch.randn(1, 110, *inputs[2].shape[2:], dtype=torch.float64)
    packed, _ = kda(*inputs, cu_seqlens=cu(lengths))
    grads = torch.autograd.grad((packed * weight).sum(), inputs)
    alone = each_alone(lambda *x: kda_recurrent(*x)[0], lengths, *inputs)
    expected = torch.autograd.grad((alone * weight).sum(), inputs)
    for a, b in zip(grads, expected):
        assert (a - b).abs().max().item() < 1e-10


def test_kda_packed_refuses_states_and_bad_boundaries():
    q, k, v, g, beta, h0 = make_inputs(B=1, T=10, seed=1)
    with pytest.raises(ValueError, match="starts every sequence from zero"):
        kda_chunk(q, k, v, g, beta, initial_state=h0[:1], cu_seqlens=cu([4, 6]))
    with pytest.raises(ValueError, match="rise from 0 to the row's length 10"):
        kda_chunk(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))
    q2, k2, v2, g2, beta2, _ = make_inputs(B=2, T=10, seed=1)
    with pytest.raises(ValueError, match="batch must be 1"):
        kda_chunk(q2, k2, v2, g2, beta2, cu_seqlens=cu([4, 6]))


def test_boundaries_are_read_once_per_tensor_and_again_after_an_in_place_change():
    """Every layer of a forward checks the same cu_seqlens; each check read it from the device (a sync on
    CUDA). A tensor that passed is not read again for the same row length; written in place, it is."""
    bounds = cu([4, 6])
    check_cu_seqlens(bounds, 1, 10, "first layer")
    bounds.data[1] = 11  # behind autograd's version counter: the remembered pass stands, nothing is read
    check_cu_seqlens(bounds, 1, 10, "second layer")
    with pytest.raises(ValueError, match="length 12"):  # another row length is checked afresh
        check_cu_seqlens(bounds, 1, 12, "other row")
    bounds.data[1] = 4
    check_cu_seqlens(bounds, 1, 10, "third layer")
    bounds[1] = 11  # an in-place write bumps the version: checked again
    with pytest.raises(ValueError, match="rise from 0 to the row's length 10"):
        check_cu_seqlens(bounds, 1, 10, "after the write")


def test_the_repadding_plan_reuses_the_boundaries_the_check_read():
    """A forward's re-padding (MLA's, a transformers policy's attention) is worked out on the host from
    the values check_cu_seqlens read: no second read of the device tensor."""
    bounds = cu([3, 5])
    check_cu_seqlens(bounds, 1, 8, "model")
    bounds.data[1] = 4  # behind the version counter: a fresh read would see lengths [4, 4]
    (bucket,) = repad_buckets(*repad_index(bounds), bounds)
    assert bucket.real.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert bucket.dest.tolist() == [3, 4, 5, 6, 7, 0, 1, 2] and bucket.src.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [2, 2, 2], [12]], ids=str)
def test_short_conv_never_reaches_across_a_boundary(lengths):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, sum(lengths), 6, dtype=torch.float64, generator=gen)
    w = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    packed, _ = short_conv(x, w, cu_seqlens=cu(lengths))
    alone = each_alone(lambda part: short_conv(part, w)[0], lengths, x)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-14)


def test_repadding_round_trips():
    lengths = [3, 0, 5, 1]
    x = torch.arange(9.0)[None, :, None]
    index, real = repad_index(cu(lengths))
    padded = to_padded(x, index)
    assert padded.shape == (4, 5, 1) and real.sum() == 9
    bucket = RepadBucket(index, real, index[real], real.reshape(-1).nonzero().squeeze(1))
    assert torch.equal(to_packed(padded, bucket, torch.zeros(9, 1))[None], x)
    assert segment_ids(cu(lengths), 9).tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3]
    assert positions_in_segment(cu(lengths), 9).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]


def test_length_buckets_hold_every_sequence_once_and_bound_the_padding():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        # a long tail: mostly short, a few up to 4K, some empty
        lengths = (torch.rand(n, generator=gen) ** 4 * 4096).long().tolist()
        buckets = length_buckets(lengths)
        assert sorted(i for b in buckets for i in b) == [i for i in range(n) if lengths[i] > 0]
        for b in buckets:
            longest = lengths[b[0]]
            assert longest == max(lengths[i] for i in b)
            assert all(longest <= PAD_SLACK * lengths[i] or longest - lengths[i] <= PAD_ALLOWANCE for i in b)
    # like lengths share a bucket: 8 of 100 and 8 of 3 make two buckets, not eight
    assert sorted(map(len, length_buckets([100, 3] * 8))) == [8, 8]
    with pytest.raises(ValueError, match="slack"):
        length_buckets([1, 2], slack=0.5)


def test_repadding_by_buckets_round_trips():
    lengths = [3, 0, 50, 1, 48, 2]
    x = torch.arange(104.0)[None, :, None]
    index, real = repad_index(cu(lengths))
    out = torch.zeros(104, 1)
    slots = 0
    for bucket in repad_buckets(index, real, cu(lengths)):
        out = to_packed(to_padded(x, bucket.index), bucket, out)
        slots += bucket.index.numel()
        assert torch.equal(bucket.dest, bucket.index[bucket.real])
    assert torch.equal(out[None], x)
    assert slots == 2 * 50 + 3 * 3  # [50, 48] and [3, 2, 1]: 109 slots, not 6 x 50


class _Ops(TorchDispatchMode):
    """The aten ops a call runs."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_segment_starts_marks_each_first_token_without_a_value_from_the_host(lengths):
    """On a GPU, `starts[index] = True` is an index_put_ whose True is a host tensor copied from pageable
    memory, which drains the launch queue: the learner step's one synchronizing call (H100 profile,
    benchmarks/RESULTS.md). The marks must come from ops that take the value as an argument."""
    bounds = cu(lengths)
    with _Ops() as ops:
        starts = segment_starts(bounds, int(bounds[-1]))
    first = {a for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()) if b > a}
    assert starts.tolist() == [t in first for t in range(int(bounds[-1]))]
    assert not [name for name in ops.names if name.startswith(("index_put", "_index_put", "scalar_tensor", "_to_copy"))]
