"""MXFP4 / MXFP8: exact round trips, E8M0 bytes, ties to even, saturation, FP4 nibble order."""
from __future__ import annotations

import pytest
import torch

from kimi_kernels.mx import MXTensor, dequantize_mx, quantize_mx

FP4_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def block(values: list[float], fill: float = 0.0) -> torch.Tensor:
    return torch.tensor(values + [fill] * (32 - len(values)), dtype=torch.float32)


def fp8_grid() -> torch.Tensor:
    """Every finite non-negative E4M3 value, from torch's own float8 dtype (independent oracle)."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return vals[torch.isfinite(vals) & (vals >= 0)].unique()


@pytest.mark.parametrize("k", [-20, -3, 0, 5, 30])
def test_fp4_representable_times_pow2_roundtrip_exactly(k):
    gen = torch.Generator().manual_seed(k + 100)
    grid = torch.tensor(FP4_GRID)
    vals = grid[torch.randint(0, 8, (4, 64), generator=gen)]
    vals = vals * torch.where(torch.rand(4, 64, generator=gen) < 0.5, -1.0, 1.0)
    vals[:, 0] = 6.0  # amax 6 in every block -> scale 2^0 before the 2^k factor
    vals[:, 32] = -4.0  # amax 4 also has exponent 2
    x = vals * 2.0**k
    t = quantize_mx(x, "fp4")
    assert torch.equal(dequantize_mx(t), x)
    assert (t.scales == k + 127).all()  # E8M0 byte = exponent + 127


@pytest.mark.parametrize("k", [-30, 0, 7])
def test_fp8_representable_times_pow2_roundtrip_exactly(k):
    grid = fp8_grid()  # 0 .. 448
    gen = torch.Generator().manual_seed(k + 200)
    vals = grid[torch.randint(0, len(grid), (3, 96), generator=gen)]
    vals = vals * torch.where(torch.rand(3, 96, generator=gen) < 0.5, -1.0, 1.0)
    vals[:, ::32] = 256.0  # block amax 2^8 = 2^emax -> scale exponent 0
    x = vals * 2.0**k
    t = quantize_mx(x, "fp8")
    assert torch.equal(dequantize_mx(t), x)
    assert (t.scales == k + 127).all()


def test_e8m0_scale_is_floor_log2_amax_minus_emax():
    x = torch.stack([block([5.9]), block([0.3]), block([1e-3]), block([1000.0]), block([])])
    t4, t8 = quantize_mx(x, "fp4"), quantize_mx(x, "fp8")
    # floor(log2) of 5.9, 0.3, 1e-3, 1000 = 2, -2, -10, 9; all-zero block -> byte 0
    assert t4.scales.flatten().tolist() == [2 - 2 + 127, -2 - 2 + 127, -10 - 2 + 127, 9 - 2 + 127, 0]
    assert t8.scales.flatten().tolist() == [2 - 8 + 127, -2 - 8 + 127, -10 - 8 + 127, 9 - 8 + 127, 0]
    assert torch.equal(dequantize_mx(t4)[4], torch.zeros(32))


def test_fp4_ties_round_to_even():
    # amax 6 pins the scale to 1; midpoints go to the neighbour with an even mantissa bit.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = block([6.0] + mids + [-m for m in mids])
    y = dequantize_mx(quantize_mx(x, "fp4"))
    assert y[1:8].tolist() == expect
    assert y[8:15].tolist() == [-e for e in expect]
    # just off a midpoint rounds to the nearer value
    assert dequantize_mx(quantize_mx(block([6.0, 2.51, 2.49]), "fp4"))[1:3].tolist() == [3.0, 2.0]


def test_fp8_ties_round_to_even():
    # scale 1 (amax 256); in [8, 16) the E4M3 step is 1: 8.5 -> 8 (even), 9.5 -> 10, 10.5 -> 10
    y = dequantize_mx(quantize_mx(block([256.0, 8.5, 9.5, 10.5, -9.5]), "fp8"))
    assert y[1:5].tolist() == [8.0, 10.0, 10.0, -10.0]


def test_saturation_instead_of_overflow():
    # amax 7.9: floor(log2) = 2 -> scale 1, 7.9 / 1 > 6 saturates to 6 (not inf / NaN)
    y = dequantize_mx(quantize_mx(block([7.9, -7.5, 6.9]), "fp4"))
    assert y[:3].tolist() == [6.0, -6.0, 6.0]
    # fp8: amax 500 -> scale 2^0, 500 saturates to 448 and 470 to 448
    y8 = dequantize_mx(quantize_mx(block([500.0, -470.0]), "fp8"))
    assert y8[:2].tolist() == [448.0, -448.0]


def test_fp4_packing_even_element_in_low_nibble():
    # codes: 0.5 -> 0b0001, 6.0 -> 0b0111, -1.0 -> 0b1010, 3.0 -> 0b0101
    t = quantize_mx(block([0.5, 6.0, -1.0, 3.0]), "fp4")
    assert t.data.dtype == torch.uint8 and t.data.shape == (16,)
    assert t.data[0].item() == 0x71  # element 0 (0.5) low, element 1 (6.0) high
    assert t.data[1].item() == 0x5A
    assert t.data[2:].eq(0).all()


def test_fp8_codes_match_torch_float8():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen) * 10
    t = quantize_mx(x, "fp8")
    scale = torch.pow(2.0, t.scales.float() - 127).repeat_interleave(32, dim=-1)
    torch_codes = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(t.data, torch_codes)


def test_error_bounded_and_shapes_with_padding():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 50, generator=gen, dtype=torch.bfloat16)
    for fmt, rel in (("fp4", 0.25), ("fp8", 0.07)):
        t = quantize_mx(x, fmt)
        assert isinstance(t, MXTensor) and t.shape == x.shape and t.fmt == fmt
        assert t.scales.shape == (2, 3, 2)
        assert t.data.shape == ((2, 3, 32) if fmt == "fp4" else (2, 3, 64))
        y = dequantize_mx(t)
        assert y.shape == x.shape and y.dtype == torch.float32
        # coarse sanity bound on the overall error (E2M1 has 1 mantissa bit, E4M3 has 3)
        assert ((y - x.float()).norm() / x.float().norm()).item() < rel
    assert dequantize_mx(quantize_mx(x, "fp8"), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_bad_inputs():
    with pytest.raises(ValueError, match="fmt"):
        quantize_mx(torch.ones(32), "fp6")
    with pytest.raises(TypeError, match="floating"):
        quantize_mx(torch.ones(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_mx(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="block"):
        quantize_mx(torch.ones(32), block=3)
