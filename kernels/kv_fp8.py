"""FP8 keys (`--kv-cache-dtype fp8`): the window rows and compressed entries stored as DeepSeek-V4
quantizes its KV — the non-rope channels as e4m3 codes with one power-of-two (e8m0) scale per 64
channels, the rope channels unquantized in the compute dtype. A record's byte layout is
`v4serve.cache.layout.KVRecord`: [codes: nope][scale exponents: groups][padding][rope].

Plain torch; every writer encodes through `encode` and every reader decodes through `decode`, so a
stored key is exactly `decode(encode(key))` wherever it is read. Indexer keys and the compressors'
pending rows stay in the compute dtype (they are small and feed selections and pooling).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
GROUP = 64  # channels per scale
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
    # The smallest power of two that maps the group's largest magnitude into e4m3's range.
    exponent = torch.ceil(torch.log2(nope.abs().amax(-1).clamp(min=_MIN_AMAX) / E4M3_MAX))  # [..., groups]
    codes = (nope * torch.exp2(-exponent)[..., None]).flatten(-2)[..., :record.nope]
    out = torch.zeros(*rows.shape[:-1], record.nbytes, dtype=torch.uint8, device=rows.device)
    out[..., :record.nope] = codes.to(torch.float8_e4m3fn).view(torch.uint8)
    out[..., record.nope:record.nope + record.groups] = (exponent + SCALE_BIAS).to(torch.uint8)
    rope = x[..., record.nope:].to(getattr(torch, record.rope_dtype)).contiguous()
    out[..., record.rope_offset:] = rope.view(torch.uint8)
    return out


def decode(records: torch.Tensor, record: Record, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """records [..., nbytes] (uint8) → keys [..., d] in `dtype`."""
    codes = records[..., :record.nope].view(torch.float8_e4m3fn).float()
    exponent = records[..., record.nope:record.nope + record.groups].float() - SCALE_BIAS
    nope = codes * torch.exp2(exponent).repeat_interleave(GROUP, dim=-1)[..., :record.nope]
    rope = records[..., record.rope_offset:].contiguous().view(getattr(torch, record.rope_dtype))
    return torch.cat([nope, rope.float()], dim=-1).to(dtype)


def stored(rows: torch.Tensor, storage: torch.Tensor, record: Record | None) -> torch.Tensor:
    """Rows as `storage` keeps them: FP8 records when a record layout is given, else its dtype."""
    return encode(rows, record) if record is not None else rows.to(storage.dtype)


def loaded(values: torch.Tensor, record: Record | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows back as keys in `dtype` (the inverse of `stored`, up to FP8 rounding)."""
    return decode(values, record, dtype) if record is not None else values.to(dtype)
