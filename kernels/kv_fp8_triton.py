"""FP8 keys in Triton: the twin of `kv_fp8` for the kernels. `store_record` is the record writer
every Triton writer of the caches shares (windows in `paged_triton`, entries in the compressor
kernels); `round_keys` rounds a step's keys as they will be stored.

A record is built from bits: each 64-channel group's scale exponent as DeepSeek-V4 rounds it and
the e4m3 codes rounded to nearest even, both by integer arithmetic (`codes_triton`), so a record
written here is byte for byte the torch twin's on any GPU and in the interpreter. The rope
channels go through the same bytes viewed in the rope dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels.codes_triton import e4m3, e4m3_code, ue8m0_exponent
from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.launches import launch


@triton.jit
def _exponents(x, dims, NOPE, GROUPS: tl.constexpr, scale_ptr, STORE: tl.constexpr):
    """x [BLOCK_D] fp32 → e [BLOCK_D] int32: the scale exponent of each nope channel's 64-channel
    group (0 on the rope channels). With STORE, each group's scale byte (e + 127) goes to
    `scale_ptr + g`."""
    e = tl.zeros(x.shape, tl.int32)
    for g in tl.static_range(GROUPS):
        in_group = (dims < NOPE) & (dims // 64 == g)
        e_g = ue8m0_exponent(tl.maximum(tl.max(tl.where(in_group, tl.abs(x), 0.0), axis=0), 1e-4))
        if STORE:
            tl.store(scale_ptr + g, (e_g + 127).to(tl.uint8))
        e = tl.where(in_group, e_g, e)
    return e


@triton.jit
def pow2(e):
    """2^e (int32 e within fp32's normal exponents), exactly."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def store_record(ptr, rope_ptr, row, x, dims, D, NOPE, STRIDE, ROPE_OFF, ROPE_STRIDE, ROPE_OFF_BYTES,
                 GROUPS: tl.constexpr, PAD: tl.constexpr):
    """Key x [BLOCK_D] (fp32, channels `dims`) → FP8 record `row` of `ptr` (bytes; `rope_ptr` the
    same storage in the rope dtype, offsets in its units): codes, scale bytes, zero padding, rope."""
    nope = dims < NOPE
    base = ptr + row * STRIDE
    e = _exponents(x, dims, NOPE, GROUPS, base + NOPE, STORE=True)
    tl.store(base + dims, e4m3_code(x * pow2(-e)).to(tl.uint8), mask=nope)
    pad = NOPE + GROUPS + tl.arange(0, PAD)
    tl.store(base + pad, tl.zeros([PAD], tl.uint8), mask=pad < ROPE_OFF_BYTES)
    tl.store(rope_ptr + row * ROPE_STRIDE + ROPE_OFF + (dims - NOPE), x.to(rope_ptr.dtype.element_ty),
             mask=~nope & (dims < D))


def record_args(record: Record | None, storage: torch.Tensor) -> dict:
    """`store_record`'s geometry arguments for `storage` (plus `FP8`); any placeholders without a
    record (the kernels then never write one)."""
    if record is None:
        return {"rope_ptr": storage, "STRIDE": 0, "NOPE": 0, "ROPE_OFF": 0, "ROPE_STRIDE": 0, "ROPE_OFF_BYTES": 0,
                "GROUPS": 1, "PAD": 1, "FP8": False}
    rope_dtype = getattr(torch, record.rope_dtype)
    item = torch.empty((), dtype=rope_dtype).element_size()
    pad = record.rope_offset - record.nope - record.groups
    return {"rope_ptr": storage.view(rope_dtype), "STRIDE": record.nbytes, "NOPE": record.nope,
            "ROPE_OFF": record.rope_offset // item, "ROPE_STRIDE": record.nbytes // item,
            "ROPE_OFF_BYTES": record.rope_offset, "GROUPS": record.groups,
            "PAD": triton.next_power_of_2(max(pad, 1)), "FP8": True}


@triton.jit
def _round_keys_kernel(x_ptr, out_ptr, D, NOPE, GROUPS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + r * D + dims, mask=dims < D, other=0.0).to(tl.float32)
    e = _exponents(x, dims, NOPE, GROUPS, x_ptr, STORE=False)
    nope = e4m3(e4m3_code(x * pow2(-e))) * pow2(e)  # encoded, then decoded as a reader would
    rope = x.to(out_ptr.dtype.element_ty)  # the rope channels are stored in the compute dtype
    tl.store(out_ptr + r * D + dims, tl.where(dims < NOPE, nope.to(out_ptr.dtype.element_ty), rope), mask=dims < D)


def round_keys(rows: torch.Tensor, record: Record) -> torch.Tensor:
    """rows [T, d] → the keys an FP8 record of each holds, in the rows' dtype (kv_fp8.round_keys).
    The rope channels pass unchanged: a record keeps them in the compute dtype, the rows' own."""
    assert getattr(torch, record.rope_dtype) == rows.dtype, "records keep the rope channels in the keys' dtype"
    out = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    if rows.shape[0]:
        launch(_round_keys_kernel, (rows.shape[0],), rows.contiguous(), out, rows.shape[1], record.nope,
               GROUPS=record.groups, BLOCK_D=triton.next_power_of_2(rows.shape[1]))
    return out
