"""Kernel timings and model tokens/s at DeepSeek-V4's real head sizes: the measuring half of
`bench/gpu_check.sh`.

1. Each Triton kernel against its plain-torch twin on the same inputs (time ratio twin / Triton).
2. The quantized GEMMs (kernels/quant_linear_triton.py) at V4-Flash's shapes — wq_b 1024→32768,
   wo_b 8192→4096 and one routed expert's w1 4096→2048, at T = 1, 32 and 512 — FP8 and FP4 (e8m0
   scales) against a bf16 `F.linear` on the dense weight; and the grouped MoE (256 experts, top-6,
   hidden 4096, width 2048) on FP4 stacks against the dense grouped kernel in bf16, at T = 32 and
   512. Ratio = bf16 time / quantized time (above 1: the quantized kernel is faster). GPU times
   are `triton.testing.do_bench` medians (L2 flushed between calls: weights stream from HBM, as
   in a real step).
3. Decode and prefill tokens/s of a 4-layer model with random weights and the real attention
   shapes (64 heads of 512, window 128, ratios 4/128, top-k 512), per backend, at 8K and 64K
   context (prefill: one 8K-token chunk ending there; decode: batch 1 and 32). Earlier context is
   random KV rather than prefilled: a step's cost depends on how much it reads, not on what.

    .venv/bin/python bench/bench_gpu.py [--device cuda] [--smoke]

`--smoke` shrinks every size so the script itself can be tested on a CPU (Triton interpreted).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from v4serve.cache.device_kv import DeviceKV  # noqa: E402
from v4serve.cache.layout import KVLayout, KVRecord  # noqa: E402
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk  # noqa: E402
from v4serve.engine.model.v4.model import DeepseekV4  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.kernels.attention import RaggedBatch  # noqa: E402
from v4serve.kernels.decode_writes import Compression  # noqa: E402
from v4serve.kernels.kv_fp8 import encode  # noqa: E402
from v4serve.kernels.quant_linear import QuantizedWeight  # noqa: E402
from v4serve.kernels.registry import load_kernels  # noqa: E402

REAL = dict(hidden_size=4096, num_heads=64, head_dim=512, rope_dim=64, q_lora_rank=1024, o_groups=8,
            o_lora_rank=1024, window=128, compress_ratios=(0, 4, 128, 4), index_n_heads=64, index_head_dim=128,
            index_topk=512, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=2048,
            vocab_size=32768, num_layers=4)
# (name, K inputs, N outputs) of V4-Flash's projections; smoke: the same roles, small.
GEMMS = [("wq_b", 1024, 32768), ("wo_b", 8192, 4096), ("expert w1", 4096, 2048)]
SMOKE_GEMMS = [("wq_b", 64, 256), ("wo_b", 256, 64), ("expert w1", 128, 64)]
# (experts, top-k, hidden, width) of V4-Flash's MoE.
MOE, SMOKE_MOE = (256, 6, 4096, 2048), (8, 2, 64, 32)
SMOKE = dict(hidden_size=64, num_heads=4, head_dim=32, rope_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=32,
             window=8, compress_ratios=(0, 4, 16, 4), index_n_heads=4, index_head_dim=16, index_topk=6,
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_layers=4)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of fn. On a GPU one warm-up call first (it compiles the Triton kernels);
    elsewhere there is nothing to warm (Triton is interpreted, torch has no JIT on a CPU)."""
    if device.type == "cuda":
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def kernel_timings(device: torch.device, smoke: bool, dtype: torch.dtype, repeats: int) -> list[dict]:
    """Each kernel and its twin on one decode batch of 32 sequences at an 8K context."""
    twin, fused = load_kernels("torch"), load_kernels("triton", device)
    h_, d, w, hidden = (4, 32, 8, 64) if smoke else (64, 512, 128, 4096)
    batch, context, per_block, topk = (4, 64, 4, 6) if smoke else (32, 8192, 32, 512)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    blocks_per_seq = -(-(context // 4) // per_block) + 1
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    ragged = RaggedBatch.build(list(range(batch)), [context] * batch, [1] * batch, [0] * batch, tables, device)
    q, kv, ring = rand(batch, h_, d), rand(batch, d), rand(batch, w, d)
    entries, sink = rand(batch * blocks_per_seq, per_block, d), rand(h_).float()
    picks = torch.stack([torch.randperm(context // 4, generator=gen)[:topk] for _ in range(batch)]).to(device)
    h = rand(batch, 4, hidden)
    fn, base, scale = rand(24, 4 * hidden) * 0.01, rand(24).float(), torch.ones(3, device=device)
    x, cos, sin = rand(batch, h_, d), rand(batch, 32 if not smoke else 4).float(), rand(batch, 32 if not smoke else 4)
    record = KVRecord(head_dim=d, rope_dim=8 if smoke else 64, rope_dtype=str(dtype).removeprefix("torch."),
                      rope_itemsize=torch.empty((), dtype=dtype).element_size())
    ring8, entries8 = encode(ring, record), encode(entries, record)
    n = context // 4  # CSA entries each sequence sees
    scores, counts = rand(batch, n).float(), torch.full((batch,), n, device=device)
    ratio, positions = 4, torch.full((batch,), context + 3, device=device)  # each decode completes an entry
    comp_kv, comp_score, comp_ring = rand(batch, 2 * d), rand(batch, 2 * d), rand(batch, 2 * ratio, 2 * d).float()
    comp_ring_score = comp_ring.clone()
    comp_w, inv_freq = rand(d), torch.rand(record.rope_dim // 2, generator=gen).to(device)
    slots, frozen = torch.arange(batch, device=device), torch.zeros(batch, dtype=torch.long, device=device)
    d_index = 16 if smoke else 128  # the indexer's key width
    index_keys, index_w = rand(batch * blocks_per_seq, per_block, d_index), rand(d_index)
    compressions = [  # a CSA layer's two compressors: its own (FP8 entries) and its indexer's
        Compression(comp_kv, comp_score, comp_ring, comp_ring_score, entries8, ratio, True, comp_w, 1e-6,
                    comp_score[:ratio], record),
        Compression(rand(batch, 2 * d_index), rand(batch, 2 * d_index), rand(batch, 2 * ratio, 2 * d_index).float(),
                    rand(batch, 2 * ratio, 2 * d_index).float(), index_keys, ratio, True, index_w, 1e-6,
                    rand(ratio, 2 * d_index), None)]
    cases = {
        "sparse_attention (CSA top-k, FP8 keys)": lambda k: k.sparse_attention(q, kv, ring8, entries8, picks, ragged,
                                                                               4, sink, d**-0.5, record),
        "sparse_attention (CSA top-k)": lambda k: k.sparse_attention(q, kv, ring, entries, picks, ragged, 4, sink,
                                                                     d**-0.5),
        "sparse_attention (HCA)": lambda k: k.sparse_attention(q, kv, ring, entries, None, ragged, 4, sink, d**-0.5),
        "mhc_pre": lambda k: k.mhc_pre(h, fn, base, scale, 1e-6, 1e-6, 20),
        "rms_norm_rope (queries)": lambda k: k.rms_norm_rope(x, None, 1e-6, cos.to(dtype), sin.to(dtype)),
        "index_topk": lambda k: k.index_topk(scores, counts, topk),
        "compress_decodes (FP8 keys)": lambda k: k.compress_decodes(
            comp_kv, comp_score, comp_ring, comp_ring_score, slots, positions, frozen, ragged.decodes.tables,
            entries8, ratio, True, comp_w, 1e-6, inv_freq, comp_score[:ratio], record),
        "write_window (FP8 keys)": lambda k: k.write_window(ring8, kv, ragged, record),
        "round_keys (FP8 keys)": lambda k: k.round_keys(kv, record),
        "write_decode_step (CSA, FP8 keys)": lambda k: k.write_decode_step(ring8, kv, ragged, record, compressions,
                                                                           inv_freq),
    }
    rows = []
    for name, case in cases.items():
        t_twin = timed(lambda c=case: c(twin), device, repeats)
        t_fused = timed(lambda c=case: c(fused), device, repeats)
        rows.append({"kernel": name, "torch_s": t_twin, "triton_s": t_fused, "ratio": t_twin / t_fused})
    return rows


def kernel_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds per call of fn: on a GPU the median of `do_bench` (L2 flushed before each call, so
    the launch queue runs ahead and the figure is the kernels' own time); elsewhere `timed`."""
    if device.type != "cuda":
        return timed(fn, device, repeats)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3


def random_packed(shape: tuple[int, ...], fmt: str, device: torch.device, gen: torch.Generator) -> QuantizedWeight:
    """Random codes (FP8 without the NaN codes 0x7F/0xFF) and e8m0 scales near 1 of a weight
    [..., N, K]: for timing, what the codes hold does not matter, but NaNs could."""
    *lead, n, k = shape
    if fmt == "fp8":
        codes = torch.randint(0, 256, (*lead, n, k), generator=gen, dtype=torch.uint8, device=device)
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
        scale_shape = (*lead, -(-n // 128), -(-k // 128))
    else:
        codes = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.uint8, device=device)
        scale_shape = (*lead, n, -(-k // 32))
    scale = torch.randint(117, 127, scale_shape, generator=gen, dtype=torch.uint8, device=device)
    return QuantizedWeight(codes, scale, fmt)


def quantized_timings(device: torch.device, smoke: bool, dtype: torch.dtype, repeats: int
                      ) -> tuple[list[dict], list[dict]]:
    """The quantized GEMMs and the grouped FP4 MoE against their dense counterparts (see the
    module docstring)."""
    from v4serve.kernels import moe_triton, quant_linear_triton

    gen = torch.Generator(device).manual_seed(1)  # on the device: the expert stacks are GiBs

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(shape[-1]**-0.5)

    gemms = []
    for name, k, n in SMOKE_GEMMS if smoke else GEMMS:
        dense = rand(n, k)
        packed = {fmt: random_packed((n, k), fmt, device, gen) for fmt in ("fp8", "fp4")}
        for t in (1, 4) if smoke else (1, 32, 512):
            x = rand(t, k)
            row = {"weight": name, "k": k, "n": n, "tokens": t,
                   "dense_s": kernel_time(functools.partial(F.linear, x, dense), device, repeats)}
            for fmt, w in packed.items():
                row[f"{fmt}_s"] = kernel_time(functools.partial(quant_linear_triton.linear, x, w), device, repeats)
                row[f"{fmt}_ratio"] = row["dense_s"] / row[f"{fmt}_s"]
            gemms.append(row)
        del dense, packed
    experts, topk, d, inter = SMOKE_MOE if smoke else MOE
    shapes = ((experts, inter, d), (experts, d, inter), (experts, inter, d))  # w1, w2, w3
    stacks = {"dense": [rand(*shape) for shape in shapes],
              "fp4": [random_packed(shape, "fp4", device, gen) for shape in shapes]}
    moes = []
    for t in (4, 16) if smoke else (32, 512):
        x = rand(t, d)
        chosen = torch.randn(t, experts, generator=gen, device=device).topk(topk, dim=-1).indices
        weights = torch.full((t, topk), 1.0 / topk, device=device)
        row = {"tokens": t, "experts": experts, "topk": topk, "hidden": d, "width": inter}
        for label, (w1, w2, w3) in stacks.items():
            run = functools.partial(moe_triton.experts, x, weights, chosen, w1, w2, w3, 0.0)
            row[f"{label}_s"] = kernel_time(run, device, repeats)
        row["ratio"] = row["dense_s"] / row["fp4_s"]
        moes.append(row)
    del stacks
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the model runs next
    return gemms, moes


def filled_kv(model: DeepseekV4, batch: int, context: int, device: torch.device, dtype: torch.dtype
              ) -> tuple[DeviceKV, list[list[int]]]:
    cfg = model.cfg
    per_seq = -(-(context + 64) // cfg.block_size)
    kv = DeviceKV(KVLayout.from_config(cfg), num_slots=batch, num_blocks=batch * per_seq, dtype=dtype,
                  device=device)
    for layer in kv.layers:
        for t in layer.slot_tensors() + layer.block_tensors():
            t.normal_()
    return kv, [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]


def decode_tok_s(model: DeepseekV4, batch: int, context: int, device: torch.device, dtype: torch.dtype,
                 steps: int) -> float:
    kv, tables = filled_kv(model, batch, context, device, dtype)
    ids = torch.randint(0, model.cfg.vocab_size, (batch,), device=device)
    position = [context]

    def step() -> None:
        seqs = [SeqChunk(slot=i, block_table=tables[i], start=position[0], num_new=1) for i in range(batch)]
        model(ids, AttentionMetadata.build(seqs), kv)
        position[0] += 1

    return batch / timed(step, device, steps)


def prefill_tok_s(model: DeepseekV4, context: int, chunk: int, device: torch.device, dtype: torch.dtype,
                  repeats: int) -> float:
    """One prefill chunk whose last token sits at `context` (earlier tokens: random KV)."""
    kv, tables = filled_kv(model, 1, context, device, dtype)
    start = context - chunk
    ids = torch.randint(0, model.cfg.vocab_size, (chunk,), device=device)
    meta = AttentionMetadata.build([SeqChunk(slot=0, block_table=tables[0], start=start, num_new=chunk)])
    return chunk / timed(lambda: model(ids, meta, kv), device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to test the script on a CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    repeats = 2 if args.smoke else 10
    kernels = kernel_timings(device, args.smoke, dtype, repeats)
    print_table(f"kernels vs their torch twins on {device} ({str(dtype).removeprefix('torch.')}; ratio = torch / "
                "triton)", ["kernel", "torch s", "triton s", "ratio"],
                [[r["kernel"], r["torch_s"], r["triton_s"], r["ratio"]] for r in kernels])

    gemms, moes = quantized_timings(device, args.smoke, dtype, repeats)
    print_table(f"quantized GEMMs vs {str(dtype).removeprefix('torch.')} F.linear on {device} (ratio = dense / "
                "quantized)", ["weight", "K→N", "T", "dense s", "fp8 s", "fp4 s", "fp8 ratio", "fp4 ratio"],
                [[r["weight"], f"{r['k']}→{r['n']}", r["tokens"], r["dense_s"], r["fp8_s"], r["fp4_s"],
                  r["fp8_ratio"], r["fp4_ratio"]] for r in gemms])
    print_table("grouped MoE: FP4 stacks vs the dense grouped kernel (ratio = dense / fp4)",
                ["T", "experts", "top-k", "dense s", "fp4 s", "ratio"],
                [[r["tokens"], r["experts"], r["topk"], r["dense_s"], r["fp4_s"], r["ratio"]] for r in moes])

    cfg = tiny_config(**(SMOKE if args.smoke else REAL))
    model = build_tiny(cfg).to(device=device, dtype=dtype)
    contexts, batches = ([64, 256], [1, 2]) if args.smoke else ([8192, 65536], [1, 32])
    chunk = 32 if args.smoke else 8192
    results: dict = {"device": str(device), "dtype": str(dtype), "kernels": kernels, "quantized_gemm": gemms,
                     "quantized_moe": moes, "model": []}
    for backend in ("torch", "triton"):
        model.use_kernels(load_kernels(backend, device))
        for context in contexts:
            row = {"backend": backend, "context": context,
                   "prefill_tok_s": prefill_tok_s(model, context, chunk, device, dtype, 1 if args.smoke else 3)}
            for batch in batches:
                row[f"decode_tok_s_batch{batch}"] = decode_tok_s(model, batch, context, device, dtype,
                                                                 1 if args.smoke else 8)
            results["model"].append(row)
    header = ["backend", "context", "prefill tok/s"] + [f"decode b{b} tok/s" for b in batches]
    print_table(f"model with the real head sizes, {cfg.num_layers} layers of random weights",
                header, [[r["backend"], r["context"], r["prefill_tok_s"]] +
                         [r[f"decode_tok_s_batch{b}"] for b in batches] for r in results["model"]])
    write_results("bench_gpu_smoke" if args.smoke else "bench_gpu", results)


if __name__ == "__main__":
    main()
