"""Every Triton kernel against its plain-torch twin (kernels/registry.py pairs them). Without a GPU
the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by `load_kernels`); on
a CUDA machine the same tests run them compiled (bench/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from tests import test_moe as moe_tests  # a module, so its tests are not collected here twice
from tests.helpers import requires_triton
from v4serve.kernels.attention import RaggedBatch
from v4serve.kernels.launches import LaunchCounter
from v4serve.kernels.registry import load_kernels, resolve_backend

pytestmark = requires_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TWIN = load_kernels("torch")


@pytest.fixture(scope="module")
def triton_kernels():
    return load_kernels("triton", DEVICE)


def rand(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-6) -> None:
    """fp32 results that differ only in reduction order."""
    assert a.shape == b.shape and a.dtype == b.dtype
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol * max(1.0, b.abs().max().item()), f"max error {err:.3g}"


# ---- mHC -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "dim"), [(1, 128), (5, 200), (17, 64), (33, 96)])
def test_mhc_pre_and_post_equal_their_twins(triton_kernels, tokens: int, dim: int) -> None:
    """Token counts below, at and across the kernels' token tiles; widths that are not a multiple
    of the column tile."""
    gen = torch.Generator().manual_seed(tokens * dim)
    hc = 4
    h = rand(tokens, hc, dim, gen=gen)
    # Mixing weights that keep the logits' size at any width (past 1K inputs, as a trained model's do).
    fn_scale = 0.05 * min(1.0, (1024 / (hc * dim)) ** 0.5)
    fn, base = rand((2 + hc) * hc, hc * dim, gen=gen, scale=fn_scale), rand((2 + hc) * hc, gen=gen)
    scale = (torch.rand(3, generator=gen) + 0.5).to(DEVICE)
    want = TWIN.mhc_pre(h, fn, base, scale, 1e-6, 1e-6, 20)
    got = triton_kernels.mhc_pre(h, fn, base, scale, 1e-6, 1e-6, 20)
    # The mixing sums hc·dim products: in another order they part by ~sqrt(hc·dim) roundings.
    tol = 2e-6 * max(1.0, (hc * dim / 1024) ** 0.5)
    for g, w in zip(got, want, strict=True):
        close(g, w, tol)
    _, post, comb = want
    # Sinkhorn ends on a column normalisation and leaves rows nearly normalised too.
    assert torch.allclose(got[2].sum(-2), torch.ones(tokens, hc, device=DEVICE), atol=1e-4)
    assert torch.allclose(got[2].sum(-1), torch.ones(tokens, hc, device=DEVICE), atol=2e-2)
    y = rand(tokens, dim, gen=gen)
    close(triton_kernels.mhc_post(h, y, post, comb), TWIN.mhc_post(h, y, post, comb))
    # The pre kernel's gates are views of one buffer (rows hc + hc² apart): read in place.
    close(triton_kernels.mhc_post(h, y, got[1], got[2]), TWIN.mhc_post(h, y, post, comb))
    # With the sublayer's RMSNorm fused in: x normalised, the gates unchanged.
    weight = rand(dim, gen=gen)
    normed = triton_kernels.mhc_pre(h, fn, base, scale, 1e-6, 1e-6, 20, weight)
    close(normed[0], TWIN.rms_norm(want[0], weight, 1e-6), tol)
    assert torch.equal(normed[1], got[1]) and torch.equal(normed[2], got[2])


def test_mhc_pre_of_one_token_does_not_depend_on_its_batch_mates(triton_kernels) -> None:
    gen = torch.Generator().manual_seed(3)
    h = rand(20, 4, 64, gen=gen)
    fn, base, scale = rand(24, 256, gen=gen, scale=0.05), rand(24, gen=gen), torch.ones(3, device=DEVICE)
    alone = triton_kernels.mhc_pre(h[7:8], fn, base, scale, 1e-6, 1e-6, 20)
    batched = triton_kernels.mhc_pre(h, fn, base, scale, 1e-6, 1e-6, 20)
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a[0], b[7])


# ---- RMSNorm and RoPE ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("shape", "rope_dim"), [((7, 4, 64), 16), ((70, 72), 8), ((1, 128), 64), ((3, 2, 16), 16)])
@pytest.mark.parametrize("weighted", [True, False])
def test_norm_and_rope_equal_their_twins(triton_kernels, shape: tuple[int, ...], rope_dim: int,
                                         weighted: bool) -> None:
    """Per-head rows sharing one position's angles, widths that are not a power of two, more rows
    than one tile, the whole vector rotated, and the inverse rotation."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = rand(*shape, gen=gen)
    weight = rand(shape[-1], gen=gen) if weighted else None
    angles = rand(shape[0], rope_dim // 2, gen=gen)
    cos, sin = angles.cos(), angles.sin()
    close(triton_kernels.rms_norm(x, weight, 1e-6), TWIN.rms_norm(x, weight, 1e-6))
    close(triton_kernels.rope(x, cos, sin), TWIN.rope(x, cos, sin))
    close(triton_kernels.rope(x, cos, sin, inverse=True), TWIN.rope(x, cos, -sin))
    close(TWIN.rope(x, cos, sin, inverse=True), TWIN.rope(x, cos, -sin))
    close(triton_kernels.rms_norm_rope(x, weight, 1e-6, cos, sin), TWIN.rms_norm_rope(x, weight, 1e-6, cos, sin))
    # Each rotates back exactly what it rotated (the model relies on it for V = K).
    close(TWIN.rope(TWIN.rope(x, cos, sin), cos, sin, inverse=True), x, tol=1e-5)
    close(triton_kernels.rope(triton_kernels.rope(x, cos, sin), cos, sin, inverse=True), x, tol=1e-5)


def test_norm_and_rope_read_column_slices_in_place(triton_kernels) -> None:
    """Inputs that are column slices of a wider projection (fused GEMMs), per token and per head."""
    gen = torch.Generator().manual_seed(5)
    wide = rand(9, 200, gen=gen)
    weight, angles = rand(48, gen=gen), rand(9, 8, gen=gen)
    part = wide[:, 16:64]  # [9, 48], tokens 200 apart
    close(triton_kernels.rms_norm_rope(part, weight, 1e-6, angles.cos(), angles.sin()),
          TWIN.rms_norm_rope(part.contiguous(), weight, 1e-6, angles.cos(), angles.sin()))
    heads = wide[:, 64:160].view(9, 4, 24)  # [9, 4, 24]: heads packed, tokens 200 apart
    close(triton_kernels.rms_norm_rope(heads, None, 1e-6, angles.cos(), angles.sin()),
          TWIN.rms_norm_rope(heads.contiguous(), None, 1e-6, angles.cos(), angles.sin()))
    close(triton_kernels.rms_norm(wide[0, :48], weight, 1e-6), TWIN.rms_norm(wide[0, :48], weight, 1e-6))


# ---- compressor (decode step) ----------------------------------------------------------------------------
@pytest.mark.parametrize(("overlap", "ratio", "dim", "rope_dim"),
                         [(True, 4, 32, 8), (False, 16, 32, 8), (True, 4, 64, 64), (False, 4, 24, 8)])
def test_compress_decodes_equals_its_twin(triton_kernels, overlap: bool, ratio: int, dim: int, rope_dim: int) -> None:
    """Rows that complete an entry and rows that do not; the first entry of a sequence (window −1
    empty, with overlap); an entry below frozen_until (cached: not written); a width that is not a
    power of two; the whole entry rotated. The pending rings must end up identical too."""
    gen = torch.Generator().manual_seed(ratio * dim)
    width, rows = (2 if overlap else 1) * dim, (2 if overlap else 1) * ratio
    positions = torch.tensor([3, 7, 2, 4 * ratio - 1, 4 * ratio - 1, ratio - 1], device=DEVICE)
    frozen = torch.tensor([0, 0, 0, 0, 8 * ratio, 0], device=DEVICE)
    slots = torch.tensor([0, 1, 2, 3, 4, 5], device=DEVICE)
    tables = torch.stack([torch.randperm(20, generator=gen)[:6] for _ in range(6)]).to(DEVICE)
    # kv and score as column slices of one wider projection, as the fused GEMM gives them.
    kv, score = rand(6, 2 * width + 8, gen=gen)[:, 8:].split(width, dim=1)
    rings = [rand(6, rows, width, gen=gen) for _ in range(2)]
    weight, inv_freq = rand(dim, gen=gen), torch.rand(rope_dim // 2, generator=gen).to(DEVICE)
    ape = rand(ratio, width, gen=gen)
    outs = []
    for kernels in (TWIN, triton_kernels):
        ring_kv, ring_score, dest = rings[0].clone(), rings[1].clone(), torch.zeros(20, 4, dim, device=DEVICE)
        kernels.compress_decodes(kv, score, ring_kv, ring_score, slots, positions, frozen, tables, dest, ratio,
                                 overlap, weight, 1e-6, inv_freq, ape)
        outs.append((ring_kv, ring_score, dest))
    (want_kv, want_score, want), (got_kv, got_score, got) = outs
    assert torch.equal(got_kv, want_kv) and torch.equal(got_score, want_score)
    written = int((want != 0).any(-1).sum())
    assert written == int(((positions + 1) % ratio == 0).sum()) - 1  # every completed entry but the frozen one
    close(got, want)


# ---- a decode step's writes in one launch ---------------------------------------------------------------
@pytest.mark.parametrize("compressors", [0, 1, 2], ids=["swa", "hca", "csa"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_write_decode_step_is_the_separate_writes(triton_kernels, compressors: int, fp8: bool) -> None:
    """The fused launch writes bitwise what the separate Triton window and compressor launches write
    (the same bodies), and what the twin writes: rings exactly, entries to fp32 rounding (FP8 records:
    within one e4m3 step). Decodes complete entries, complete a first entry (empty window −1), fall
    between entries and complete one below frozen_until (not rewritten)."""
    from v4serve.cache.layout import KVRecord
    from v4serve.kernels.decode_writes import Compression
    from v4serve.kernels.kv_fp8 import decode

    gen = torch.Generator().manual_seed(11 + compressors)
    d, rope, w = 64, 16, 8
    record = KVRecord(head_dim=d, rope_dim=rope, rope_dtype="float32", rope_itemsize=4) if fp8 else None
    positions = [7, 3, 30, 15, 22]
    batch = RaggedBatch.build([0, 1, 2, 3, 4], positions, [1] * 5, [0] * 5,
                              [torch.randperm(24, generator=gen)[:8].tolist() for _ in range(5)], DEVICE,
                              frozen_until=[0, 0, 0, 16, 0])
    kv = rand(5, d, gen=gen)
    if fp8:
        kv = TWIN.round_keys(kv, record)
    ring0 = (torch.randint(0, 256, (5, w, record.nbytes), generator=gen, dtype=torch.uint8).to(DEVICE) if fp8
             else rand(5, w, d, gen=gen))
    # (ratio, overlap, dim, record): CSA's compressor and its indexer's; HCA's (no overlap) alone.
    shapes = {0: [], 1: [(8, False, d, record)], 2: [(4, True, d, record), (4, True, 32, None)]}[compressors]
    inputs = []
    for ratio, overlap, dim, _ in shapes:
        width = (2 if overlap else 1) * dim
        rows = (2 if overlap else 1) * ratio
        inputs.append((rand(5, width, gen=gen), rand(5, width, gen=gen), rand(5, rows, width, gen=gen),
                       rand(5, rows, width, gen=gen), rand(dim, gen=gen), rand(ratio, width, gen=gen)))
    inv_freq = torch.rand(rope // 2, generator=gen).to(DEVICE)

    def run(kernels, fused: bool):
        ring = ring0.clone()
        parts, dests = [], []
        for (ratio, overlap, dim, rec), (c_kv, c_score, r_kv, r_score, weight, ape) in zip(shapes, inputs,
                                                                                          strict=True):
            dest = torch.zeros(24, 4, *((rec.nbytes,) if rec else (dim,)), device=DEVICE,
                               dtype=torch.uint8 if rec else torch.float32)
            parts.append(Compression(c_kv, c_score, r_kv.clone(), r_score.clone(), dest, ratio, overlap, weight,
                                     1e-6, ape, rec))
            dests.append(dest)
        counter = LaunchCounter()
        with counter:
            if fused:
                kernels.write_decode_step(ring, kv, batch, record, parts, inv_freq)
            else:
                kernels.write_window(ring, kv, batch, record)
                dec = batch.decodes
                for c in parts:
                    kernels.compress_decodes(c.kv, c.score, c.ring_kv, c.ring_score, dec.slots, dec.positions,
                                             dec.frozen_until, dec.tables, c.dest, c.ratio, c.overlap, c.norm_weight,
                                             c.eps, inv_freq, c.ape, c.record)
        return ring, [(c.ring_kv, c.ring_score) for c in parts], dests, counter.ops["triton"]

    ring, pending, dests, launches = run(triton_kernels, fused=True)
    s_ring, s_pending, s_dests, s_launches = run(triton_kernels, fused=False)
    t_ring, t_pending, t_dests, _ = run(TWIN, fused=True)
    assert launches == 1 and s_launches == 1 + compressors
    assert not torch.equal(ring, ring0)
    assert torch.equal(ring, s_ring) and torch.equal(ring, t_ring)
    for (a, b), (c, e), (f, g) in zip(pending, s_pending, t_pending, strict=True):
        assert torch.equal(a, c) and torch.equal(b, e) and torch.equal(a, f) and torch.equal(b, g)
    for (ratio, _, _, rec), dest, s_dest, t_dest in zip(shapes, dests, s_dests, t_dests, strict=True):
        assert torch.equal(dest, s_dest)
        written = dest.reshape(24 * 4, -1).any(-1)
        # Ratio 4: positions 3 (a first entry), 7 and 15 complete entries; ratio 8: 7 and 15. Those
        # below frozen_until (16, on position 15's sequence) are cached already.
        frozen = [0, 0, 0, 16, 0]
        expected = sum((p + 1) % ratio == 0 and (p + 1) // ratio - 1 >= f // ratio
                       for p, f in zip(positions, frozen, strict=True))
        assert expected > 0
        assert int(written.sum()) == expected and torch.equal(t_dest.reshape(24 * 4, -1).any(-1), written)
        if rec is None:
            close(dest, t_dest)
        else:
            got, want = decode(dest, rec), decode(t_dest, rec)
            assert ((got - want).abs() <= want.abs() * 2**-3 + 2**-9).all()


# ---- compressor (prefill chunk) ---------------------------------------------------------------------------
@pytest.mark.parametrize(("overlap", "ratio", "dim", "rope_dim"), [(True, 4, 32, 8), (False, 8, 24, 8)])
@pytest.mark.parametrize(("start", "length", "frozen"), [
    (0, 1, 0), (0, 3, 0), (0, 4, 0), (0, 21, 0),  # from position 0: the first entries' empty windows
    (5, 2, 0), (7, 1, 0), (7, 9, 0), (6, 30, 0),  # after pending rows: windows that start in the ring
    (3, 40, 16),  # entries below frozen_until are cached: not written
])
def test_compress_chunk_equals_its_twin(triton_kernels, overlap: bool, ratio: int, dim: int, rope_dim: int,
                                        start: int, length: int, frozen: int) -> None:
    """Chunks that complete no entry, one, several; windows pooled from the ring, the chunk or both;
    chunks shorter than the ring (its other rows must survive) and longer. The rings afterwards
    must be identical too."""
    gen = torch.Generator().manual_seed(ratio * 100 + start * 10 + length)
    width, rows = (2 if overlap else 1) * dim, (2 if overlap else 1) * ratio
    kv, score = rand(length, 2 * width + 8, gen=gen)[:, 8:].split(width, dim=1)  # column slices, as fused
    ring_kv, ring_score = rand(rows, width, gen=gen), rand(rows, width, gen=gen)
    table = torch.randperm(20, generator=gen)[:8].to(DEVICE)
    weight, inv_freq = rand(dim, gen=gen), torch.rand(rope_dim // 2, generator=gen).to(DEVICE)
    ape = rand(ratio, width, gen=gen)
    outs = []
    for kernels in (TWIN, triton_kernels):
        rings, dest = (ring_kv.clone(), ring_score.clone()), torch.zeros(20, 4, dim, device=DEVICE)
        kernels.compress_chunk(kv, score, *rings, start, frozen, table, dest, ratio, overlap, weight, 1e-6,
                               inv_freq, ape)
        outs.append((*rings, dest))
    (want_kv, want_score, want), (got_kv, got_score, got) = outs
    assert torch.equal(got_kv, want_kv)
    close(got_score, want_score)
    written = int((want != 0).any(-1).sum())
    assert written == max((start + length) // ratio - max(start // ratio, frozen // ratio), 0)
    assert int((got != 0).any(-1).sum()) == written
    close(got, want)


# ---- indexer scores ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("heads", "dim"), [(8, 32), (16, 16), (5, 24)])
def test_index_scores_equal_their_twin(triton_kernels, heads: int, dim: int) -> None:
    """Head counts below tl.dot's tile (padded), widths that are not a power of two, sequences with
    no, few and many visible entries across block edges."""
    gen = torch.Generator().manual_seed(heads * dim)
    counts = torch.tensor([0, 3, 17, 40, 9], device=DEVICE)
    q, w = rand(5, heads, dim, gen=gen), rand(5, heads, gen=gen)
    keys = rand(BLOCKS, PER_BLOCK, dim, gen=gen)
    tables = torch.stack([torch.randperm(BLOCKS, generator=gen)[:12] for _ in range(5)]).to(DEVICE)
    want = TWIN.index_scores(q, w, keys, tables, counts, 40)
    got = triton_kernels.index_scores(q, w, keys, tables, counts, 40)
    hidden = torch.arange(40, device=DEVICE)[None, :] >= counts[:, None]
    assert torch.equal(torch.isinf(got), hidden) and torch.equal(torch.isinf(want), hidden)
    close(got.masked_fill(hidden, 0.0), want.masked_fill(hidden, 0.0), tol=1e-5)
    # The head-weight scale applied inside equals scaling the weights first.
    scaled = triton_kernels.index_scores(q, w, keys, tables, counts, 40, 0.125)
    close(scaled.masked_fill(hidden, 0.0), TWIN.index_scores(q, w * 0.125, keys, tables, counts, 40).masked_fill(
        hidden, 0.0), tol=1e-5)
    # A prefill chunk's rows: one block table read by every row (row stride 0, not copied), each
    # row seeing the entries finished before its own position.
    chunk = tables[3][None].expand(5, -1)
    assert chunk.stride(0) == 0
    counts = torch.tensor([36, 37, 37, 38, 40], device=DEVICE)
    got = triton_kernels.index_scores(q, w, keys, chunk, counts, 40)
    hidden = torch.arange(40, device=DEVICE)[None, :] >= counts[:, None]
    want = TWIN.index_scores(q, w, keys, tables[3][None].repeat(5, 1), counts, 40)
    close(got.masked_fill(hidden, 0.0), want.masked_fill(hidden, 0.0), tol=1e-5)


def unblocked_scores_oracle(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor,
                            w_scale: float) -> torch.Tensor:
    """`Indexer.scores` as it was before its blocks (issue #47): the whole tile's logits at once."""
    logits = torch.bmm(q.flatten(0, 1)[None], keys.t()[None])[0].unflatten(0, q.shape[:2]).relu_()
    scores = ((w * w_scale).unsqueeze(-2) @ logits).squeeze(-2)
    return scores.masked_fill(torch.arange(keys.shape[0])[None, :] >= counts[:, None], float("-inf"))


@pytest.mark.parametrize(("block_entries", "block_rows"), [(2048, 64), (16, 3), (7, 1), (40, 5)])
def test_indexer_scores_in_blocks_are_the_whole_tiles(monkeypatch, block_entries: int, block_rows: int) -> None:
    """The torch scoring of a prefill tile goes in blocks of rows by entries (cache-sized): the
    scores of the whole tile at once within fp32 noise (a GEMM's rounding depends on its width,
    as the whole tile's did on the tile's), whatever the blocks (edges inside and past the entries);
    exact zeros (every head's relu 0) stay exact, and entries every query sees need no mask: −inf
    exactly where a query does not see."""
    from v4serve.engine.model.v4 import compressor
    from v4serve.engine.model.v4.tiny import tiny_config

    indexer = compressor.Indexer(tiny_config(), 4)
    heads, dim = indexer.n_heads, indexer.head_dim
    monkeypatch.setattr(compressor, "INDEX_BLOCK_ENTRIES", block_entries)
    monkeypatch.setattr(compressor, "INDEX_BLOCK_LOGITS", block_rows * heads * min(block_entries, 40))
    gen = torch.Generator().manual_seed(block_entries)
    q, w = torch.randn(13, heads, dim, generator=gen), torch.randn(13, heads, generator=gen)
    keys = torch.randn(40, dim, generator=gen)
    q[2] = -q[2].abs()
    keys[5] = keys[5].abs()  # every head's q·k < 0 for query 2: its score is exactly 0
    counts = (torch.arange(148, 161) + 1) // 4  # a chunk's rows at positions 148-160: 37-40 entries each
    want = unblocked_scores_oracle(q, w, keys, counts, indexer.w_scale)
    hidden = torch.isinf(want)
    assert want[2, 5] == 0
    for seen_by_all in (0, int(counts.min())):
        got = indexer.scores(q, w, keys, counts, seen_by_all)
        assert torch.equal(torch.isinf(got), hidden) and torch.equal(got == 0, want == 0)
        close(got.masked_fill(hidden, 0.0), want.masked_fill(hidden, 0.0), tol=1e-6)

@pytest.mark.parametrize(("n", "k"), [(40, 16), (7, 7), (300, 16), (1500, 64), (33, 32)])
def test_index_topk_picks_the_twins_entries(triton_kernels, n: int, k: int) -> None:
    """Rows seeing all, some, fewer than k and no entries; scores of both signs and many orders of
    magnitude (the radix select runs on their bits): the same entries in the same order (entry order,
    then −1)."""
    gen = torch.Generator().manual_seed(n + k)
    counts = torch.tensor([n, n // 2, min(k - 1, n), 0, max(n - 1, 0)])
    scores = torch.randn(5, n, generator=gen) * torch.exp2(torch.randint(-20, 20, (5, n), generator=gen).float())
    scores[torch.arange(n)[None, :] >= counts[:, None]] = float("-inf")
    scores, counts = scores.to(DEVICE), counts.to(DEVICE)
    want = TWIN.index_topk(scores, counts, k)
    got = triton_kernels.index_topk(scores, counts, k)
    assert got.shape == (5, k) and got.dtype == torch.long
    assert torch.equal(got, want)


def test_index_topk_walks_only_to_the_widest_rows_count(triton_kernels) -> None:
    """A captured decode step scores at a fixed table width (sized for --max-model-len); the top-k
    stops at the widest row's count instead of walking every column. Columns past it are never
    read: filled with huge finite values here, they change nothing (a walk over them would pick them)."""
    gen = torch.Generator().manual_seed(9)
    counts = torch.tensor([10, 6, 0])
    scores = torch.randn(3, 2048, generator=gen)
    masked = scores.masked_fill(torch.arange(2048)[None, :] >= counts[:, None], float("-inf"))
    scores = masked.clone()
    scores[:, 10:] = 1e30  # past every row's count: not scores at all
    want = TWIN.index_topk(masked.to(DEVICE), counts.to(DEVICE), 8)
    assert torch.equal(triton_kernels.index_topk(scores.to(DEVICE), counts.to(DEVICE), 8), want)
    assert want[2].tolist() == [-1] * 8 and want[1, 6:].tolist() == [-1, -1]


def test_index_topk_full_rows_need_no_mask() -> None:
    """`full` (every row sees at least k, known on the host) lets the twin skip its masking ops;
    the picks stay those of the masked form. (The Triton kernel masks as it writes either way.)"""
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([9, 16, 12])
    scores = torch.randn(3, 16, generator=gen)
    scores[torch.arange(16)[None, :] >= counts[:, None]] = float("-inf")
    scores, counts = scores.to(DEVICE), counts.to(DEVICE)
    ops = []
    for full in (False, True):
        with LaunchCounter() as counter:
            got = TWIN.index_topk(scores, counts, 8, full)
        ops.append(counter.total())
        assert torch.equal(got.sort(-1).values, scores.topk(8, dim=-1).indices.sort(-1).values)
    assert ops[1] < ops[0]


def test_index_topk_breaks_ties_to_exactly_k(triton_kernels) -> None:
    """Equal scores at the k-th place: as many of them as k needs, the lowest entries first, on both
    backends; so the picks do not depend on how many hidden entries follow the row's own (a decode
    sees exactly its entries, the same position inside a prefill chunk the chunk's last row's)."""
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.5, 2.0, -1.0]] * 2, device=DEVICE)
    counts = torch.tensor([8, 8], device=DEVICE)
    for kernels in (triton_kernels, TWIN):
        assert kernels.index_topk(scores, counts, 4).tolist() == [[0, 2, 3, 4]] * 2
        for hidden in (0, 3):  # entries after the row's own
            zeros = torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0] + [float("-inf")] * hidden], device=DEVICE)
            five = torch.tensor([5], device=DEVICE)
            assert kernels.index_topk(zeros, five, 3).tolist() == [[2, 0, 1]]
            # More picks than entries (scores 5 wide without hidden ones): k wide all the same.
            assert kernels.index_topk(zeros, five, 7).tolist() == [[2, 0, 1, 3, 4, -1, -1]]
    # Nothing is written past a row's k picks (the ties beyond them included): a sentinel stays.
    from v4serve.kernels.indexer_triton import _index_topk_kernel

    out = torch.full((8,), 99, dtype=torch.long, device=DEVICE)
    _index_topk_kernel[(1,)](scores, torch.tensor([8], device=DEVICE), out, 1, 8, 4, BLOCK_R=1, BLOCK_N=8, BLOCK_K=4)
    assert out[4:].tolist() == [99] * 4


def ranked_topk_oracle(scores: torch.Tensor, counts: torch.Tensor, k: int, full: bool = False) -> torch.Tensor:
    """The torch `index_topk` as it was before its one-top-k form (issue #47), kept as the oracle:
    every entry of every row ranked (above t, then the ties t needs, each in entry order)."""
    if scores.shape[-1] < k:
        scores = torch.nn.functional.pad(scores, (0, k - scores.shape[-1]), value=float("-inf"))
    n = scores.shape[-1]
    best = scores.topk(k, dim=-1).values
    if full:
        picks, threshold = k, best[:, -1:]
    else:
        picks = counts.clamp(max=k)[:, None]
        threshold = best.gather(1, (picks - 1).clamp(min=0))
    above, ties = scores > threshold, scores == threshold
    tied = ties & (ties.cumsum(-1) <= picks - above.sum(-1, keepdim=True))
    lower_first = torch.arange(n, 0, -1, device=scores.device)
    rank = above * (n + lower_first) + tied * lower_first
    top = rank.topk(k, dim=-1).indices
    return top if full else top.masked_fill(torch.arange(k, device=top.device)[None, :] >= picks, -1)


def tie_heavy_scores(kind: str, rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Scores whose k-th best is tied with many others: mostly exact zeros (every head's relu 0),
    a handful of values, one value on a third of the entries, all equal, and −0.0 beside 0.0."""
    s = torch.randn(rows, n, generator=gen)
    if kind == "zeros":
        return s.relu() * (torch.rand(rows, n, generator=gen) < 0.02)
    if kind == "few values":
        return torch.randint(-2, 3, (rows, n), generator=gen).float()
    if kind == "straddling":
        return torch.where(torch.rand(rows, n, generator=gen) < 0.3, torch.full_like(s, 0.5), s)
    if kind == "all equal":
        return torch.zeros(rows, n)
    if kind == "signed zeros":
        s = torch.where(torch.rand(rows, n, generator=gen) < 0.5, torch.full_like(s, -0.0), torch.zeros_like(s))
        s[:, ::7] = 1.0
        return s
    return s


@pytest.mark.parametrize("kind", ["random", "zeros", "few values", "straddling", "all equal", "signed zeros"])
@pytest.mark.parametrize(("n", "k"), [(40, 16), (7, 7), (5, 7), (16, 16), (17, 16), (1, 1), (300, 16), (2100, 64)])
def test_index_topk_picks_what_ranking_every_entry_picked(kind: str, n: int, k: int) -> None:
    """The torch twin takes one top-k and ranks only the rows whose ties at the k-th pick run past
    it: bitwise the picks (and their order) of ranking every entry, with and without `full`, for
    rows seeing all, some, fewer than k and no entries, n below k, ties at and across the k-th."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    rows = 41
    counts = torch.randint(0, n + 1, (rows,), generator=gen)
    counts[:4] = torch.tensor([n, 0, min(k, n), max(min(k, n) - 1, 0)])
    scores = tie_heavy_scores(kind, rows, n, gen)
    scores = scores.masked_fill(torch.arange(n)[None, :] >= counts[:, None], float("-inf"))
    want = ranked_topk_oracle(scores, counts, k)
    got = TWIN.index_topk(scores, counts, k)
    assert got.dtype == torch.long and torch.equal(got, want)
    seeing_k = counts >= k
    if seeing_k.any():
        assert torch.equal(TWIN.index_topk(scores[seeing_k], counts[seeing_k], k, True),
                           ranked_topk_oracle(scores[seeing_k], counts[seeing_k], k, True))
    # A row's picks do not depend on the rows beside it (a decode step's row alone, the same
    # position inside a prefill chunk's tile).
    for r in (0, 2, 3, rows - 1):
        assert torch.equal(TWIN.index_topk(scores[r:r + 1], counts[r:r + 1], k), want[r:r + 1])


def test_index_topk_rows_whose_ties_cross_the_picks_are_ranked() -> None:
    """Both paths in one call: rows decided by the top-k alone and rows whose k-th score ties past
    the picks (which a plain top-k may break either way), beside each other."""
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.5, 2.0, -1.0],  # 2.0 four times, two needed
                           [3.0, 1.0, 2.0, 2.5, 2.0, 0.5, 0.0, -1.0],  # 2.0 twice, both needed
                           [0.0] * 8])
    counts = torch.tensor([8, 8, 8])
    assert TWIN.index_topk(scores, counts, 4).tolist() == [[0, 2, 3, 4], [0, 3, 2, 4], [0, 1, 2, 3]]
    assert torch.equal(TWIN.index_topk(scores, counts, 4), ranked_topk_oracle(scores, counts, 4))


# ---- sparse attention ------------------------------------------------------------------------------------
H, D, W, SLOTS, BLOCKS, PER_BLOCK, RATIO = 4, 32, 16, 5, 48, 4, 4
# (slot, start, new tokens, window_from): decodes, chunks crossing the window and block edges, a
# first chunk, a chunk after a hit whose window starts at its own start (empty ring part), a decode
# with a full window, a decode at position 0.
SEQS = [(0, 37, 1, 0), (1, 0, 23, 0), (2, 50, 20, 50), (3, 15, 1, 0), (4, 0, 1, 0), (0, 64, 17, 60)]


def ragged(seqs: list[tuple[int, int, int, int]], gen: torch.Generator) -> RaggedBatch:
    tables = [torch.randperm(BLOCKS, generator=gen)[:12].tolist() for _ in seqs]
    return RaggedBatch.build([s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs],
                             [s[3] for s in seqs], tables, DEVICE)


def random_topk(batch: RaggedBatch, k: int, gen: torch.Generator) -> torch.Tensor:
    """k picks per query among its visible entries (−1 where fewer are visible: top-k larger than
    the entries), in random order."""
    rows = []
    for pos in batch.row_pos.tolist():
        visible = (pos + 1) // RATIO
        picks = torch.randperm(visible, generator=gen)[:k].tolist() if visible else []
        rows.append(picks + [-1] * (k - len(picks)))
    return torch.tensor(rows, dtype=torch.long, device=DEVICE)


@pytest.mark.parametrize("kind", ["swa", "hca", "csa", "csa_wide"])
def test_sparse_attention_equals_its_twin_on_a_ragged_batch(triton_kernels, kind: str) -> None:
    gen = torch.Generator().manual_seed(len(kind))
    batch = ragged(SEQS if kind != "csa_wide" else SEQS[:3], gen)
    t = batch.num_rows
    q, kv = rand(t, H, D, gen=gen), rand(t, D, gen=gen)
    ring, entries = rand(SLOTS, W, D, gen=gen), rand(BLOCKS, PER_BLOCK, D, gen=gen)
    sink = rand(H, gen=gen)
    args = {"swa": (None, None, 0), "hca": (entries, None, RATIO),
            "csa": (entries, random_topk(batch, 6, gen), RATIO),
            "csa_wide": (entries, random_topk(batch, 40, gen), RATIO)}[kind]
    ent, topk, ratio = args
    want = TWIN.sparse_attention(q, kv, ring, ent, topk, batch, ratio, sink, D**-0.5)
    got = triton_kernels.sparse_attention(q, kv, ring, ent, topk, batch, ratio, sink, D**-0.5)
    close(got, want)


def test_sparse_attention_reads_the_ring_only_below_the_start(triton_kernels) -> None:
    """Ring rows that the window does not cover (poisoned with NaN) are never read: a chunk's own keys
    come from `kv`, and positions below window_from are skipped."""
    gen = torch.Generator().manual_seed(5)
    batch = ragged([(0, 40, 6, 38), (1, 3, 1, 0)], gen)
    ring = rand(SLOTS, W, D, gen=gen)
    q, kv, sink = rand(batch.num_rows, H, D, gen=gen), rand(batch.num_rows, D, gen=gen), rand(H, gen=gen)
    want = TWIN.sparse_attention(q, kv, ring, None, None, batch, 0, sink, D**-0.5)
    ring[0, [p % W for p in range(40 - W, 38)]] = float("nan")  # outside slot 0's window
    ring[1, [p % W for p in range(3, W)]] = float("nan")  # never written for slot 1
    got = triton_kernels.sparse_attention(q, kv, ring, None, None, batch, 0, sink, D**-0.5)
    assert torch.isfinite(got).all()
    close(got, want)


def test_sparse_attention_of_a_row_is_independent_of_the_batch(triton_kernels) -> None:
    """Bitwise: a decode alone, beside other decodes, and beside prefill chunks."""
    gen = torch.Generator().manual_seed(9)
    ring, entries, sink = rand(SLOTS, W, D, gen=gen), rand(BLOCKS, PER_BLOCK, D, gen=gen), rand(H, gen=gen)
    q, kv = rand(1, H, D, gen=gen), rand(1, D, gen=gen)
    table = torch.randperm(BLOCKS, generator=gen)[:12].tolist()
    alone = RaggedBatch.build([3], [37], [1], [0], [table], DEVICE)
    out = triton_kernels.sparse_attention(q, kv, ring, entries, None, alone, RATIO, sink, D**-0.5)
    others = ragged([(1, 0, 23, 0), (2, 50, 20, 50)], gen)
    mixed = RaggedBatch.build([1, 2, 3], [0, 50, 37], [23, 20, 1], [0, 50, 0],
                              others.tables.tolist()[:2] + [table], DEVICE)
    q_mixed = torch.cat([rand(43, H, D, gen=gen), q])
    kv_mixed = torch.cat([rand(43, D, gen=gen), kv])
    in_batch = triton_kernels.sparse_attention(q_mixed, kv_mixed, ring, entries, None, mixed, RATIO, sink, D**-0.5)
    assert torch.equal(in_batch[-1], out[0])


# ---- selection and counting ---------------------------------------------------------------------------------
def test_backend_resolution() -> None:
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("triton", "cpu") == "triton"
    assert resolve_backend("auto", "cuda") == "triton"
    with pytest.raises(ValueError, match="attention-backend"):
        resolve_backend("flash", "cpu")


def test_triton_launches_are_counted_and_torch_ops_seen(triton_kernels) -> None:
    gen = torch.Generator().manual_seed(1)
    h = rand(3, 4, 16, gen=gen)
    fn, base, scale = rand(24, 64, gen=gen), rand(24, gen=gen), torch.ones(3, device=DEVICE)
    with LaunchCounter() as c:
        triton_kernels.mhc_pre(h, fn, base, scale, 1e-6, 1e-6, 20)
    assert c.ops["triton"] == 2  # the split mixing sums, then the gates and the collapse
    with LaunchCounter() as c:
        TWIN.mhc_pre(h, fn, base, scale, 1e-6, 1e-6, 20)
    assert c.ops["triton"] == 0 and c.ops["aten._log_softmax"] >= 2 * 19  # the Sinkhorn iterations


# ---- the tile sizes a GPU uses -----------------------------------------------------------------------------
# Interpreted, the kernels pick fewer, larger tiles (the interpreter pays per op); on a GPU the same
# code walks more tiles of rows, keys and pooling windows. These run the twin comparisons above with
# the GPU's tile choices, so the loops over several tiles and their edges are tested on a CPU too.
GPU_TILED = ("attention_triton", "compressor_triton", "indexer_triton", "mhc_triton", "moe_triton",
             "norm_rope_triton")
GPU_TILE_CASES = {
    "mhc (2-token tiles, K split in 64: most slices empty)": lambda k: test_mhc_pre_and_post_equal_their_twins(
        k, 17, 200),
    "mhc at V4's width (K = 16K: 64 full slices of two column tiles)": lambda k: (
        test_mhc_pre_and_post_equal_their_twins(k, 3, 4096)),
    "norm and rope": lambda k: test_norm_and_rope_equal_their_twins(k, (70, 72), 8, True),
    "compress_decodes (two 16-row pooling tiles)": lambda k: test_compress_decodes_equals_its_twin(
        k, True, 16, 32, 8),
    "compress_chunk (two 16-row pooling tiles)": lambda k: test_compress_chunk_equals_its_twin(
        k, True, 16, 32, 8, 7, 40, 0),
    "write_decode_step": lambda k: test_write_decode_step_is_the_separate_writes(k, 2, True),
    "index_scores (32-entry tiles)": lambda k: test_index_scores_equal_their_twin(k, 8, 32),
    "index_topk (a row a program)": lambda k: test_index_topk_picks_the_twins_entries(k, 1500, 64),
    "sparse_attention (32-key tiles)": lambda k: test_sparse_attention_equals_its_twin_on_a_ragged_batch(
        k, "csa_wide"),
    "moe route (a token a program)": lambda k: moe_tests.test_route_kernel_equals_its_twin("sqrtsoftplus", 33, 16,
                                                                                         6, 2),
    "moe experts (GPU tiles)": lambda k: moe_tests.test_experts_kernel_equals_its_twin(0.8, 40, 72, 40, 5, 2, 1),
}


@pytest.mark.parametrize("case", GPU_TILE_CASES)
def test_kernels_at_gpu_tile_sizes_equal_their_twins(triton_kernels, monkeypatch, case: str) -> None:
    import importlib

    for name in GPU_TILED:
        monkeypatch.setattr(importlib.import_module(f"v4serve.kernels.{name}"), "interpreting", lambda: False)
    GPU_TILE_CASES[case](triton_kernels)
