"""`v4serve` command line: `serve` starts the daemon, `make-checkpoint` writes the tiny model, `plan`
tells whether a model fits before anything is loaded."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def make_checkpoint_main(args: argparse.Namespace) -> int:
    if args.model == "tiny-v41":
        return _make_v41_checkpoint(args)
    from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
    from v4serve.engine.model.weights.checkpoint import write_checkpoint
    from v4serve.server.text.tokenizer import write_byte_tokenizer_files

    overrides = dict(args.set or [])
    if "compress_ratios" in overrides:
        overrides["compress_ratios"] = tuple(overrides["compress_ratios"])
        overrides.setdefault("num_layers", len(overrides["compress_ratios"]))
    try:
        cfg = tiny_config(**overrides)
    except (TypeError, ValueError) as exc:
        print(f"v4serve make-checkpoint: invalid model size: {exc}", file=sys.stderr)
        return 2
    model = build_tiny(cfg, seed=args.seed)
    folder = write_checkpoint(model, args.dir, max_shard_bytes=args.max_shard_bytes, quantize=args.quantize)
    write_byte_tokenizer_files(folder)
    params = sum(p.numel() for p in model.parameters())
    stored = f", {args.quantize} weights" if args.quantize else ""
    print(f"wrote {folder} ({params / 1e6:.2f}M parameters{stored}, {cfg.num_layers} layers, "
          f"block size {cfg.block_size})")
    return 0


def _make_v41_checkpoint(args: argparse.Namespace) -> int:
    from v4serve.engine.model.v41.checkpoint import write_checkpoint
    from v4serve.engine.model.v41.tiny import build_tiny_v41, tiny_v41_config
    from v4serve.server.text.engram_map import folded_vocabulary
    from v4serve.server.text.tokenizer import ByteTokenizer, write_byte_tokenizer_files

    if args.quantize not in (None, "mixed"):
        print("v4serve make-checkpoint: tiny-v41 is written unquantized or as the released checkpoint is "
              "(--quantize mixed: FP8 with 32x32 blocks, MXFP4 routed experts)", file=sys.stderr)
        return 2
    overrides = dict(args.set or [])
    for key in ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layers",
                "engram_num_embeddings"):
        if key in overrides:
            overrides[key] = tuple(overrides[key])
    try:
        cfg = tiny_v41_config(**overrides)
        model = build_tiny_v41(folded_vocabulary(ByteTokenizer().vocabulary_json()), cfg, seed=args.seed)
    except (TypeError, ValueError) as exc:
        print(f"v4serve make-checkpoint: invalid model size: {exc}", file=sys.stderr)
        return 2
    folder = write_checkpoint(model, args.dir, quantize=args.quantize == "mixed", max_shard_bytes=args.max_shard_bytes)
    write_byte_tokenizer_files(folder)
    params = sum(p.numel() for p in model.parameters())
    stored = ", the released formats" if args.quantize else ""
    print(f"wrote {folder} (DeepSeek-V4.1, {params / 1e6:.2f}M parameters{stored}, {cfg.num_layers} layers, "
          f"block size {cfg.block_size})")
    return 0


# (flag, type, help); every flag is also a key of --config FILE and a V4SERVE_* variable.
SERVE_FLAGS: list[tuple[str, Any, str]] = [
    ("--model", str, "'tiny' (the embedded DeepSeek-V4 model), 'tiny-v41' (the embedded DeepSeek-V4.1 model) or a "
                     "checkpoint folder"),
    ("--host", str, "address to bind (default 0.0.0.0)"),
    ("--port", int, "port (default 8000; 0: a free one, named in the startup log)"),
    ("--served-model-name", str, "model name(s) clients send and see: several (space- or comma-separated, a list "
                                 "in --config) are aliases of one model, all listed by /v1/models; the first "
                                 "labels metrics and logs"),
    ("--device", str, "auto, cpu or cuda"),
    ("--dtype", str, "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16"),
    ("--attention-backend", str, "auto (Triton kernels on CUDA, plain torch elsewhere), torch or triton"),
    ("--kv-cache-dtype", str, "auto (keys in the model dtype) or fp8 (e4m3 + per-64 scales, as DeepSeek-V4)"),
    ("--weight-dtype", str, "auto (= checkpoint), checkpoint (FP8/FP4 weights stay packed), bf16 or fp32 "
                            "(dequantized at load)"),
    ("--batch-invariant", bool, "a request's logits are bitwise the same alone or in any batch (slower)"),
    ("--enforce-eager", bool, "run decode steps eagerly: no CUDA graphs (on CUDA they are captured per batch size)"),
    ("--async-scheduling", str, "auto, on or off: schedule and launch each step while the device runs the one "
                                "before (its tokens feed the next step on the device; the host reads them a step "
                                "later). auto: on with CUDA, off on the CPU (whose forward is synchronous)"),
    ("--tensor-parallel-size", int, "ranks (GPUs) the model is split across (default 1); one node: the daemon "
                                    "starts them; several nodes: launch with torchrun"),
    ("--expert-parallel", bool, "with --tensor-parallel-size N, give each rank E/N whole routed experts "
                                "instead of a slice of every expert"),
    ("--speculative-config", str, "speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", "
                                  "\"num_speculative_tokens\": 3, \"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}' "
                                  "(drafts copied from the request's own context), or '{\"method\": \"mtp\", "
                                  "\"num_speculative_tokens\": 2}' (drafts from the checkpoint's "
                                  "multi-token-prediction layer); greedy output unchanged"),
    ("--kv-events-config", str, "publish KV-cache events for routers, as vLLM's JSON: '{\"publisher\": \"zmq\", "
                                "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": "
                                "\"\"}' (BlockStored/BlockRemoved/AllBlocksCleared, msgpack over ZeroMQ)"),
    ("--default-chat-template-kwargs", str, "chat-template switches for chat requests that name none, as vLLM's JSON: "
                                           "'{\"thinking\": false}' answers them in chat mode (default: the "
                                           "model's: a checkpoint thinks, as DeepSeek's converter does; the "
                                           "embedded tiny model does not)"),
    ("--kv-transfer-config", str, "prefill and decode on separate replicas, as vLLM's JSON: '{\"kv_role\": "
                                  "\"kv_producer\"}' on prefill replicas, '{\"kv_role\": \"kv_consumer\", "
                                  "\"kv_connector_extra_config\": {\"producers\": [\"HOST:PORT\"]}}' on decode "
                                  "replicas (or kv_both), every replica with the fleet's $V4SERVE_KV_PEER_SECRET; the "
                                  "KV is handed over as store files, over HTTP or through a shared --kv-store-dir "
                                  "(README: Prefill and decode apart)"),
    ("--max-model-len", int, "longest prompt + completion, in tokens"),
    ("--max-num-seqs", int, "State Cache slots = most requests running at once"),
    ("--max-num-batched-tokens", int, "token budget of one engine step"),
    ("--max-waiting", int, "waiting requests before new ones get 503"),
    ("--num-blocks", int, "Block Cache blocks (default: every slot can hold max-model-len tokens)"),
    ("--no-prefix-caching", bool, "never reuse cached prefixes"),
    ("--kv-store-dir", str, "folder of the SSD prefix store"),
    ("--kv-store-max-bytes", int, "size bound of the SSD prefix store"),
    ("--no-kv-store", bool, "do not use the SSD prefix store"),
    ("--swa-cache-mode", str, "full, periodic (default), zero or auto: where window state is snapshotted for "
                              "later hits (auto: nowhere until a prefix is hit, then as periodic)"),
    ("--swa-checkpoint-interval", int, "periodic mode: tokens between state snapshots (multiple of the block)"),
    ("--api-key", str, "require 'Authorization: Bearer KEY' on every route but /health and /metrics"),
    ("--api-keys-file", str, "file of 'KEY TENANT' lines: each key is accepted (beside --api-key, whose tenant "
                             "is 'default') and each tenant's prefix cache is its own; read again on SIGHUP or "
                             "when it changes"),
    ("--shared-prefix-cache", bool, "with --api-keys-file, let tenants find each other's cached prefixes (faster "
                                    "shared prompts; reveals to each tenant what the others sent)"),
    ("--protect-metrics", bool, "with --api-key, require the key on /metrics too"),
    ("--max-request-bytes", int, "largest request body accepted (default 4 MiB; larger gets 413)"),
    ("--max-unread-tokens", int, "output a stream's client may leave unread (tokens; logprob entries count "
                                 "too): past half the engine holds the request, past all of it the request ends "
                                 "(default 65536)"),
    ("--unread-timeout", float, "seconds a stream may stay held (its client reading nothing, past half of "
                                "--max-unread-tokens) before its request ends (default 60)"),
    ("--max-logprob-entries", int, "logprob entries (chosen tokens and alternatives, echoed prompts included) one "
                                   "request may return; more is refused up front or ends the request (default "
                                   "1048576)"),
    ("--max-request-tokens", int, "tokens one request may cost: its prompts' tokens plus n × max_tokens for each "
                                  "(max_tokens left out counts as the rest of the context); more is a 400"),
    ("--grammar-cache-bytes", int, "compiled grammars (structured outputs, forced tool calls) kept per process, "
                                   "least recently used dropped first, weighed by their text (default 8 MiB; "
                                   "~30x that in memory)"),
    ("--responses-store-bytes", int, "Responses API responses kept for previous_response_id, counted with their "
                                     "input, output, tools and metadata; least recently used dropped first "
                                     "(default 256 MiB)"),
    ("--preprocess-workers", int, "processes that render conversations, tokenize and check tools and schemas, so "
                                  "a costly request cannot stall the front end (default 2; 0: a thread of it)"),
    ("--max-preprocess-seconds", float, "CPU seconds one request's preprocessing may take in a worker before it "
                                        "is refused with a 400 (default 10)"),
    ("--unknown-fields", str, "accept (default) or refuse: a request field no API defines is dropped, logged once "
                              "and named in the reply's x-v4serve-ignored-fields header, or refused with a 400 "
                              "(fields v4serve knows are honoured, listed as ignored, or refused by value)"),
    ("--stream-keepalive", float, "seconds a stream may go without an event while its request waits or prefills "
                                  "before the API's own keep-alive is sent (Messages ping, Responses in_progress, "
                                  "an empty chat/completions chunk) (default 10)"),
    ("--allowed-origins", str, "comma-separated web origins (https://app.example.com) whose pages may call the "
                               "API, or '*' (CORS); other pages' POSTs get 403"),
    ("--keep-alive-timeout", float, "seconds an idle keep-alive connection stays open (default 5)"),
    ("--header-timeout", float, "seconds a connection has to send a request's headers, from when it opens or "
                                "its last response ends (default 10)"),
    ("--h11-max-incomplete-event-size", int, "bytes one request's headers (its request line and header lines) may "
                                             "take; past it, or past 64 KiB in one line, the request gets 431 "
                                             "(default 4194304)"),
    ("--h11-max-header-count", int, "header lines one request may send; past it, 431 (default 256)"),
    ("--max-connections", int, "open connections (past it the one idle longest is closed) and requests running "
                               "at once (past it new ones get 503; /health and /metrics are always answered) "
                               "(default 2048)"),
    ("--stall-timeout", float, "seconds the engine may go without finishing a step before /health answers 503 "
                               "(default 60)"),
    ("--watchdog-timeout", float, "seconds the engine may go without finishing a step before the daemon exits 1 "
                                  "for its service manager to restart it (default 300; 0: never)"),
    ("--shutdown-timeout", float, "seconds running requests get to finish after SIGTERM (default 30)"),
    ("--seed", int, "seed of the embedded weights and of unseeded sampling"),
    ("--log-level", str, "debug, info, warning or error"),
    ("--api-server-count", int, "HTTP front-end processes sharing the port and the one engine, so the parsing, "
                                "detokenizing and streaming of many streams use several cores (default 1); "
                                "metrics and stored responses are shared, --max-connections and "
                                "--preprocess-workers are per process"),
    ("--engine-in-process", bool, "run the engine on a thread of the HTTP process instead of its own process "
                                  "(benchmarks, debugging)"),
]


# Flags that take several values: `--served-model-name a b`, "a,b" in the environment, a list in --config.
LIST_FLAGS = frozenset({"served_model_name"})
# Flags that take a JSON object: a mapping in --config is written out as JSON.
JSON_FLAGS = frozenset({"speculative_config", "kv_events_config", "kv_transfer_config", "default_chat_template_kwargs"})


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def serve_settings(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, Any]:
    """Defaults < --config FILE < V4SERVE_* environment < command line."""
    import yaml

    types = {flag[2:].replace("-", "_"): kind for flag, kind, _ in SERVE_FLAGS}
    merged: dict[str, Any] = {}
    if getattr(args, "config", None):
        with open(args.config) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: expected a mapping of flag names to values")
        for key, value in data.items():
            name = str(key).lstrip("-").replace("-", "_")
            if name not in types:
                raise ValueError(f"{args.config}: unknown setting {key!r}")
            if name in LIST_FLAGS and isinstance(value, list):
                value = ",".join(map(str, value))
            elif name in JSON_FLAGS and isinstance(value, dict):
                value = json.dumps(value)
            merged[name] = value
    for name in types:
        env = environ.get("V4SERVE_" + name.upper())
        if env is not None:
            merged[name] = env
    merged.update({k: ",".join(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in types})
    out = {}
    for name, value in merged.items():
        kind = types[name]
        try:
            out[name] = _bool(value) if kind is bool else (None if value is None else kind(value))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--{name.replace('_', '-')}: {exc}") from exc
    return out


def serve_main(args: argparse.Namespace) -> int:
    from v4serve.engine.process.core_client import EngineStartupError
    from v4serve.server.config import check_parallel_flags, launched_rank
    from v4serve.server.serve import EngineFailed, ServeConfig, run

    try:
        cfg = ServeConfig(**serve_settings(args, dict(os.environ)))
        logging.getLogger().setLevel(cfg.log_level.upper())
        launched = launched_rank()
        if launched is not None and launched.rank != 0:  # a torchrun rank: the model shard, no HTTP
            from v4serve.server.model_loading import run_worker_rank

            check_parallel_flags(cfg, launched)
            return run_worker_rank(cfg, launched)
        run(cfg)
    except (ValueError, OSError) as exc:  # a bad setting, found here or by the engine process
        print(f"v4serve serve: {exc}", file=sys.stderr)
        return 2
    except (EngineStartupError, EngineFailed) as exc:
        print(f"v4serve serve: {exc}", file=sys.stderr)
        return 1
    return 0


def plan_main(args: argparse.Namespace) -> int:
    """Exit 0 when the model fits, 1 when it does not, 2 on bad input."""
    from v4serve.engine.model.plan import GIB, PRESETS, PlanSettings, plan_model

    try:
        if args.model not in PRESETS and not Path(args.model).is_dir():  # before asking what memory there is
            raise ValueError(f"--model must be a checkpoint folder or a preset ({', '.join(PRESETS)}); "
                             f"{args.model} is neither")
        memory = int(args.gpu_memory * GIB) if args.gpu_memory is not None else _local_memory(args.device)
        settings = PlanSettings(
            memory_bytes=memory, tensor_parallel_size=args.tensor_parallel_size, expert_parallel=args.expert_parallel,
            device=args.device, weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len, memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            mtp=_speculative_method(args.speculative_config) == "mtp")
        plan = plan_model(args.model, settings)
    except ValueError as exc:  # PlanError, CheckpointError, a bad config.json
        print(f"v4serve plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
    return 0 if plan.fits else 1


def _speculative_method(value: str | None) -> str | None:
    from v4serve.engine.speculative import SpeculativeConfig

    return SpeculativeConfig.parse(value).method if value else None


def _local_memory(device: str) -> int:
    """The default of --gpu-memory: this machine's first GPU's memory, or its own memory for --device
    cpu (as `serve` measures it there)."""
    import torch

    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    raise ValueError("no CUDA device here to measure: give --gpu-memory GiB (per rank; e.g. 80 for an H100, "
                     "141 for an H200)")


def _add_plan_parser(sub: Any) -> None:
    from v4serve.engine.model.plan import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_UTILIZATION

    plan = sub.add_parser("plan", help="weights and KV per rank, and whether a model fits (headers only)")
    plan.add_argument("--model", required=True, help="a checkpoint folder, deepseek-v4-flash or deepseek-v4-pro")
    plan.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (GPUs) the model is split over")
    plan.add_argument("--expert-parallel", action="store_true",
                      help="give each rank whole routed experts instead of a slice of every expert")
    plan.add_argument("--gpu-memory", type=float, default=None,
                      help="GiB of memory per rank (default: this machine's GPU)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_UTILIZATION,
                      help=f"fraction of it the plan may use (default {DEFAULT_UTILIZATION})")
    plan.add_argument("--max-model-len", type=int, default=None,
                      help="tokens of one sequence (default as serve: min(max_position_embeddings, 32768))")
    plan.add_argument("--kv-cache-dtype", default="auto", help="auto (keys in the model dtype) or fp8")
    plan.add_argument("--weight-dtype", default="auto", help="auto, checkpoint, bf16 or fp32")
    plan.add_argument("--device", default="cuda", help="cuda (default) or cpu: what auto dtypes resolve to")
    plan.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                      help="token budget of one step, for the activation reserve")
    plan.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                      help="sequences sampled per step, for the logits in the activation reserve")
    plan.add_argument("--speculative-config", default=None,
                      help='as serve: {"method": "mtp", ...} counts the multi-token-prediction layer in')
    plan.add_argument("--json", action="store_true", help="one JSON object (every figure in bytes) instead of a table")
    plan.set_defaults(func=plan_main)


def config_reference() -> str:
    """The flags of `v4serve serve` as a Markdown table (README's configuration reference is this,
    and a test keeps the two equal): flag, environment variable, default, meaning."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for flag, kind, doc in SERVE_FLAGS:
        name = flag[2:].replace("-", "_")
        rows.append(f"| `{flag}` | `V4SERVE_{name.upper()}` | {shown_default(name, kind, '`')} | "
                    f"{doc.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def shown_default(name: str, kind: Any, quote: str = "") -> str:
    """A serve setting's default as --help and the configuration reference give it: the value, or
    what a default worked out at start comes to."""
    from dataclasses import fields

    from v4serve.server.config import DERIVED_DEFAULTS, ServeConfig

    default = {f.name: f.default for f in fields(ServeConfig)}.get(name)
    if kind is bool:
        return "on" if default else "off"
    if default is None:
        return DERIVED_DEFAULTS.get(name, "none")
    return f"{quote}{default}{quote}"


def config_reference_main(_args: argparse.Namespace) -> int:
    print(config_reference(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="v4serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible daemon", argument_default=argparse.SUPPRESS)
    serve.add_argument("--config", help="YAML file of settings (long flag names as keys; the command line wins)")
    for flag, kind, doc in SERVE_FLAGS:
        name = flag[2:].replace("-", "_")
        described = doc.replace("%", "%%") + f" [default: {shown_default(name, kind)}]".replace("%", "%%")
        if kind is bool:
            serve.add_argument(flag, action="store_true", help=described)
        elif name in LIST_FLAGS:
            serve.add_argument(flag, type=kind, nargs="+", help=described)
        else:
            serve.add_argument(flag, type=kind, help=described)
    serve.set_defaults(func=serve_main)
    reference = sub.add_parser("config-reference", help="print the serve flags as a Markdown table (README's)")
    reference.set_defaults(func=config_reference_main)
    make = sub.add_parser("make-checkpoint", help="write an embedded tiny model as a checkpoint folder")
    make.add_argument("dir", help="output folder")
    make.add_argument("--model", choices=("tiny", "tiny-v41"), default="tiny",
                      help="tiny (DeepSeek-V4, the default) or tiny-v41 (DeepSeek-V4.1)")
    make.add_argument("--seed", type=int, default=0, help="weight seed (default 0, the served tiny model)")
    make.add_argument("--set", type=_parse_override, action="append", metavar="KEY=VALUE",
                      help="override a config field for a sized variant, e.g. --set hidden_size=256 "
                           "--set 'compress_ratios=[0,4,128,4,0]'")
    make.add_argument("--max-shard-bytes", type=int, default=None,
                      help="split the weights into shards of at most this size (with an index)")
    make.add_argument("--quantize", choices=("fp8", "fp4", "mixed"), default=None,
                      help="store weights as the official checkpoints do: fp8 (e4m3, a scale per 128x128 block), "
                           "fp4 (routed experts as e2m1 pairs, a scale per 32) or mixed (FP4 experts, FP8 elsewhere; "
                           "for tiny-v41 the released V4.1 layout, FP8 with 32x32 blocks)")
    make.set_defaults(func=make_checkpoint_main)
    _add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from v4serve.server.config import LOG_FORMAT

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
