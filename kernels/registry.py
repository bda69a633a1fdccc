"""Which implementation of each kernel the model calls: `torch` (plain torch, any device) or
`triton` (fused kernels; on a CPU they run under Triton's interpreter, for tests). Each Triton
kernel has a plain-torch twin with the same signature, so the two sets are interchangeable.

`batch_invariant` swaps in the per-row forms of `kernels/invariant.py` wherever a batched op's
rounding depends on the batch (dense projections, and on the torch backend attention and indexer
scores), so that a request's logits are bitwise the same alone, in any batch and under any
chunking; the default keeps the batched ops and their speed."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Kernels:
    backend: str
    mhc_pre: Callable[..., Any]
    mhc_post: Callable[..., Any]
    sparse_attention: Callable[..., Any]
    rms_norm: Callable[..., Any]
    rope: Callable[..., Any]
    rms_norm_rope: Callable[..., Any]
    compress_decodes: Callable[..., Any]
    compress_chunk: Callable[..., Any]
    index_scores: Callable[..., Any]
    index_topk: Callable[..., Any]
    write_window: Callable[..., Any]
    write_decode_step: Callable[..., Any]  # a decode-only step's window and compressor writes (decode_writes.py)
    round_keys: Callable[..., Any]  # (keys [T, d], FP8 record) → as the record stores them
    linear: Callable[..., Any]  # (x [T, I], weight [O, I]) → [T, O]
    grouped_linear: Callable[..., Any]  # (x [T, G, I], weight [G, O, I]) → [T, G, O]
    rowwise: Callable[..., Any]  # (elementwise fn, x [T, ...]) → fn(x)
    route: Callable[..., Any]  # MoE gate logits → each token's experts and weights (kernels/moe.py)
    experts: Callable[..., Any]  # the routed and shared experts over the batch
    batch_invariant: bool = False
    # index_scores reads each row's keys through its block table (no gathered copy), so a prefill
    # chunk's rows can be scored one by one as decodes are, at no extra memory.
    paged_index_scores: bool = False


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """`auto` → Triton on CUDA (when installed), torch elsewhere; an explicit choice is checked."""
    if requested not in BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    on_cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if requested == "triton" and not triton_available():
        raise ValueError("--attention-backend triton: the triton package is not installed")
    return requested


def load_kernels(backend: str, device: torch.device | str = "cpu", batch_invariant: bool = False) -> Kernels:
    kernels = _backend_kernels(backend, device)
    return _batch_invariant(kernels) if batch_invariant else kernels


def _batch_invariant(kernels: Kernels) -> Kernels:
    """Per-row projections and per-row transcendental functions (MoE gate, SwiGLU, hc_head) on every
    backend. The Triton attention, indexer and mHC kernels already reduce each row on its own;
    the torch twins of attention, indexer scores and mHC's projection batch rows, so they get
    per-row forms. The compressors pool an entry the same way whether a decode step or a prefill
    chunk completes it: on torch one identical `pool` call per entry (`invariant.pool_entries`), on
    Triton kernels sharing their pooling code, each entry in a program of its own (so the fused
    decode-step writes stay). The experts run per
    row through the torch twin on both backends (the grouped Triton GEMM puts a token in a tile
    beside other tokens); the Triton router reduces each token on its own already. On the Triton
    backend, packed weights (dense projections and each expert's) go through the Triton
    quantized GEMM, batch-invariant by construction, in one launch; dense ones row by row."""
    from v4serve.kernels import invariant, mhc, moe

    linear, grouped_linear = invariant.linear_rows, invariant.grouped_linear_rows
    if kernels.backend == "triton":
        from v4serve.kernels import quant_linear_triton

        linear = quant_linear_triton.linear_invariant
        grouped_linear = quant_linear_triton.grouped_linear_invariant
    changes: dict[str, Any] = dict(batch_invariant=True, linear=linear,
                                   grouped_linear=grouped_linear, rowwise=invariant.rowwise_rows,
                                   experts=functools.partial(moe.experts, linear=linear,
                                                             rowwise=invariant.rowwise_rows))
    if kernels.backend == "torch":
        from v4serve.kernels import compressor, decode_writes

        pooling = invariant.pool_entries
        changes.update(sparse_attention=invariant.sparse_attention_rows, index_scores=invariant.index_scores_rows,
                       compress_decodes=functools.partial(compressor.compress_decodes, pooling=pooling),
                       compress_chunk=functools.partial(compressor.compress_chunk, pooling=pooling),
                       write_decode_step=functools.partial(decode_writes.write_decode_step, pooling=pooling),
                       mhc_pre=functools.partial(mhc.mhc_pre, linear=invariant.linear_rows,
                                                 mixing=mhc.mixing_matrix_per_token),
                       route=functools.partial(moe.route, rowwise=invariant.rowwise_rows))
    return dataclasses.replace(kernels, **changes)


def _backend_kernels(backend: str, device: torch.device | str) -> Kernels:
    from v4serve.kernels import invariant

    if backend == "torch":
        from v4serve.kernels import attention, compressor, decode_writes, indexer, kv_fp8, mhc, moe, norm_rope, paged

        return Kernels("torch", mhc.mhc_pre, mhc.mhc_post, attention.sparse_attention, norm_rope.rms_norm,
                       norm_rope.rope, norm_rope.rms_norm_rope, compressor.compress_decodes, compressor.compress_chunk,
                       indexer.index_scores, indexer.index_topk, paged.write_window,
                       decode_writes.write_decode_step, kv_fp8.round_keys,
                       invariant.linear, invariant.grouped_linear, invariant.rowwise, moe.route, moe.experts)
    if backend != "triton":
        raise ValueError(f"unknown kernel backend {backend!r}")
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton decides when it is imported whether kernels are compiled or interpreted
        # (v4serve.kernels sets this first on machines without CUDA).
        raise ValueError("Triton kernels on a CPU need Triton's interpreter: set TRITON_INTERPRET=1 before "
                         "triton is imported")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from v4serve.kernels import interpreter

        interpreter.install()
    from v4serve.kernels import (
        attention_triton,
        compressor_triton,
        decode_writes_triton,
        indexer_triton,
        kv_fp8_triton,
        mhc_triton,
        moe_triton,
        norm_rope_triton,
        paged_triton,
        quant_linear_triton,
    )

    return Kernels("triton", mhc_triton.mhc_pre, mhc_triton.mhc_post, attention_triton.sparse_attention,
                   norm_rope_triton.rms_norm, norm_rope_triton.rope, norm_rope_triton.rms_norm_rope,
                   compressor_triton.compress_decodes, compressor_triton.compress_chunk, indexer_triton.index_scores,
                   indexer_triton.index_topk, paged_triton.write_window,
                   decode_writes_triton.write_decode_step, kv_fp8_triton.round_keys,
                   quant_linear_triton.linear, quant_linear_triton.grouped_linear, invariant.rowwise, moe_triton.route,
                   moe_triton.experts, paged_index_scores=True)
