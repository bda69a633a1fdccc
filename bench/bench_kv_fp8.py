"""FP8 keys (`--kv-cache-dtype fp8`) against full-precision keys: bytes per token, how often greedy
decoding picks the same tokens, how far the logits move, and the CPU decode-rate ratio.

Random-weight models have nearly flat logits, so one early flip sends the rest of a greedy
continuation elsewhere: agreement is reported as the matching prefix and the matching positions.

    .venv/bin/python bench/bench_kv_fp8.py [--prompts 6] [--tokens 24] [--context 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import interleaved, print_table, write_results  # noqa: E402
from v4serve.cache.layout import key_record  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.v4.model import DeepseekV4  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402


class LogitsEngine(LLMEngine):
    """Keeps the logits row of every sampled token."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows: list[torch.Tensor] = []

    def update(self, chunks, logits):
        self.rows.extend(logits[i].clone() for i in range(len(logits)))
        return super().update(chunks, logits)


def run(model: DeepseekV4, dtype: str, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    engine = LogitsEngine(model, EngineConfig(max_model_len=4096, max_num_seqs=1, enable_prefix_caching=False,
                                              kv_cache_dtype=dtype))
    out = engine.generate([Request("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True))])["r"]
    return out, engine.rows[0]


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return prefix, sum(x == y for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    parser.add_argument("--context", type=int, default=300, help="prompt length")
    args = parser.parse_args()
    model = build_tiny()
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    rows, per_prompt = [], []
    for i in range(args.prompts):
        prompt = torch.randint(64, cfg.vocab_size, (args.context,), generator=gen).tolist()
        (full, full_logits), (fp8, fp8_logits) = (run(model, d, prompt, args.tokens) for d in ("auto", "fp8"))
        prefix, same = agreement(full, fp8)
        rel = ((fp8_logits - full_logits).abs().max() / full_logits.abs().max()).item()
        per_prompt.append({"matching_prefix": prefix, "matching_positions": same, "first_logits_rel_err": rel})
        rows.append([i, f"{prefix}/{args.tokens}", f"{same}/{args.tokens}", rel])
    print_table(f"tiny model, {args.context}-token prompts: greedy tokens with FP8 keys vs fp32 keys",
                ["prompt", "matching prefix", "matching positions", "first-token logits rel err"], rows)

    engines = {d: LLMEngine(model, EngineConfig(max_model_len=4096, max_num_seqs=1, enable_prefix_caching=False,
                                                kv_cache_dtype=d)) for d in ("auto", "fp8")}
    prompt = torch.randint(64, cfg.vocab_size, (args.context,), generator=gen).tolist()

    def decode(dtype: str):
        return lambda: engines[dtype].generate([Request("t", prompt, SamplingParams(max_tokens=32,
                                                                                      ignore_eos=True))])
    times = interleaved({d: decode(d) for d in engines}, repeats=3)
    block = cfg.block_size
    sizes = {d: (engines[d].layout.block_bytes(4) / block, engines[d].layout.state_bytes_per_slot(4))
             for d in engines}
    print_table("bytes and time, fp8 / auto", ["", "auto", "fp8", "fp8 / auto"],
                [["Block Cache B/token", sizes["auto"][0], sizes["fp8"][0], sizes["fp8"][0] / sizes["auto"][0]],
                 ["State Cache B/slot", sizes["auto"][1], sizes["fp8"][1], sizes["fp8"][1] / sizes["auto"][1]],
                 ["prefill + 32 decodes (s)", times["auto"], times["fp8"], times["fp8"] / times["auto"]]])
    record = key_record(cfg.head_dim, cfg.rope_dim, "float32", "fp8")
    write_results("bench_kv_fp8", {
        "record_bytes": record.nbytes if record else None, "per_prompt": per_prompt,
        "mean_matching_prefix": sum(p["matching_prefix"] for p in per_prompt) / len(per_prompt),
        "mean_matching_positions": sum(p["matching_positions"] for p in per_prompt) / len(per_prompt),
        "tokens_per_prompt": args.tokens,
        "block_bytes_per_token": {d: s[0] for d, s in sizes.items()},
        "state_bytes_per_slot": {d: s[1] for d, s in sizes.items()},
        "time_ratio_fp8_over_auto": times["fp8"] / times["auto"]})


if __name__ == "__main__":
    main()
