"""Speculative decoding on the embedded tiny model, side by side in one run (batch 1, greedy): output
tokens per second and mean acceptance length (1 + accepted drafts per pass, vLLM's figure) for

  (a) n-gram drafts on a copy-heavy workload: the prompt holds a passage and the model's own earlier
      continuation of it, then edits, then the passage's end again (an agent re-emitting what it
      read); the reply follows the earlier continuation as far as the model does;
  (b) MTP drafts at k = 1, 2 on the same workload, from the tiny model's multi-token-prediction layer:
      its weights are random (the main weights are the served tiny model's), so it guesses badly and
      this row measures what drafting and verifying cost when little is kept, not what a trained
      layer gains;
  (c) an oracle drafter that is always right (test-only: it knows the reply), at k = 1, 2, 3, which
      bounds what the verifier path can gain on this machine.

Every run's tokens are checked equal to the run without speculation (greedy).

    .venv/bin/python bench/bench_spec.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import interleaved, print_table, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.v4.model import DeepseekV4  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402
from v4serve.engine.speculative import SpeculativeConfig  # noqa: E402


def generate(model: DeepseekV4, prompt: list[int], n: int, spec: SpeculativeConfig | None = None,
             oracle: list[int] | None = None) -> tuple[list[int], LLMEngine]:
    engine = LLMEngine(model, EngineConfig(max_model_len=4096, max_num_seqs=1, enable_prefix_caching=False,
                                           speculative=spec))
    if oracle is not None:
        assert spec is not None
        k = spec.num_speculative_tokens
        engine.scheduler.drafter = lambda req, most: oracle[len(req.output_token_ids):][:min(most, k)]
    out = engine.generate([Request("r", list(prompt), SamplingParams(max_tokens=n, ignore_eos=True))])["r"]
    return out, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_tiny()
    gen = torch.Generator().manual_seed(1)
    passage = torch.randint(64, model.cfg.vocab_size, (300,), generator=gen).tolist()
    earlier, _ = generate(model, passage, args.tokens)
    edits = torch.randint(64, model.cfg.vocab_size, (20,), generator=gen).tolist()
    copying = passage + earlier + edits + passage[-160:]
    plain = {"copy-heavy": generate(model, copying, args.tokens)[0], "passage": earlier}

    with_mtp = build_tiny(tiny_config(num_nextn_predict_layers=1))  # the same main weights, and a random MTP layer
    runs: dict[str, tuple[str, list[int], SpeculativeConfig | None, bool]] = {
        "(a) no speculation": ("copy-heavy", copying, None, False),
        "(a) n-gram k=3": ("copy-heavy", copying, SpeculativeConfig("ngram", 3, 1, 4), False),
        "(b) no speculation": ("copy-heavy", copying, None, False),
        "(b) MTP k=1": ("copy-heavy", copying, SpeculativeConfig("mtp", 1), False),
        "(b) MTP k=2": ("copy-heavy", copying, SpeculativeConfig("mtp", 2), False),
        "(c) no speculation": ("passage", passage, None, False),
    }
    for k in (1, 2, 3):
        runs[f"(c) oracle k={k}"] = ("passage", passage, SpeculativeConfig("ngram", k, 1, 4), True)
    engines: dict[str, LLMEngine] = {}

    def job(name: str):
        workload, prompt, spec, use_oracle = runs[name]
        net = with_mtp if name.startswith("(b)") else model

        def run() -> None:
            out, engines[name] = generate(net, prompt, args.tokens, spec, plain[workload] if use_oracle else None)
            assert out == plain[workload], f"{name}: speculation changed the greedy tokens"
        return run

    seconds = interleaved({name: job(name) for name in runs}, args.repeats)
    rows, figures = [], {}
    for name in runs:
        base = seconds[f"{name[:3]} no speculation"]
        counters = engines[name].spec
        mean_length = 1 + counters.accepted_tokens / counters.drafts if counters.drafts else 1.0
        figures[name] = {"tokens_per_s": args.tokens / seconds[name], "speedup": base / seconds[name],
                         "mean_acceptance_length": mean_length, "drafts": counters.drafts,
                         "draft_tokens": counters.draft_tokens, "accepted_tokens": counters.accepted_tokens}
        rows.append([name, f"{args.tokens / seconds[name]:.1f}", f"{base / seconds[name]:.2f}", f"{mean_length:.2f}",
                     f"{counters.accepted_tokens}/{counters.draft_tokens}"])
    print_table(f"speculative decoding, batch 1, {args.tokens} greedy tokens, tiny model on this machine "
                "(speedup: against the same workload without speculation, measured in turns)",
                ["run", "tokens/s", "speedup", "mean acceptance length", "accepted/proposed"], rows)
    write_results("bench_spec", {"tokens": args.tokens, "repeats": args.repeats, "runs": figures})


if __name__ == "__main__":
    main()
