"""Numerics at DeepSeek-V4-Flash's real per-layer widths: v4serve against transformers' DeepseekV4ForCausalLM,
packed FP8/FP4 weights against their dequantized values, and the Triton kernels against the torch ones.

    .venv/bin/python bench/bench_real_widths.py [--prompt 2300] [--keep 64] [--decode 8] [--chunk 16]
                                                [--experts-per-tok 2] [--skip-triton] [--skip-packed]

The model has V4-Flash's layer widths (hidden 4096, 64 heads × 512, rope 64, q_lora 1024, 8 output
groups × 1024, indexer 64 heads × 128 with top-k 512, window 128, expert width 2048, 4 mHC streams)
but 3 layers (compress ratios 0, 4, 128: one of each kind; the first hash-routed), 8 routed experts
(top-2 by default) and a 2,048-token vocabulary: about 1.04 B random fp32 parameters (4.2 GB). A
2,300-token prompt makes the indexer choose 512 of up to 575 CSA entries from position 2,051 on.

1. **transformers**: one checkpoint with the official names, loaded by both (fp32). v4serve
   (torch kernels, fused projections, as `serve` runs on a CPU) prefills the prompt and decodes
   `--decode` greedy steps; transformers runs the prompt and v4serve's tokens in one forward. The
   logits of the last `--keep` prompt positions and of every decode step are compared (max |diff|,
   relative error, same argmax = same greedy token).
2. **Triton** (interpreted on a CPU: `TRITON_INTERPRET=1`, which v4serve sets itself): from the state
   after the prompt, one decode step and one `--chunk`-token prefill chunk on the Triton kernels
   against the same on the torch kernels, with fp32 keys and with FP8 keys (`--kv-cache-dtype
   fp8`; its prompt prefilled again on the torch kernels into FP8 records). The real top-k 512
   selects here (from position 2,051 on with the default prompt). Interpreted at these widths a
   Triton decode step and an 8-token chunk take about 45 s together on 2 cores: with the model's
   build and the rest too slow for `make test`, which compares the twins at small widths (tests/test_kernels.py,
   tests/test_triton_backend.py) and compiles these widths for GPUs (tests/test_aot.py).
3. **packed**: the same weights written `--quantize mixed` (FP8 dense, FP4 experts) and loaded
   packed (`--weight-dtype checkpoint`) vs dequantized at load: the same prompt and decode steps,
   compared bitwise.

Cost, measured on 2 cores with `--chunk 8` and the other defaults: 7 minutes, peak RSS 11.6 GB
(reported at the end, `resource.getrusage`; transformers' attention matrices, 64 heads × 2,308²,
are the peak). The phases run one after another and each
frees its model before the next loads, so at most one 4.2 GB model is resident at a time. Checkpoints are
written to a temporary folder (4.2 GB fp32 plus 1.2 GB mixed) and removed at the end. Results:
bench/results/bench_real_widths.json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from v4serve.cache.layout import key_record  # noqa: E402
from v4serve.engine.model.config import ModelConfig  # noqa: E402
from v4serve.engine.model.parallel.single import SingleSequence  # noqa: E402
from v4serve.engine.model.plan import preset_config  # noqa: E402
from v4serve.engine.model.v4.model import DeepseekV4  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.engine.model.weights.checkpoint import load_model, write_checkpoint  # noqa: E402
from v4serve.kernels.registry import load_kernels  # noqa: E402

# Everything that sizes or shapes one layer, taken from the real preset.
LAYER_FIELDS = ("hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                "window", "csa_ratio", "index_n_heads", "index_head_dim", "index_topk", "n_shared_experts",
                "moe_intermediate_size", "routed_scaling_factor", "scoring_func", "swiglu_limit", "hc_mult",
                "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta", "yarn")


def real_width_config(**changes: Any) -> ModelConfig:
    """V4-Flash's per-layer widths; 3 layers (one of each kind), 8 experts, a 2,048-token vocabulary."""
    flash = preset_config("deepseek-v4-flash")
    base = {name: getattr(flash, name) for name in LAYER_FIELDS}
    base.update(num_layers=3, compress_ratios=(0, 4, 128), n_routed_experts=8, num_experts_per_tok=2,
                num_hash_layers=1, vocab_size=2048)
    return tiny_config(**{**base, **changes})


def fork(seq: SingleSequence) -> SingleSequence:
    """The same sequence with its own copy of the KV state, to continue it in two ways."""
    other = copy.copy(seq)
    other.device_kv = copy.deepcopy(seq.device_kv)
    return other


def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    diff = (ours - ref).abs()
    return {"max_abs_diff": diff.max().item(), "rel_err": (diff.max() / ref.abs().max()).item(),
            "max_abs_logit": ref.abs().max().item(), "rows": len(ref),
            "same_argmax": int((ours.argmax(-1) == ref.argmax(-1)).sum()), "bitwise": torch.equal(ours, ref)}


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class Phases:
    """Wall time of each phase, printed as it ends (a full run takes a while)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t0
        print(f"[{time.perf_counter() - self.start:7.0f} s] {name}: {self.seconds[name]:.1f} s, "
              f"peak RSS {peak_rss_gb():.1f} GB", flush=True)


def greedy(model: DeepseekV4, prompt: list[int], keep: int, steps: int,
           ) -> tuple[SingleSequence, torch.Tensor, list[int]]:
    """Prefill `prompt`, then `steps` greedy decode steps → (the state after the prompt, the logits of
    the last `keep` prompt positions and of each step, the greedy tokens: one per row from the last
    prompt position on)."""
    seq = SingleSequence(model, len(prompt) + steps + 64)
    rows = [seq.prefill(prompt)[-keep:]]
    after_prompt = fork(seq)
    tokens = [int(rows[0][-1].argmax())]
    for _ in range(steps):
        rows.append(seq.step([tokens[-1]]))
        tokens.append(int(rows[-1][-1].argmax()))
    return after_prompt, torch.cat(rows), tokens


def transformers_logits(folder: Path, ids: list[int], keep: int) -> torch.Tensor:
    """transformers' fp32 logits of the last `keep` positions of one uncached forward over `ids`."""
    import transformers

    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), logits_to_keep=keep).logits[0]
    del hf
    gc.collect()
    return out


def torch_vs_triton(model: DeepseekV4, base: SingleSequence, token: int, chunk: list[int],
                    ) -> dict[str, dict[str, Any]]:
    """One decode step and one prefill chunk from `base`'s state, on the torch and on the Triton
    kernels (the same weights and state), compared; seconds of each Triton call included."""
    torch_kernels, triton_kernels = load_kernels("torch"), load_kernels("triton")
    out = {}
    for name, ids in (("decode", [token]), (f"chunk {len(chunk)}", chunk)):
        model.use_kernels(torch_kernels)
        want = fork(base).step(ids, all_logits=True)
        model.use_kernels(triton_kernels)
        t0 = time.perf_counter()
        try:
            got = fork(base).step(ids, all_logits=True)
        finally:
            model.use_kernels(torch_kernels)
        out[name] = {**compare(got, want), "triton_seconds": time.perf_counter() - t0}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2300, help="prompt tokens")
    parser.add_argument("--keep", type=int, default=64, help="last prompt positions whose logits are compared")
    parser.add_argument("--decode", type=int, default=8, help="greedy decode steps")
    parser.add_argument("--chunk", type=int, default=16, help="tokens of the Triton prefill chunk")
    parser.add_argument("--experts-per-tok", type=int, default=2)
    parser.add_argument("--skip-triton", action="store_true")
    parser.add_argument("--skip-packed", action="store_true")
    args = parser.parse_args()

    phases = Phases()
    cfg = real_width_config(num_experts_per_tok=args.experts_per_tok)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist()
    chunk = torch.randint(0, cfg.vocab_size, (args.chunk,), generator=gen).tolist()
    tmp = Path(tempfile.mkdtemp(prefix="bench-real-widths-"))
    results: dict[str, Any] = {"config": {"layers": cfg.num_layers, "compress_ratios": list(cfg.compress_ratios),
                                          "experts": cfg.n_routed_experts, "experts_per_tok": cfg.num_experts_per_tok,
                                          "vocab": cfg.vocab_size, "index_topk": cfg.index_topk},
                               "prompt": args.prompt, "decode_steps": args.decode, "threads": torch.get_num_threads()}
    rows = []
    try:
        with phases("build and write checkpoints"):
            model = build_tiny(cfg, seed=7)
            results["parameters"] = sum(p.numel() for p in model.parameters())
            shard = 1 << 30  # safetensors copies a shard to bytes as it writes: keep the copy small
            write_checkpoint(model, tmp / "fp32", max_shard_bytes=shard)
            if not args.skip_packed:
                write_checkpoint(model, tmp / "mixed", max_shard_bytes=shard, quantize="mixed")
            del model
            gc.collect()

        with phases("v4serve fp32: prefill and decode"):
            ours = load_model(tmp / "fp32", progress=False)
            ours.use_kernels(load_kernels("torch"))
            after_prompt, ours_logits, tokens = greedy(ours, prompt, args.keep, args.decode)

        if not args.skip_triton:
            with phases("triton vs torch, fp32 KV"):
                results["triton_fp32_kv"] = torch_vs_triton(ours, after_prompt, tokens[0], chunk)
            with phases("triton vs torch, fp8 KV (prompt prefilled again)"):
                fp8 = SingleSequence(ours, args.prompt + 64, record=key_record(cfg.head_dim, cfg.rope_dim,
                                                                               "float32", "fp8"))
                fp8.step(prompt)
                results["triton_fp8_kv"] = torch_vs_triton(ours, fp8, tokens[0], chunk)
                del fp8
        del ours, after_prompt
        gc.collect()

        with phases("transformers fp32: one forward over prompt + greedy tokens"):
            ref = transformers_logits(tmp / "fp32", prompt + tokens[:args.decode], args.keep + args.decode)
        k = args.keep
        vs_hf = {"prefill": compare(ours_logits[:k], ref[:k]), "decode": compare(ours_logits[k:], ref[k:])}
        # The greedy tokens: v4serve's choice at the last prompt position and after each decode step,
        # against transformers' argmax at the same positions (teacher-forced with v4serve's tokens).
        hf_tokens = ref[k - 1:].argmax(-1).tolist()
        vs_hf["greedy_tokens"] = {"v4serve": tokens, "transformers": hf_tokens,
                                  "agree": sum(a == b for a, b in zip(tokens, hf_tokens, strict=True))}
        results["vs_transformers"] = vs_hf
        for name, r in (("prefill", vs_hf["prefill"]), ("decode", vs_hf["decode"])):
            rows.append([f"v4serve vs transformers, {name}", r["rows"], r["max_abs_diff"], r["rel_err"],
                         f"{r['same_argmax']}/{r['rows']}", "-"])
        rows.append(["  greedy tokens (last prompt position + decode)", len(tokens), "-", "-",
                     f"{vs_hf['greedy_tokens']['agree']}/{len(tokens)}", "-"])

        if not args.skip_packed:
            packed_logits = {}
            for packed in (False, True):
                with phases(f"mixed checkpoint, {'packed' if packed else 'dequantized'}: prefill and decode"):
                    model = load_model(tmp / "mixed", progress=False, packed=packed)
                    model.use_kernels(load_kernels("torch"))
                    _, packed_logits[packed], _ = greedy(model, prompt, args.keep, args.decode)
                    del model
                    gc.collect()
            r = results["packed_vs_dequantized"] = compare(packed_logits[True], packed_logits[False])
            rows.append(["packed vs dequantized (mixed)", r["rows"], r["max_abs_diff"], r["rel_err"],
                         f"{r['same_argmax']}/{r['rows']}", r["bitwise"]])

        for kv in ("fp32", "fp8"):
            for name, r in results.get(f"triton_{kv}_kv", {}).items():
                rows.append([f"triton vs torch, {kv} KV, {name}", r["rows"], r["max_abs_diff"], r["rel_err"],
                             f"{r['same_argmax']}/{r['rows']}", r["bitwise"]])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results["seconds"] = phases.seconds
    results["peak_rss_gb"] = peak_rss_gb()
    print_table(f"V4-Flash layer widths, {results['parameters'] / 1e9:.2f} B parameters, fp32 CPU, "
                f"{args.prompt}-token prompt (rel err = max |diff| / max |reference logit|)",
                ["comparison", "rows", "max |diff|", "rel err", "same argmax", "bitwise"], rows)
    print(f"\ntotal {sum(phases.seconds.values()):.0f} s, peak RSS {results['peak_rss_gb']:.1f} GB")
    write_results("bench_real_widths", results)


if __name__ == "__main__":
    main()
