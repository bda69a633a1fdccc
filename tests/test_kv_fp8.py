"""FP8 keys (`--kv-cache-dtype fp8`): the record format against independent arithmetic, the Triton
attention reading records against its torch twin, and through the engine: FP8 prefix hits (device
and disk, every SWA mode) give the FP8 cold run's tokens, a store of one key dtype is never read as
the other, and the daemon reports and refuses the setting as it should."""

from __future__ import annotations

import math
import subprocess
import sys

import httpx
import pytest
import torch

from tests.daemon import PATIENCE, daemon
from tests.helpers import (
    SMALL_ONE_OF_EACH,
    engine_for,
    greedy,
    rel_err,
    requires_triton,
    small_model,
    tiny_model,
    tokens,
)
from v4serve.cache.layout import KVLayout, KVRecord, cache_table, key_record
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.kernels.attention import RaggedBatch
from v4serve.kernels.kv_fp8 import decode, encode
from v4serve.kernels.kv_fp8 import ue8m0_exponent as twin_exponent
from v4serve.kernels.registry import load_kernels

try:  # only Triton itself may be missing: a moved or renamed decoder must fail loudly
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheel for this platform: requires_triton skips its tests
    triton = None

_decode_codes = _encode_values = None
if triton is not None:  # kernels around the shared e4m3 decoder and encoders (jit resolves module globals)
    from v4serve.kernels.codes_triton import e4m3, e4m3_code, ue8m0_exponent

    @triton.jit
    def _decode_codes(codes_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, e4m3(tl.load(codes_ptr + i).to(tl.int32)))

    @triton.jit
    def _encode_values(x_ptr, codes_ptr, exps_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=1.0)
        tl.store(codes_ptr + i, e4m3_code(x), mask=i < n)
        tl.store(exps_ptr + i, ue8m0_exponent(tl.maximum(tl.abs(x), 1e-4)), mask=i < n)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton writer tests also run in gpu_check.sh
REAL = KVRecord(head_dim=512, rope_dim=64, rope_dtype="bfloat16", rope_itemsize=2)
TINY = KVRecord(head_dim=64, rope_dim=16, rope_dtype="float32", rope_itemsize=4)


def wide_range_rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Rows whose channels span eight orders of magnitude, so groups use many scales."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen) * torch.exp2(torch.randint(-14, 14, (n, d), generator=gen).float())


# ---- the record format ----------------------------------------------------------------------------------
def test_record_sizes_match_deepseek_v4s_fp8_kv() -> None:
    # 448 e4m3 codes + 7 scale bytes + 1 pad + 64 bf16 rope values = 584 bytes, vs 1024 in bf16.
    assert (REAL.nope, REAL.groups, REAL.rope_offset, REAL.nbytes) == (448, 7, 456, 584)
    assert (TINY.nope, TINY.groups, TINY.rope_offset, TINY.nbytes) == (48, 1, 52, 116)


@pytest.mark.parametrize("record", [REAL, TINY], ids=["real", "tiny"])
def test_round_trip_error_is_within_e4m3_precision(record: KVRecord) -> None:
    rows = wide_range_rows(64, record.head_dim, 0)
    rope_dtype = getattr(torch, record.rope_dtype)
    back = decode(encode(rows, record), record)
    nope, got = rows[:, :record.nope], back[:, :record.nope]
    for g in range(record.groups):
        cols = slice(64 * g, min(64 * g + 64, record.nope))
        amax = nope[:, cols].abs().amax(-1, keepdim=True)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        # e4m3: 3 mantissa bits → relative error ≤ 2⁻⁴ on normals; subnormal spacing 2⁻⁹ · scale.
        bound = torch.maximum(nope[:, cols].abs() * 2**-4, scale * 2**-10)
        assert ((got[:, cols] - nope[:, cols]).abs() <= bound).all()
    assert torch.equal(back[:, record.nope:], rows[:, record.nope:].to(rope_dtype).float())


def test_scale_bytes_are_the_power_of_two_exponents() -> None:
    rows = torch.zeros(4, TINY.head_dim)
    for i, amax in enumerate([448.0, 449.0, 1.0, 0.0]):
        rows[i, 5] = -amax
    exponents = encode(rows, TINY)[:, TINY.nope].tolist()
    want = [127 + math.ceil(math.log2(max(a, 1e-4) / 448)) for a in (448.0, 449.0, 1.0, 0.0)]
    assert exponents == want
    # 449 / 2 = 224.5 lies between the e4m3 values 224 and 240: it rounds to 224, i.e. 448.
    assert decode(encode(rows, TINY), TINY)[:, 5].tolist() == [-448.0, -448.0, -1.0, 0.0]


def test_rounding_twice_changes_nothing() -> None:
    """A key rounded once (what attention uses) is stored and read back unchanged, so a cache read
    gives exactly the key the cold run used."""
    rows = wide_range_rows(256, REAL.head_dim, 1).to(torch.bfloat16)
    once = decode(encode(rows, REAL), REAL, torch.bfloat16)
    assert torch.equal(decode(encode(once, REAL), REAL, torch.bfloat16), once)


def test_layout_bytes_match_the_records() -> None:
    cfg = tiny_model().cfg
    record = key_record(cfg.head_dim, cfg.rope_dim, "float32", "fp8")
    full, fp8 = KVLayout.from_config(cfg), KVLayout.from_config(cfg, record)
    for plain, packed in zip(full.layers, fp8.layers, strict=True):
        window_delta = plain.window * (plain.head_dim * 4 - TINY.nbytes)
        entry_delta = plain.entries_per_block * (plain.head_dim * 4 - TINY.nbytes)
        assert plain.state_bytes(4) - packed.state_bytes(4) == window_delta
        assert plain.block_bytes(4) - packed.block_bytes(4) == entry_delta
    table = cache_table(fp8, 4, 2, 8, key_record(cfg.head_dim, cfg.rope_dim, "float32", "fp8"))
    assert "FP8 keys (116-byte records)" in table
    assert f"FP8 (--kv-cache-dtype fp8) {fp8.block_bytes(4) / 128:.1f} B/token" in table
    assert f"4-byte (auto) {full.block_bytes(4) / 128:.1f} B/token" in table


# ---- the Triton attention reads records ------------------------------------------------------------------
@requires_triton
def test_the_kernels_e4m3_decoding_is_exact_for_every_code() -> None:
    codes = torch.tensor([c for c in range(256) if c not in (127, 255)], dtype=torch.uint8)  # not the NaNs
    padded = torch.cat([codes, torch.zeros(2, dtype=torch.uint8)])
    out = torch.empty(256)
    _decode_codes[(1,)](padded, out, N=256)
    assert torch.equal(out[:254], codes.view(torch.float8_e4m3fn).float())


@requires_triton
def test_the_writers_e4m3_encoding_rounds_as_torch_for_every_case() -> None:
    """Every representable value, every midpoint between neighbours (ties go to the even code), one
    fp32 step either side of each, zeros of both signs, values below half the least subnormal, and
    random magnitudes over e4m3's whole range: the same code as torch's float8_e4m3fn cast."""
    codes = torch.tensor([c for c in range(127)], dtype=torch.uint8)  # non-negative, not NaN
    exact = codes.view(torch.float8_e4m3fn).float()
    mids = (exact[:-1] + exact[1:]) / 2
    edges = torch.cat([exact, mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids * 2),
                       torch.tensor([0.0, 2.0**-10, 2.0**-11, 1e-30, 447.9, 448.0])])
    gen = torch.Generator().manual_seed(0)
    spread = torch.rand(20000, generator=gen) * torch.exp2(torch.randint(-12, 9, (20000,), generator=gen).float())
    x = torch.cat([edges, -edges, spread.clamp(max=448.0), -spread.clamp(max=448.0), torch.tensor([-0.0])])
    got_codes, got_exps = (torch.empty(len(x), dtype=torch.int32, device=DEVICE) for _ in range(2))
    _encode_values[(triton.cdiv(len(x), 1024),)](x.to(DEVICE), got_codes, got_exps, len(x), BLOCK=1024)
    got_codes = got_codes.cpu()
    want = x.to(torch.float8_e4m3fn).view(torch.uint8).int()
    wrong = (got_codes != want).nonzero().flatten()
    assert len(wrong) == 0, f"{len(wrong)} codes differ, e.g. {x[wrong[:3]].tolist()}"
    # The scale exponent from the same bits as the twin's, also where amax/448 is a power of two.
    amax = torch.cat([x.abs().clamp(min=1e-4), 448.0 * torch.exp2(torch.arange(-20.0, 20.0))])
    amax = torch.cat([amax, torch.nextafter(amax, amax * 2), torch.nextafter(amax, torch.zeros_like(amax))])
    exps = torch.empty(len(amax), dtype=torch.int32, device=DEVICE)
    _encode_values[(triton.cdiv(len(amax), 1024),)](amax.to(DEVICE), torch.empty_like(exps), exps, len(amax),
                                                     BLOCK=1024)
    exps = exps.cpu()
    assert torch.equal(exps, twin_exponent(amax))
    # And that exponent is the smallest that maps amax into e4m3's range (up to amax · (1/448)'s rounding).
    assert (amax * 2.0 ** -exps.float() <= 448.0 * (1 + 2**-22)).all()
    assert (amax * 2.0 ** -(exps.float() - 1) > 448.0 * (1 - 2**-22)).all()


@requires_triton
def test_triton_window_writes_store_the_twins_records_byte_for_byte() -> None:
    w, d = 8, TINY.head_dim
    batch = RaggedBatch.build([0, 1, 2], [0, 5, 30], [11, 1, 1], [0, 0, 0], [[0], [1], [2]], DEVICE)
    kv = wide_range_rows(batch.num_rows, d, 6)
    kv[3, :TINY.nope] = 0.0  # an all-zero group: the least scale
    rings = []
    for kernels in (load_kernels("torch"), load_kernels("triton", DEVICE)):
        ring = torch.full((3, w, TINY.nbytes), 0xAB, dtype=torch.uint8, device=DEVICE)  # padding is written too
        kernels.write_window(ring, kv.to(DEVICE), batch, TINY)
        rings.append(ring)
    assert torch.equal(rings[1], rings[0])


@requires_triton
def test_triton_round_keys_equal_the_twin_bitwise() -> None:
    """A step's own keys, rounded as their records will hold them, in one launch."""
    rows = wide_range_rows(40, TINY.head_dim, 8)
    rows[5, :TINY.nope] = 0.0
    rows = rows.to(DEVICE)
    assert torch.equal(load_kernels("triton", DEVICE).round_keys(rows, TINY), decode(encode(rows, TINY), TINY))


@requires_triton
@pytest.mark.parametrize("chunk", [False, True], ids=["decodes", "chunk"])
def test_triton_compressors_write_fp8_entries_as_the_twin(chunk: bool) -> None:
    """The pooled entries agree to fp32 rounding, so their records decode to within one e4m3 step."""
    gen = torch.Generator().manual_seed(7)
    ratio, d = 4, TINY.head_dim
    width = 2 * d
    ring_kv, ring_score = (torch.randn(3, 2 * ratio, width, generator=gen) for _ in range(2))
    ape, weight = torch.randn(ratio, width, generator=gen), torch.rand(d, generator=gen) + 0.5
    inv_freq = torch.rand(TINY.rope_dim // 2, generator=gen)
    tables = torch.stack([torch.randperm(12, generator=gen)[:4] for _ in range(3)])
    n = 13 if chunk else 3  # the chunk (positions 6..18) completes entries 1, 2 and 3; the decodes 0 and 1
    kv, score = torch.randn(n, width, generator=gen) * 10, torch.randn(n, width, generator=gen)
    ring_kv, ring_score, ape, weight, inv_freq, tables, kv, score = (
        t.to(DEVICE) for t in (ring_kv, ring_score, ape, weight, inv_freq, tables, kv, score))
    outs = []
    for kernels in (load_kernels("torch"), load_kernels("triton", DEVICE)):
        rk, rs = ring_kv.clone(), ring_score.clone()
        dest = torch.zeros(12, 4, TINY.nbytes, dtype=torch.uint8, device=DEVICE)
        if chunk:
            kernels.compress_chunk(kv, score, rk[1], rs[1], 6, 0, tables[1], dest, ratio, True, weight, 1e-6,
                                   inv_freq, ape, TINY)
        else:
            positions, slots = torch.tensor([3, 7, 6], device=DEVICE), torch.arange(3, device=DEVICE)
            kernels.compress_decodes(kv, score, rk, rs, slots, positions, torch.zeros_like(slots), tables, dest, ratio,
                                     True, weight, 1e-6, inv_freq, ape, TINY)
        outs.append(dest)
    want, got = (decode(o, TINY) for o in outs)
    written = outs[0].any(-1)
    assert int(written.sum()) == (3 if chunk else 2) and torch.equal(outs[1].any(-1), written)
    assert ((got - want).abs() <= want.abs() * 2**-3 + 2**-9).all()
    assert (outs[1] == outs[0]).float().mean() > 0.99  # nearly every byte the same


@requires_triton
@pytest.mark.parametrize("topk", [False, True], ids=["hca", "csa"])
def test_triton_attention_on_fp8_records_equals_its_twin(topk: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    h, d, w, ratio, per_block = 4, TINY.head_dim, 16, 4, 8
    # A long prefill chunk, one starting mid-window, and two decodes.
    batch = RaggedBatch.build([0, 1, 2, 3], [0, 20, 37, 9], [40, 6, 1, 1], [0, 0, 30, 0],
                              [[0, 1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13]], "cpu")
    t = batch.num_rows
    q, kv = torch.randn(t, h, d, generator=gen), torch.randn(t, d, generator=gen)
    ring = encode(torch.randn(4, w, d, generator=gen), TINY)
    entries = encode(torch.randn(14, per_block, d, generator=gen), TINY)
    picks = None
    if topk:
        visible = ((batch.row_pos + 1) // ratio).clamp(min=1)
        picks = (torch.rand(t, 5, generator=gen) * visible[:, None]).long()
        picks[(batch.row_pos + 1) // ratio == 0] = -1
    sink = torch.randn(h, generator=gen)
    kv = decode(encode(kv, TINY), TINY)
    want = load_kernels("torch").sparse_attention(q, kv, ring, entries, picks, batch, ratio, sink, d**-0.5, TINY)
    got = load_kernels("triton").sparse_attention(q, kv, ring, entries, picks, batch, ratio, sink, d**-0.5, TINY)
    assert rel_err(got, want) <= 1e-5


@requires_triton
def test_small_model_on_triton_with_fp8_keys_gives_the_torch_tokens() -> None:
    """Two requests sharing steps (16-token budget): chunks and decodes read records in one batch.
    The two backends compute a key with different fp32 arithmetic, so a key within an ulp of an e4m3
    rounding edge gets the neighbouring code on one of them (a step of 1/8 on that channel), and the
    difference carries through later layers: the logits agree to the FP8 step (as a zero-mode
    recompute's do, below), not to fp32 noise."""
    torch_model = build_tiny(tiny_config(**SMALL_ONE_OF_EACH), seed=11)
    triton_model = build_tiny(tiny_config(**SMALL_ONE_OF_EACH), seed=11)
    triton_model.use_kernels(load_kernels("triton"))
    prompts = {"a": tokens(37, 8), "b": tokens(21, 9)}
    runs = []
    for model in (torch_model, triton_model):
        engine = engine_for(model, kv_cache_dtype="fp8", max_num_batched_tokens=16)
        runs.append((engine.generate([greedy(rid, p, n=4) for rid, p in prompts.items()]), engine.logits))
    (want, want_logits), (got, got_logits) = runs
    assert got == want
    for rid in prompts:
        assert rel_err(torch.stack(got_logits[rid]), torch.stack(want_logits[rid])) <= 1e-2


# ---- through the engine -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "periodic", "zero"])
@pytest.mark.parametrize("shared", [15, 16, 17, 33])
def test_fp8_prefix_hits_give_the_fp8_cold_run(mode: str, shared: int) -> None:
    """Small model (window 8, blocks of 16): hits at and off by one around block edges."""
    model = small_model()
    base = tokens(shared, 4)
    first, second = base + tokens(9, 5), base + tokens(9, 6)
    engine = engine_for(model, swa_cache_mode=mode, kv_cache_dtype="fp8")
    engine.generate([greedy("first", first)])
    hit = greedy("second", second)
    out = engine.generate([hit])["second"]
    engine.check()
    cold = engine_for(model, enable_prefix_caching=False, kv_cache_dtype="fp8")
    assert out == cold.generate([greedy("cold", second)])["cold"]
    assert hit.num_hit_tokens == min(shared, len(second) - 1) // 16 * 16
    # Snapshots restore the stored key bytes: fp32 noise only. Zero mode recomputes the window, and
    # a recomputed key's fp32 noise can move one e4m3 code by a step (with --batch-invariant the
    # recomputed key is bitwise the cold one: tests/test_batch_invariance.py).
    tolerance = 1e-4 if mode != "zero" else 1e-2
    assert rel_err(torch.stack(engine.logits["second"]), torch.stack(cold.logits["cold"])) <= tolerance


def test_fp8_keys_stay_close_to_full_precision_keys() -> None:
    """Not equality (rounding keys to 3 mantissa bits moves logits); a broken encoding would move
    them by far more than the few percent measured in bench/bench_kv_fp8.py."""
    model, prompt = tiny_model(), tokens(300, 1)
    full = engine_for(model, enable_prefix_caching=False)
    fp8 = engine_for(model, enable_prefix_caching=False, kv_cache_dtype="fp8")
    full.generate([greedy("x", prompt, n=1)])
    fp8.generate([greedy("x", prompt, n=1)])
    assert 0 < rel_err(fp8.logits["x"][0], full.logits["x"][0]) <= 0.1


def test_disk_store_is_keyed_by_the_key_dtype(tmp_path) -> None:
    model, prompt = tiny_model(), tokens(300, 2)
    store = dict(swa_cache_mode="full", kv_store_dir=str(tmp_path))
    first = engine_for(model, **store)
    first.generate([greedy("a", prompt)])
    first.close()
    fp8 = engine_for(model, kv_cache_dtype="fp8", **store)
    miss = greedy("b", prompt)
    fp8.generate([miss])
    fp8.close()
    assert miss.num_hit_tokens == 0  # full-precision blocks on disk are not FP8 records
    again = engine_for(model, kv_cache_dtype="fp8", **store)
    hit = greedy("c", prompt)
    out = again.generate([hit])["c"]
    again.close()
    cold = engine_for(model, enable_prefix_caching=False, kv_cache_dtype="fp8")
    assert hit.num_hit_tokens == 256
    assert out == cold.generate([greedy("cold", prompt)])["cold"]
    assert rel_err(torch.stack(again.logits["c"]), torch.stack(cold.logits["cold"])) <= 1e-4


def test_daemon_reports_fp8_keys_and_refuses_unknown_dtypes() -> None:
    with daemon("--kv-cache-dtype", "fp8") as url:
        assert httpx.get(url + "/version", timeout=PATIENCE).json()["kv_cache_dtype"] == "fp8_e4m3"
        body = {"model": "v4serve-tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=PATIENCE).json()
        assert reply["usage"]["completion_tokens"] == 3
    done = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "serve", "--kv-cache-dtype", "int4",
                           "--port", "0"], capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 2
    assert "--kv-cache-dtype must be one of auto, fp8, got 'int4'" in done.stderr


def test_store_namespaces_keep_key_dtypes_and_batch_invariance_apart() -> None:
    """KV written one way is never read another way; the default keeps the namespace stores were
    written under before FP8 keys existed (so upgrading does not empty anyone's store)."""
    import hashlib
    import json

    from v4serve.engine.engine import KV_FORMAT_VERSION, kv_namespace

    model = build_tiny(tiny_config(), seed=0)
    default = kv_namespace(model, torch.float32, b"w")
    fp8 = kv_namespace(model, torch.float32, b"w", "fp8")
    model.use_kernels(load_kernels("torch", batch_invariant=True))
    invariant = kv_namespace(model, torch.float32, b"w")
    assert len({default, fp8, invariant}) == 3
    earlier = hashlib.sha256(json.dumps(model.cfg.to_official_dict(), sort_keys=True).encode() + b"w"
                             + f"torch.float32|format={KV_FORMAT_VERSION}".encode()).digest()
    assert default == earlier
