"""DeepSeek-V4.1 checkpoint folders. Reading: a folder → `DeepseekV41`, through the same loader as V4
(weights/): the released names are the model's, FP8 weights carry the 32x32 tile config.json declares
(Engram tables one scale per row and 32 columns), routed experts MXFP4; every tensor is checked against
the model from the headers before any data is read, and dequantized to `dtype` as it is read. Writing:
a model as such a folder (make-checkpoint, tests), quantized as the released checkpoint is."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from v4serve.engine.model.v41.config import V41Config
from v4serve.engine.model.v41.model import DeepseekV41
from v4serve.engine.model.weights.files import read_config_json, save_checkpoint_files
from v4serve.engine.model.weights.loader import stream_checkpoint
from v4serve.engine.model.weights.quant import FP4_GROUP, quantize_fp4_packed, quantize_fp8_block

log = logging.getLogger(__name__)

FP8_TILE = (32, 32)  # the released checkpoint's FP8 scale blocks
# What the released checkpoint stores in FP8 with 32x32 tiles, and in MXFP4 (the routed experts); its
# Engram tables are FP8 with one scale per row and 32 columns.
_FP8_NAMES = re.compile(r"\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                        r"|engram\.wkv)\.weight$")
_ROUTED_NAMES = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_ENGRAM_TABLES = re.compile(r"\.engram\.embed\.weight$")
# What a released V4.1 checkpoint holds that the text model does not load.
_VISION = "the vision tower and aligner (images are not served yet)"
NOT_LOADED = {"vision.": _VISION, "aligner.": _VISION, "image_": _VISION,
              "mtp.": "the DSpark draft (speculative decoding with DSpark is not served yet)"}


def write_checkpoint(model: DeepseekV41, folder: str | Path, quantize: bool = True,
                     max_shard_bytes: int | None = None) -> Path:
    """config.json and the weights under the released names; `quantize`: in the released formats (the rest,
    and everything without it, in the model's dtype)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = model.cfg.to_official_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().contiguous().cpu()
        scale = name.removesuffix(".weight") + ".scale"
        e8m0 = torch.float8_e8m0fnu
        if quantize and _ROUTED_NAMES.search(name):
            tensors[name], tensors[scale] = quantize_fp4_packed(tensor, scale_dtype=e8m0)
        elif quantize and (_FP8_NAMES.search(name) or _ENGRAM_TABLES.search(name)):
            tile = (1, FP4_GROUP) if _ENGRAM_TABLES.search(name) else FP8_TILE
            tensors[name], tensors[scale] = quantize_fp8_block(tensor, tile, scale_dtype=e8m0)
        else:
            tensors[name] = tensor
    if quantize:
        raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "scale_fmt": "ue8m0", "weight_block_size": list(FP8_TILE)}
    return save_checkpoint_files(folder, raw, tensors, max_shard_bytes)


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
        for name, tensor in stream_checkpoint(folder, expected, dtype=dtype, progress=progress, skip=NOT_LOADED):
            targets[name].copy_(tensor)
    log.info("loaded %s: DeepSeek-V4.1, %d layers", folder, cfg.num_layers)
    return model.eval()
