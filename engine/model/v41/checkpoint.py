"""A DeepSeek-V4.1 checkpoint folder → `DeepseekV41`, through the same loader as V4 (weights/): the
released names are the model's, FP8 weights carry the 32x32 tile config.json declares (Engram tables
one scale per row and 32 columns), routed experts MXFP4; every tensor is checked against the model
from the headers before any data is read, and dequantized to `dtype` as it is read."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from v4serve.engine.model.v41.config import V41Config
from v4serve.engine.model.v41.model import DeepseekV41
from v4serve.engine.model.weights.files import read_config_json
from v4serve.engine.model.weights.loader import stream_checkpoint

log = logging.getLogger(__name__)


def load_model(folder: str | Path, token_map: list[int] | None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, progress: bool = True) -> DeepseekV41:
    """`token_map`: the tokenizer's Engram map (the front end builds it: `server.text.engram_map`)."""
    cfg = V41Config.from_dict(read_config_json(folder))
    with torch.device("meta"):
        model = DeepseekV41(cfg, token_map).to(dtype)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in stream_checkpoint(folder, expected, dtype=dtype, progress=progress):
            targets[name].copy_(tensor)
    log.info("loaded %s: DeepSeek-V4.1, %d layers", folder, cfg.num_layers)
    return model.eval()
