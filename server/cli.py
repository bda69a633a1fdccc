"""`v4serve` command line: `serve` starts the daemon, `make-checkpoint` writes the tiny model."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
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
    from engine.checkpoint import write_checkpoint
    from engine.tiny import build_tiny, tiny_config

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
    folder = write_checkpoint(model, args.dir, max_shard_bytes=args.max_shard_bytes)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {folder} ({params / 1e6:.2f}M parameters, {cfg.num_layers} layers, "
          f"block size {cfg.block_size})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="v4serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-checkpoint", help="write the embedded tiny model as a checkpoint folder")
    make.add_argument("dir", help="output folder")
    make.add_argument("--seed", type=int, default=0, help="weight seed (default 0, the served tiny model)")
    make.add_argument("--set", type=_parse_override, action="append", metavar="KEY=VALUE",
                      help="override a config field for a sized variant, e.g. --set hidden_size=256 "
                           "--set 'compress_ratios=[0,4,128,4,0]'")
    make.add_argument("--max-shard-bytes", type=int, default=None,
                      help="split the weights into shards of at most this size (with an index)")
    make.set_defaults(func=make_checkpoint_main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
