"""Triton Lightning Indexer for any rows of a ragged batch (decodes, and a prefill chunk's rows,
which share one block table): scores and top-k, the twins of `indexer.index_scores` and
`indexer.index_topk`.

Scores: one program per (query, tile of entries): the keys are gathered through the block table,
q·kᵀ for every head is one `tl.dot`, then relu, the head weights and the sum over heads. Each score
is reduced on its own (fixed order), whatever the batch. Top-k: each query on its own, a radix
select over the scores' bits (under tensor parallelism the scores are all-reduced in between, so
the two stay separate launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels.launches import interpreting, launch


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, keys_ptr, tables_ptr, counts_ptr, out_ptr, HI, DI, n, table_stride, w_stride,
                         w_scale,
                         PER_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Heads in chunks of BLOCK_H, their weighted relu'd dots summed chunk after chunk. The dot runs
    in the keys' dtype: with bf16 keys (a bf16 model) on the tensor cores, exact, since the queries
    were bf16 before the indexer widened them; with fp32 keys as an fp32 ("ieee") dot."""
    r = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < DI
    count = tl.load(counts_ptr + r)
    visible = e < count
    scores = tl.full([BLOCK_N], float("-inf"), tl.float32)
    # A tile past the row's entries only writes −inf: at a fixed width (a captured step) most are.
    if tl.program_id(1) * BLOCK_N < count:
        blk = tl.load(tables_ptr + r * table_stride + e // PER_BLOCK, mask=visible, other=0)
        k = tl.load(keys_ptr + (blk * PER_BLOCK + e % PER_BLOCK)[:, None] * DI + dims[None, :],
                    mask=visible[:, None] & dim_ok[None, :], other=0.0)
        summed = tl.zeros([BLOCK_N], tl.float32)
        for h0 in range(0, HI, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            head_ok = heads < HI
            q = tl.load(q_ptr + (r * HI + heads[:, None]) * DI + dims[None, :],
                        mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(keys_ptr.dtype.element_ty)
            w = tl.load(w_ptr + r * w_stride + heads, mask=head_ok, other=0.0).to(tl.float32) * w_scale
            logits = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32), 0.0)
            summed += tl.sum(logits * w[:, None], axis=0)  # logits [H, N]
        scores = tl.where(visible, summed, float("-inf"))
    tl.store(out_ptr + r * n + e, scores, mask=e < n)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                 n: int, w_scale: float = 1.0) -> torch.Tensor:
    rows, hi, di = q.shape
    out = torch.empty(rows, n, dtype=torch.float32, device=q.device)
    if rows == 0 or n == 0:
        return out
    big = interpreting()  # the interpreter pays per op: every head at once, wide entry tiles
    block_n = 128 if big else 32
    block_h = max(triton.next_power_of_2(hi), 16) if big else 16  # tl.dot's smallest tile
    # A row stride of 0 is one table read by every row (a prefill chunk's rows): never copied; the head
    # weights may be a column slice of a wider projection, read in place.
    tables, w = (t if t.stride(-1) == 1 else t.contiguous() for t in (tables, w))
    launch(_index_scores_kernel, (rows, triton.cdiv(n, block_n)),
           q.contiguous(), w, keys, tables, counts.contiguous(), out, hi, di, n, tables.stride(0), w.stride(0),
           w_scale, PER_BLOCK=keys.shape[1], BLOCK_H=block_h,
           BLOCK_D=max(triton.next_power_of_2(di), 16), BLOCK_N=block_n, PRECISION="ieee")
    return out


@triton.jit
def _index_topk_kernel(scores_ptr, counts_ptr, out_ptr, R, n, K, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """BLOCK_R rows per program, each on its own: a radix select of the row's k-th best score over
    the scores' bits, 8 bits a round from the top (a histogram per round), then one pass writing
    every entry above it and as many equal to it as k needs, in entry order."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < R
    count = tl.load(counts_ptr + r, mask=row_ok, other=0)
    need = tl.minimum(count, K)  # invisible entries score −inf
    # Entries past every row's count score −inf and are never picked: the walks stop at the widest
    # row's count, not at the table's width (a captured step's fixed width, sized for max-model-len).
    stop = tl.minimum(tl.max(count, axis=0), n)
    bins = tl.arange(0, 512)  # digits 0..255, and 256 for entries not matching the prefix (dropped)
    local = tl.arange(0, BLOCK_R)[:, None] * 512  # each row's own bins in one histogram
    prefix = tl.zeros([BLOCK_R], tl.int32)  # each row's k-th best key: the bits found so far
    known = tl.zeros([BLOCK_R], tl.int32)  # which of them
    left = need  # entries still to pick among those matching the prefix
    for shift in tl.static_range(24, -8, -8):
        hist = tl.zeros([BLOCK_R, 512], tl.int32)
        for e0 in range(0, stop, BLOCK_N):
            e = e0 + tl.arange(0, BLOCK_N)
            ok = row_ok[:, None] & (e < stop)[None, :]
            key = _ordered(tl.load(scores_ptr + r[:, None] * n + e[None, :], mask=ok, other=float("-inf")))
            matches = ok & ((key & known[:, None]) == prefix[:, None])
            # Each entry's bin in its row's histogram (not `digit`: that name carries a round's result
            # across rounds, and a loop may not change a carried variable's shape).
            bin_of = tl.where(matches, (key >> shift) & 255, 256) + local
            hist += tl.reshape(tl.histogram(tl.reshape(bin_of, [BLOCK_R * BLOCK_N]), BLOCK_R * 512), [BLOCK_R, 512])
        hist = tl.where(bins[None, :] < 256, hist, 0)
        at_least = tl.cumsum(hist, 1, reverse=True)  # candidates whose digit is ≥ each bin
        digit = tl.sum((at_least >= left[:, None]).to(tl.int32), axis=1) - 1
        left -= tl.sum(tl.where(bins[None, :] == digit[:, None], at_least - hist, 0), axis=1)  # above: all picked
        prefix |= digit << shift
        known |= tl.full([BLOCK_R], 255, tl.int32) << shift
    above = need - left
    taken_above = tl.zeros([BLOCK_R], tl.int32)
    taken_equal = tl.zeros([BLOCK_R], tl.int32)
    for e0 in range(0, stop, BLOCK_N):
        e = e0 + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (e < stop)[None, :] & (0 < need[:, None])
        key = _ordered(tl.load(scores_ptr + r[:, None] * n + e[None, :], mask=ok, other=float("-inf")))
        over = ok & (_flip(key) > _flip(prefix[:, None]))  # the ordered keys compare as unsigned
        same = ok & (key == prefix[:, None])
        slot_over = taken_above[:, None] + tl.cumsum(over.to(tl.int32), 1) - 1
        slot_same = taken_equal[:, None] + tl.cumsum(same.to(tl.int32), 1) - 1
        at = out_ptr + r[:, None] * K
        tl.store(at + slot_over, e[None, :], mask=over)
        tl.store(at + above[:, None] + slot_same, e[None, :], mask=same & (slot_same < left[:, None]))
        taken_above += tl.sum(over.to(tl.int32), axis=1)
        taken_equal += tl.sum(same.to(tl.int32), axis=1)
    rest = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + r[:, None] * K + rest[None, :], tl.full([BLOCK_R, BLOCK_K], -1, tl.int64),
             mask=row_ok[:, None] & (rest[None, :] >= need[:, None]) & (rest < K)[None, :])


@triton.jit
def _ordered(score):
    """fp32 → int32 bits whose unsigned order is the scores' order (negatives' bits reversed, the
    sign bit flipped)."""
    bits = score.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) | (-2147483648))


@triton.jit
def _flip(key):
    """Unsigned order as signed: flip the top bit."""
    return key ^ (-2147483648)


def index_topk(scores: torch.Tensor, counts: torch.Tensor, k: int, full: bool = False) -> torch.Tensor:
    """The twin's contract (`indexer.index_topk`); `full` changes nothing here (the kernel writes
    −1 past a row's count as it goes)."""
    rows, n = scores.shape
    out = torch.empty(rows, k, dtype=torch.long, device=scores.device)
    if rows and k:
        # One row a program on a GPU; the interpreter pays per op, not per element, so it takes many.
        if interpreting():
            block_r, block_n = 32, min(triton.next_power_of_2(n), 1024 // 32)
        else:  # two entry tiles whatever the context: two compiles, not one per power of two
            block_r, block_n = 1, 128 if n <= 128 else 1024
        launch(_index_topk_kernel, (triton.cdiv(rows, block_r),), scores.contiguous(), counts.contiguous(), out,
               rows, n, k, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k))
    return out
