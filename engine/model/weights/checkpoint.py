"""Checkpoint folders: write a model's weights and config.json as a real checkpoint (optionally
quantized as the official checkpoints are), build a model from one. (Tokenizer files are the front
end's: `v4serve make-checkpoint` adds them.)"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from v4serve.engine.model.config import ModelConfig
from v4serve.engine.model.parallel.sharding import ParallelConfig, RankShard, local
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.model.weights.files import read_config_json, save_checkpoint_files
from v4serve.engine.model.weights.layout import packed_formats
from v4serve.engine.model.weights.loader import stream_checkpoint
from v4serve.engine.model.weights.packed import pack_model, packed_count, resident_bytes
from v4serve.engine.model.weights.quant import quantize_fp4_packed, quantize_fp8_block

QUANTIZE_MODES = ("fp8", "fp4", "mixed")

# What the official checkpoints store in FP8 (e4m3, an e8m0 scale per 128×128 block): the attention's
# projections but the compressors' and the indexer's head weights, the shared expert, and a
# multi-token-prediction layer's input projections. Routed experts are FP4 (e2m1 pairs, an e8m0 scale
# per 32) in `mixed`, the official layout.
_FP8_NAMES = re.compile(r"\.attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$"
                        r"|\.ffn\.shared_experts\.w[123]\.weight$|^mtp\.\d+\.[eh]_proj\.weight$")
_ROUTED_NAMES = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")

log = logging.getLogger(__name__)


def write_checkpoint(model: DeepseekV4, folder: str | Path, max_shard_bytes: int | None = None,
                     transformers_config: bool = False, quantize: str | None = None) -> Path:
    """config.json + safetensors (official names; sharded with an index past `max_shard_bytes`);
    `quantize` (fp8, fp4 or mixed) stores weights as `quantize_checkpoint_state` does."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    raw = cfg.to_transformers_dict() if transformers_config else cfg.to_official_dict()
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    if quantize is not None:
        tensors = quantize_checkpoint_state(tensors, quantize)
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "weight_block_size": [128, 128],
                                      **({"expert_dtype": "fp4"} if quantize != "fp8" else {})}
    return save_checkpoint_files(folder, raw, tensors, max_shard_bytes)


def quantize_checkpoint_state(state: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """Weights in the official quantized layout, each with its `.scale` (e8m0): `fp8` puts every
    weight the official checkpoints store in FP8, routed experts included, in FP8; `fp4` only the
    routed experts, in FP4; `mixed` both, as the released checkpoints (FP4 experts, FP8 elsewhere)."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        fmt = _quantized_format(name, mode)
        if fmt is None:
            out[name] = tensor
            continue
        quantize = quantize_fp8_block if fmt == "fp8" else quantize_fp4_packed
        out[name], out[name.removesuffix(".weight") + ".scale"] = quantize(tensor, scale_dtype=torch.float8_e8m0fnu)
    return out


def _quantized_format(name: str, mode: str) -> str | None:
    if _ROUTED_NAMES.search(name):
        return "fp8" if mode == "fp8" else "fp4"
    if _FP8_NAMES.search(name) and mode != "fp4":
        return "fp8"
    return None


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               progress: bool = True, packed: bool = False, parallel: ParallelConfig | None = None,
               mtp: bool = False) -> DeepseekV4:
    """Build the model a checkpoint folder describes and load its weights, each tensor put on `device`
    as it is read. `packed`: FP8/FP4 weights whose layers can compute from them stay in checkpoint
    precision (`--weight-dtype checkpoint`); the rest, and everything when not `packed`, is
    dequantized to `dtype`. `parallel`: build and read only that rank's shard (engine/model/parallel/sharding.py);
    the process group is needed only to run it, not to load it. `mtp`: also the first
    multi-token-prediction layer (speculative decoding)."""
    cfg = ModelConfig.from_dict(read_config_json(folder))
    if mtp and not cfg.num_nextn_predict_layers:
        raise ValueError(f"{folder} has no multi-token-prediction layer (its config.json says "
                         "num_nextn_predict_layers 0): speculative method 'mtp' needs one; use method 'ngram'")
    formats = packed_formats(folder, mtp) if packed else {}
    parallel = local(parallel)
    sharding = RankShard(cfg, parallel) if parallel is not None else None
    with torch.device("meta"):
        # Packed buffers are bytes: the cast leaves them alone.
        model = DeepseekV4(cfg, parallel, mtp_layers=int(mtp)).in_dtype(dtype)
        pack_model(model, formats)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    # Not `to_empty`: its `empty_like` of a meta tensor runs torch's Python reference and imports
    # sympy (~1 s of CPU at every engine and rank start); an `empty` of the same shape does not.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    # Views of the model's own storage (stacked experts included): each tensor is copied straight in.
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in stream_checkpoint(folder, expected, dtype=dtype, progress=progress, packed=formats,
                                               sharding=sharding):
            targets[name].copy_(tensor)
    # Counted as the startup line counts them: a stacked expert tensor is one weight (the files hold
    # one tensor per expert).
    log.info("loaded %s: %d layers, %.1f MB resident (%d weights in checkpoint precision, from %d packed tensors "
             "in the files)", folder, cfg.num_layers, resident_bytes(model) / 1e6, packed_count(model), len(formats))
    return model.eval()
