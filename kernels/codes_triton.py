"""Decoders for the packed number formats of DeepSeek-V4 checkpoints, from their bits, shared by
the Triton kernels (FP8 KV records in attention, FP8/FP4 weights in the linear layers and experts).

They build fp32 values with integer ops and bitcasts rather than fp8/fp4 dtypes: fp8 types need
sm_89+, fp4 has no Triton type, and bit arithmetic gives every GPU and the interpreter the same,
exact value for every code.
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
