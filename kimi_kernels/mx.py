"""OCP Microscaling (MX) formats: MXFP4 (E2M1) and MXFP8 (E4M3) with E8M0 block scales.

Choices (documented here, tested in tests/kernels/test_kernels_mx.py):
- Blocks of `block` (32) consecutive elements along the LAST dim share one scale.
  A last dim that is not a multiple of `block` is zero-padded; `shape` keeps the original.
- Scale (OCP rule): X = 2^(floor(log2 amax) - emax_elem), emax_elem = 2 (E2M1), 8 (E4M3);
  the exponent is clamped to [-127, 127] and stored as the E8M0 byte exponent + 127.
  An all-zero block gets byte 0 (X = 2^-127); 0xFF (NaN) is never produced.
- Elements: P = saturate(round_to_nearest_even(V / X)) on the element grid (subnormals
  included). With this rule V/X < 2^(emax+1), so values above the largest element
  (6 for E2M1, 448 for E4M3) saturate to it instead of overflowing.
- Codes: sign bit on top, then exponent, then mantissa (E2M1: 4 bits, E4M3: 8 bits;
  E4M3 has no infinities, 0x7F/0xFF are NaN and never produced).
- FP4 packing: two codes per byte, the even element in the LOW nibble (gpt-oss, torchao).
- Non-finite inputs are rejected (weights with NaN/inf are a bug upstream).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["MXTensor", "quantize_mx", "dequantize_mx", "FORMATS"]

Tensor = torch.Tensor
Fmt = Literal["fp4", "fp8"]


@dataclass(frozen=True)
class _ElemFormat:
    ebits: int
    mbits: int
    bias: int
    emax: int  # exponent of the largest normal binade
    max_value: float

    @property
    def emin(self) -> int:  # exponent of the smallest normal binade
        return 1 - self.bias

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


FORMATS: dict[str, _ElemFormat] = {
    "fp4": _ElemFormat(ebits=2, mbits=1, bias=1, emax=2, max_value=6.0),
    "fp8": _ElemFormat(ebits=4, mbits=3, bias=7, emax=8, max_value=448.0),
}


@dataclass
class MXTensor:
    """Quantised tensor: `data` codes (fp4: two per byte), `scales` E8M0 bytes, one per block."""

    data: Tensor  # uint8 [..., L/2] (fp4) or [..., L] (fp8); L = last dim padded to `block`
    scales: Tensor  # uint8 [..., L/block]
    shape: torch.Size  # original shape
    fmt: str
    block: int = 32

    def to(self, device: torch.device | str) -> "MXTensor":
        return MXTensor(self.data.to(device), self.scales.to(device), self.shape, self.fmt, self.block)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel()


def _decode_table(f: _ElemFormat, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Value of every code 0 .. 2^bits - 1 (NaN codes of E4M3 decode to NaN)."""
    codes = torch.arange(2**f.bits, device=device)
    sign = torch.where((codes >> (f.bits - 1)) & 1 == 1, -1.0, 1.0)
    e = (codes >> f.mbits) & ((1 << f.ebits) - 1)
    m = (codes & ((1 << f.mbits) - 1)).double()
    normal = (1 + m / 2**f.mbits) * torch.pow(2.0, (e - f.bias).double())
    sub = (m / 2**f.mbits) * 2.0**f.emin
    vals = sign.double() * torch.where(e > 0, normal, sub)
    if f.bits == 8:  # E4M3: S.1111.111 is NaN, no infinities
        vals = torch.where((codes & 0x7F) == 0x7F, float("nan"), vals)
    return vals.to(dtype)


def _round_to_grid(y: Tensor, f: _ElemFormat) -> Tensor:
    """Round |y| to the nearest representable magnitude, ties to even, then saturate."""
    a = y.abs()
    # exponent of the binade of a (subnormal range uses the emin quantum)
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))).clamp(min=f.emin)
    quantum = torch.pow(2.0, e - f.mbits).to(y.dtype)
    r = torch.round(a / quantum) * quantum  # torch.round is round-half-to-even
    return r.clamp(max=f.max_value)


def _encode(mag: Tensor, negative: Tensor, f: _ElemFormat) -> Tensor:
    """Codes (uint8) for representable magnitudes `mag`."""
    normal = mag >= 2.0**f.emin
    e = torch.floor(torch.log2(torch.where(normal, mag, torch.ones_like(mag)))).clamp(min=f.emin)
    man_normal = mag / torch.pow(2.0, e).to(mag.dtype) * 2**f.mbits - 2**f.mbits
    man_sub = mag / 2.0 ** (f.emin - f.mbits)
    man = torch.where(normal, man_normal, man_sub).round().to(torch.int64)
    exp_field = torch.where(normal, e.to(torch.int64) + f.bias, torch.zeros_like(man))
    code = (exp_field << f.mbits) | man
    code = code | (negative & (mag > 0)).to(torch.int64) << (f.bits - 1)  # no negative zero
    return code.to(torch.uint8)


def quantize_mx(x: Tensor, fmt: Fmt = "fp4", block: int = 32) -> MXTensor:
    """Quantise `x` to MXFP4 ("fp4") or MXFP8 ("fp8") over blocks along the last dim."""
    if fmt not in FORMATS:
        raise ValueError(f"quantize_mx: fmt must be 'fp4' or 'fp8', got {fmt!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize_mx: x must be a floating tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0:
        raise ValueError("quantize_mx: x must have at least one dim")
    if block < 2 or block % 2:
        raise ValueError(f"quantize_mx: block must be an even int >= 2, got {block}")
    if not torch.isfinite(x).all():
        raise ValueError("quantize_mx: x contains NaN or inf")
    f = FORMATS[fmt]
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    shape = x.shape
    L = shape[-1]
    pad = (-L) % block
    xf = F.pad(x.to(cd), (0, pad)).reshape(*shape[:-1], (L + pad) // block, block)

    amax = xf.abs().amax(-1, keepdim=True)
    exp = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - f.emax
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127.0)).clamp(-127, 127)
    y = xf * torch.pow(2.0, -exp)  # exact: multiplication by a power of two
    codes = _encode(_round_to_grid(y, f), y < 0, f).reshape(*shape[:-1], L + pad)
    if fmt == "fp4":  # element 2i in the low nibble, 2i+1 in the high nibble
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return MXTensor(data=codes.contiguous(), scales=scales.contiguous(), shape=shape, fmt=fmt, block=block)


def dequantize_mx(t: MXTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Values of an MXTensor in `dtype` (float32 by default), in its original shape."""
    if t.fmt not in FORMATS:
        raise ValueError(f"dequantize_mx: unknown fmt {t.fmt!r}")
    if t.data.dtype != torch.uint8 or t.scales.dtype != torch.uint8:
        raise TypeError(f"dequantize_mx: data and scales must be uint8, got {t.data.dtype}, {t.scales.dtype}")
    f = FORMATS[t.fmt]
    codes = t.data
    if t.fmt == "fp4":
        codes = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)
    Lp = codes.shape[-1]
    if Lp % t.block or t.scales.shape[-1] != Lp // t.block:
        raise ValueError(f"dequantize_mx: {Lp} codes do not match {t.scales.shape[-1]} scales of block {t.block}")
    # float32 is exact here for scales from finite float32 inputs (2^-127 is a float32 subnormal)
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    vals = _decode_table(f, cd, codes.device)[codes.long()]
    s = t.scales.to(cd)
    scale = torch.where(t.scales == 0xFF, float("nan"), torch.pow(2.0, s - 127))
    out = (vals.reshape(*codes.shape[:-1], Lp // t.block, t.block) * scale.unsqueeze(-1)).reshape(*codes.shape)
    return out[..., : t.shape[-1]].reshape(t.shape).to(dtype)
