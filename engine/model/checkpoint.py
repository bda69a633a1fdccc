"""Checkpoint folders: write a model's weights and config.json as a real checkpoint, build a model
from one. (Tokenizer files are the front end's: `v4serve make-checkpoint` adds them.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from v4serve.engine.model.config import ModelConfig
from v4serve.engine.model.loader import load_checkpoint, read_config_json
from v4serve.engine.model.model import DeepseekV4

log = logging.getLogger(__name__)


def write_checkpoint(model: DeepseekV4, folder: str | Path, max_shard_bytes: int | None = None,
                     transformers_config: bool = False) -> Path:
    """config.json + safetensors (official names; sharded with an index past `max_shard_bytes`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    raw = cfg.to_transformers_dict() if transformers_config else cfg.to_official_dict()
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, folder / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


def _shard(tensors: dict[str, torch.Tensor], limit: int | None) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if limit and shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def load_model(folder: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, progress: bool = True) -> DeepseekV4:
    """Build the model a checkpoint folder describes and load its weights."""
    cfg = ModelConfig.from_dict(read_config_json(folder))
    with torch.device("meta"):
        model = DeepseekV4(cfg)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    tensors = load_checkpoint(folder, expected, dtype=dtype, progress=progress)
    model = model.to_empty(device=device)
    model.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=True)
    log.info("loaded %s: %d layers, %.1fM parameters", folder, cfg.num_layers,
             sum(p.numel() for p in model.parameters()) / 1e6)
    return model.eval()

