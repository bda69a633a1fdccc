"""Which implementation of each kernel the model calls: `torch` (plain torch, any device) or
`triton` (fused kernels; on a CPU they run under Triton's interpreter, for tests). Each Triton
kernel has a plain-torch twin with the same signature, so the two sets are interchangeable."""

from __future__ import annotations

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
    index_scores: Callable[..., Any]
    write_window: Callable[..., Any]


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


def load_kernels(backend: str, device: torch.device | str = "cpu") -> Kernels:
    if backend == "torch":
        from v4serve.kernels import attention, compressor, indexer, mhc, norm_rope, paged

        return Kernels("torch", mhc.mhc_pre, mhc.mhc_post, attention.sparse_attention, norm_rope.rms_norm,
                       norm_rope.rope, norm_rope.rms_norm_rope, compressor.compress_decodes, indexer.index_scores,
                       paged.write_window)
    if backend != "triton":
        raise ValueError(f"unknown kernel backend {backend!r}")
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton decides when it is imported whether kernels are compiled or interpreted
        # (v4serve.kernels sets this first on machines without CUDA).
        raise ValueError("Triton kernels on a CPU need Triton's interpreter: set TRITON_INTERPRET=1 before "
                         "triton is imported")
    from v4serve.kernels import (
        attention_triton,
        compressor_triton,
        indexer_triton,
        mhc_triton,
        norm_rope_triton,
        paged_triton,
    )

    return Kernels("triton", mhc_triton.mhc_pre, mhc_triton.mhc_post, attention_triton.sparse_attention,
                   norm_rope_triton.rms_norm, norm_rope_triton.rope, norm_rope_triton.rms_norm_rope,
                   compressor_triton.compress_decodes, indexer_triton.index_scores, paged_triton.write_window)
