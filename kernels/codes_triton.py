"""Decoders for the packed number formats of DeepSeek-V4 checkpoints, and the encoders FP8 KV
records need, from their bits, shared by the Triton kernels (FP8 KV records in attention and the
cache writers, FP8/FP4 weights in the linear layers and experts).

They work with integer ops and bitcasts rather than fp8/fp4 dtypes: fp8 types need sm_89+, fp4 has
no Triton type, and the interpreter's float→fp8 cast rounds unlike torch and the GPU; bit
arithmetic gives every GPU and the interpreter the same, exact result for every value.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3(code):
    """e4m3 (fn) codes (int32 holding a byte) → fp32, by their bits: every GPU and the interpreter
    agree (fp8 types need sm_89+). Normals 2^(e−7)·(1 + m/8), subnormals m·2^−9; no NaN is stored."""
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)
    return tl.where((code & 128) != 0, -magnitude, magnitude)


@triton.jit
def e2m1(code):
    """e2m1 codes (int32 holding a nibble) → fp32: bit 3 sign, bits 2..1 exponent (bias 1), bit 0
    mantissa. Normals 2^(e−1)·(1 + m/2), exponent 0 is 0 or 0.5."""
    e = (code >> 1) & 3
    m = code & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(e > 0, normal, m.to(tl.float32) * 0.5)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def e8m0(byte):
    """e8m0 scale bytes (int32) → fp32 2^(byte − 127). Byte 0 is 2^−127, an fp32 subnormal (bits
    0x400000), which the exponent field alone cannot hold; byte 255 gives inf, as torch.ldexp."""
    return tl.where(byte == 0, 0x400000, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_code(x):
    """fp32 values of magnitude ≤ 448 (callers scale into range; beyond 464 this is no longer a
    code) → e4m3 (fn) codes (int32 holding a byte), rounded to nearest, ties to even, as torch's
    float8_e4m3fn conversion. Magnitudes below 2^−6 are subnormal codes round(|x|·2^9) (8 is the
    smallest normal, 2^−6: the same code either way); above, the fp32 mantissa's top 3 bits,
    rounded on the 20 below (a carry into the exponent is the right code)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 128
    exp32 = (bits >> 23) & 255  # biased by 127
    mant = bits & 0x7FFFFF
    # Normals: code = ((exp32 − 120) << 3) + top 3 mantissa bits, + 1 when rounding up.
    top = ((exp32 - 120) << 3) | (mant >> 20)
    rest = mant & 0xFFFFF
    normal = top + ((rest > 0x80000) | ((rest == 0x80000) & ((top & 1) == 1))).to(tl.int32)
    # Subnormals: |x|·2^9 = (mant | 2^23) >> (14 − (exp32 − 127)) (zero once shifted 24 or more).
    shift = tl.minimum(tl.maximum(141 - exp32, 0), 31)  # (lanes outside 0..31 are normals: discarded)
    full = mant | 0x800000
    q = full >> shift
    r = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((r > half) | ((r == half) & ((q & 1) == 1))).to(tl.int32)
    sub = tl.where(exp32 == 0, 0, sub)  # fp32 zero (and subnormals, far below e4m3's least)
    return sign | tl.where(exp32 >= 121, normal, sub)


@triton.jit
def ue8m0_exponent(amax):
    """The exponent e of the power-of-two scale 2^e that maps a group's largest magnitude `amax`
    (≥ 1e-4) into e4m3's range, as DeepSeek-V4 rounds it: ⌈log2(amax · (1/448))⌉ from the product's
    bits (its exponent, plus one unless the mantissa is zero)."""
    bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 255) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
