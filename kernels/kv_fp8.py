"""FP8 keys (`--kv-cache-dtype fp8`): the window rows and compressed entries stored as DeepSeek-V4
quantizes its KV — the non-rope channels as e4m3 codes with one power-of-two (e8m0) scale per 64
channels, the rope channels unquantized in the compute dtype. A record's byte layout is
`v4serve.cache.layout.KVRecord`: [codes: nope][scale exponents: groups][padding][rope].

Plain torch, the twin of `kv_fp8_triton`: every writer encodes through `encode` (or the Triton
`store_record`, byte for byte the same) and every reader decodes as `decode` does (the attention
kernel decodes records from the same bits), so a stored key is exactly `decode(encode(key))`
wherever it is read. Indexer keys and the compressors'
pending rows stay in the compute dtype (they are small and feed selections and pooling).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
GROUP = 64  # channels per scale
ENCODING = "e4m3+ue8m0"  # a change of how keys are rounded must change the SSD store's namespace
SCALE_BIAS = 127  # an e8m0 byte b means the scale 2 ** (b − 127)
_MIN_AMAX = 1e-4  # an all-zero group still gets a finite scale


class Record(Protocol):
    @property
    def nope(self) -> int: ...
    @property
    def groups(self) -> int: ...
    @property
    def rope_offset(self) -> int: ...
    @property
    def rope_dim(self) -> int: ...
    @property
    def rope_dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...


def encode(rows: torch.Tensor, record: Record) -> torch.Tensor:
    """rows [..., d] → records [..., nbytes] (uint8)."""
    x = rows.float()
    nope = F.pad(x[..., :record.nope], (0, record.groups * GROUP - record.nope))
    nope = nope.unflatten(-1, (record.groups, GROUP))  # [..., groups, 64]
    exponent = ue8m0_exponent(nope.abs().amax(-1).clamp(min=_MIN_AMAX))  # [..., groups]
    codes = (nope * torch.exp2(-exponent.float())[..., None]).flatten(-2)[..., :record.nope]
    out = torch.zeros(*rows.shape[:-1], record.nbytes, dtype=torch.uint8, device=rows.device)
    out[..., :record.nope] = codes.to(torch.float8_e4m3fn).view(torch.uint8)
    out[..., record.nope:record.nope + record.groups] = (exponent + SCALE_BIAS).to(torch.uint8)
    rope = x[..., record.nope:].to(getattr(torch, record.rope_dtype)).contiguous()
    out[..., record.rope_offset:] = rope.view(torch.uint8)
    return out


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The exponent e of the power-of-two scale 2^e that maps a group's largest magnitude `amax`
    (fp32, ≥ 1e-4) into e4m3's range, as DeepSeek-V4 rounds its scales: ⌈log2(amax · (1/448))⌉
    taken from the product's bits (its exponent, plus one unless the mantissa is zero), so every
    device and the Triton writers (`codes_triton.ue8m0_exponent`) agree bit for bit → int32."""
    bits = (amax.float() * (1.0 / E4M3_MAX)).view(torch.int32)
    return ((bits >> 23) & 255) - 127 + ((bits & 0x7FFFFF) != 0).int()


def decode(records: torch.Tensor, record: Record, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """records [..., nbytes] (uint8) → keys [..., d] in `dtype`."""
    codes = records[..., :record.nope].view(torch.float8_e4m3fn).float()
    exponent = records[..., record.nope:record.nope + record.groups].float() - SCALE_BIAS
    nope = codes * torch.exp2(exponent).repeat_interleave(GROUP, dim=-1)[..., :record.nope]
    rope = records[..., record.rope_offset:].contiguous().view(getattr(torch, record.rope_dtype))
    return torch.cat([nope, rope.float()], dim=-1).to(dtype)


def round_keys(rows: torch.Tensor, record: Record) -> torch.Tensor:
    """rows [T, d] → the keys an FP8 record of each holds, in the rows' dtype: a step's own keys are
    used as they will be read back (the twin of `kv_fp8_triton.round_keys`)."""
    return decode(encode(rows, record), record, rows.dtype)


def stored(rows: torch.Tensor, storage: torch.Tensor, record: Record | None) -> torch.Tensor:
    """Rows as `storage` keeps them: FP8 records when a record layout is given, else its dtype."""
    return encode(rows, record) if record is not None else rows.to(storage.dtype)


def loaded(values: torch.Tensor, record: Record | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows back as keys in `dtype` (the inverse of `stored`, up to FP8 rounding)."""
    return decode(values, record, dtype) if record is not None else values.to(dtype)
