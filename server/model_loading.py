"""The engine from the serve config: the model (or a capacity plan refusing it), the engine config,
and what /version reports. Runs where the engine runs: in the engine-core process, or in the HTTP
process under --engine-in-process."""

from __future__ import annotations

import functools
import importlib
import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from v4serve.cache.layout import check_kv_cache_dtype
from v4serve.engine.engine import EngineConfig, LLMEngine
from v4serve.engine.model.parallel.sharding import ParallelConfig, default_threads
from v4serve.engine.model.plan import PlanSettings, plan_checkpoint
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.v41 import checkpoint as v41_checkpoint
from v4serve.engine.model.v41.config import is_v41
from v4serve.engine.model.v41.model import DeepseekV41
from v4serve.engine.model.v41.tiny import build_tiny_v41
from v4serve.engine.model.weights.checkpoint import load_model, write_checkpoint
from v4serve.engine.model.weights.files import read_config_json
from v4serve.engine.model.weights.fingerprint import checkpoint_digest, tensors_digest
from v4serve.engine.model.weights.packed import packed_count, resident_bytes
from v4serve.engine.model.weights.resident import resolve_weight_dtype
from v4serve.engine.process.rank_group import STEP_TIMEOUT, RankGroup, local_device, worker_loop
from v4serve.kernels.registry import load_kernels, resolve_backend
from v4serve.server.config import (
    DEFAULT_STORE_BYTES,
    LaunchedRank,
    ServeConfig,
    default_store_dir,
    is_embedded,
    launched_rank,
)
from v4serve.server.text.engram_map import folded_token_ids, folded_vocabulary
from v4serve.server.text.tokenizer import ByteTokenizer

log = logging.getLogger("v4serve")

Model = DeepseekV4 | DeepseekV41


def is_v41_model(model: str) -> bool:
    """`tiny-v41`, or a checkpoint folder whose config.json is DeepSeek-V4.1's."""
    if model == "tiny-v41":
        return True
    folder = Path(model)
    return not is_embedded(model) and (folder / "config.json").is_file() and is_v41(read_config_json(folder))


def load_v41(cfg: ServeConfig, device: torch.device, dtype: torch.dtype) -> DeepseekV41:
    """A V4.1 model: the embedded `tiny-v41`, or a checkpoint folder (its tokenizer's Engram map built
    here, on the text side: the model gets ids)."""
    if cfg.model == "tiny-v41":
        token_map = folded_vocabulary(ByteTokenizer().vocabulary_json())
        return build_tiny_v41(token_map, seed=cfg.seed).to(device=device, dtype=dtype)
    folder = Path(cfg.model)
    if resolve_weight_dtype(cfg.weight_dtype, device.type) == "checkpoint":
        log.info("DeepSeek-V4.1: weights dequantized to %s at load (packed V4.1 weights are not kept yet)",
                 str(dtype).removeprefix("torch."))
    return v41_checkpoint.load_model(folder, folded_token_ids(folder / "tokenizer.json"), device=device, dtype=dtype)


def load(cfg: ServeConfig, parallel: ParallelConfig | None = None, local_rank: int = 0) -> Model:
    """The model (under parallelism: the shard of `parallel.rank`, on GPU `local_rank` of this node),
    its kernels chosen."""
    device = cfg.resolved_device()
    if parallel is not None:
        device = local_device(device, local_rank)
    dtype = cfg.resolved_dtype(device)
    check_kv_cache_dtype(cfg.kv_cache_dtype)  # before minutes of loading
    backend = resolve_backend(cfg.attention_backend, device)
    kernels = load_kernels(backend, device, batch_invariant=cfg.batch_invariant)  # checked before loading
    mtp = cfg.speculative is not None and cfg.speculative.method == "mtp"
    model: Model
    if is_v41_model(cfg.model):
        model = load_v41(cfg, device, dtype)
    elif cfg.model == "tiny":  # with its random MTP layer when drafts come from it
        model = build_tiny(tiny_config(num_nextn_predict_layers=1) if mtp else None, cfg.seed).to(device=device,
                                                                                                  dtype=dtype)
    else:
        folder = Path(cfg.model)
        if not folder.is_dir():
            raise ValueError(f"--model must be 'tiny', 'tiny-v41' or a checkpoint folder; {folder} is not a folder")
        # auto = checkpoint precision: FP8/FP4 weights stay packed (Triton kernels on a GPU, their
        # torch twins elsewhere); bf16/fp32 dequantize them at load.
        packed = resolve_weight_dtype(cfg.weight_dtype, device.type) == "checkpoint"
        model = load_model(folder, device=device, dtype=dtype, packed=packed, parallel=parallel,
                           progress=parallel is None or parallel.rank == 0, mtp=mtp)
    model.use_kernels(kernels)
    return model


def load_ranks(cfg: ServeConfig) -> tuple[Model, RankGroup | None, bytes | None]:
    """Rank 0's model, the other ranks (None for one), and the weights digest when it is known here.
    Under parallelism every rank loads only its shard of a checkpoint folder; the embedded tiny
    model is first written to one (removed at exit) so it can be split the same way."""
    device = cfg.resolved_device()
    if is_v41_model(cfg.model):
        if cfg.tensor_parallel_size != 1:
            raise ValueError("DeepSeek-V4.1 runs on one rank for now: --tensor-parallel-size 1")
        if cfg.model != "tiny-v41":
            log.info("capacity plan: not available for DeepSeek-V4.1 checkpoints yet; loading %s", cfg.model)
        return load(cfg), None, None
    if cfg.model != "tiny":
        check_capacity(cfg, Path(cfg.model), device, cfg.resolved_dtype(device))  # headers only, before any data
    if cfg.tensor_parallel_size == 1:
        return load(cfg), None, None
    if cfg.model != "tiny":
        return (*_start_ranks(cfg, device), None)
    tiny = build_tiny(seed=cfg.seed)
    with tempfile.TemporaryDirectory(prefix="v4serve-tiny-") as folder:  # needed only while the ranks load
        write_checkpoint(tiny, folder)
        model, group = _start_ranks(replace(cfg, model=folder), device)
    return model, group, tensors_digest(tiny.state_dict().items())


def _start_ranks(cfg: ServeConfig, device: torch.device) -> tuple[DeepseekV4, RankGroup]:
    parallel = ParallelConfig(cfg.tensor_parallel_size, cfg.expert_parallel, rank=0)
    shard = functools.partial(load, cfg)
    launched = launched_rank()
    if launched is not None and launched.world_size > 1:
        group, model = RankGroup.join_from_env(parallel, shard, device)
    else:
        group, model = RankGroup.spawn(parallel, shard, device)
    return model, group


def run_worker_rank(cfg: ServeConfig, launched: LaunchedRank) -> int:
    """A rank other than 0 of a group torchrun started: no HTTP, only the model shard and the steps
    rank 0 sends. Returns the exit status."""
    import torch.distributed as dist

    from v4serve.engine.process.lifecycle import setup_subordinate

    setup_subordinate(f"v4serve-rank{launched.rank}")  # rank 0 stops gracefully, then tells the others
    if cfg.model == "tiny":
        raise ValueError("torchrun ranks load their shard from a checkpoint folder: give --model a folder "
                         "(v4serve make-checkpoint writes the tiny model to one)")
    parallel = ParallelConfig(cfg.tensor_parallel_size, cfg.expert_parallel, launched.rank)
    device = local_device(cfg.resolved_device(), launched.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(default_threads(launched.world_size))  # ranks sharing a node share its cores
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=launched.rank,
                            world_size=launched.world_size, timeout=STEP_TIMEOUT)
    return worker_loop(parallel, functools.partial(load, cfg), launched.local_rank)


def check_capacity(cfg: ServeConfig, folder: Path, device: torch.device, dtype: torch.dtype) -> None:
    """The capacity plan of a checkpoint folder on this device (engine/model/plan.py), logged; a
    ValueError carrying its table when not even one sequence of --max-model-len fits, so a model too
    big fails in seconds instead of running out of memory minutes into the load."""
    memory = device_memory_bytes(device)
    if memory is None:
        log.info("capacity plan skipped: cannot tell how much memory %s has free", device)
        return
    settings = PlanSettings(
        memory_bytes=memory, device=device.type, compute_dtype=str(dtype).removeprefix("torch."),
        tensor_parallel_size=cfg.tensor_parallel_size, expert_parallel=cfg.expert_parallel,
        weight_dtype=cfg.weight_dtype, kv_cache_dtype=cfg.kv_cache_dtype,
        max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs, mtp=cfg.speculative is not None and cfg.speculative.method == "mtp")
    plan = plan_checkpoint(folder, settings)
    if not plan.fits:
        raise ValueError(f"{folder} does not fit in the free memory of {device}; nothing was loaded.\n{plan.table()}")
    log.info("%s", plan.table())
    if cfg.max_num_seqs > plan.max_concurrent_sequences:
        log.warning("--max-num-seqs %d: only %d sequences of %d tokens fit beside the weights; lower --max-num-seqs "
                    "or --max-model-len", cfg.max_num_seqs, plan.max_concurrent_sequences, plan.max_model_len)


def device_memory_bytes(device: torch.device) -> int | None:
    """Memory free for the model: what CUDA reports free on the device, or MemAvailable on a CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:  # not Linux
        return None
    kib = next((line.split()[1] for line in lines if line.startswith("MemAvailable:")), None)
    return int(kib) * 1024 if kib is not None else None


def version_info(model: Model, econf: EngineConfig) -> dict[str, str | bool | int]:
    param = next(model.parameters())
    parallel = model.parallel
    kv_cache_dtype = "fp8_e4m3" if econf.kv_cache_dtype == "fp8" else str(econf.kv_dtype).removeprefix("torch.")
    kernels = model.kernels
    assert kernels is not None  # `load` chose them
    return {"device": str(param.device), "dtype": str(param.dtype).removeprefix("torch."),
            "model_family": model.family,
            "attention_backend": kernels.backend,
            "batch_invariant": kernels.batch_invariant,
            "kv_cache_dtype": kv_cache_dtype,
            "weight_dtype": "checkpoint" if packed_count(model) else str(param.dtype).removeprefix("torch."),
            "tensor_parallel_size": parallel.size if parallel is not None else 1,
            "expert_parallel": parallel is not None and parallel.splits_experts,
            "speculative": econf.speculative.describe() if econf.speculative is not None else "off"}


def engine_config(cfg: ServeConfig, model: Model, tokenizer_json: str | None,
                  barred_token_ids: tuple[int, ...] = ()) -> EngineConfig:
    block = model.cfg.block_size
    max_len = cfg.max_model_len or min(model.cfg.max_position_embeddings, 32768)
    interval = cfg.swa_checkpoint_interval or max(block, (4096 // block) * block)
    store_dir = None if cfg.no_kv_store or cfg.no_prefix_caching else (cfg.kv_store_dir or default_store_dir())
    digest = None
    if store_dir is not None and not is_embedded(cfg.model):  # the files' bytes, cached beside the store
        digest = checkpoint_digest(cfg.model, Path(store_dir) / "weights-digests.json")
    return EngineConfig(kv_store_dir=store_dir, kv_store_max_bytes=cfg.kv_store_max_bytes or DEFAULT_STORE_BYTES,
                        weights_digest=digest, tokenizer_json=tokenizer_json, barred_token_ids=barred_token_ids,
                        max_model_len=max_len, max_num_seqs=cfg.max_num_seqs, num_blocks=cfg.num_blocks,
                        max_num_batched_tokens=cfg.max_num_batched_tokens, max_waiting=cfg.max_waiting,
                        enable_prefix_caching=not cfg.no_prefix_caching, swa_cache_mode=cfg.swa_cache_mode,
                        swa_checkpoint_interval=interval, kv_dtype=next(model.parameters()).dtype,
                        kv_cache_dtype=cfg.kv_cache_dtype, seed=cfg.seed, enforce_eager=cfg.enforce_eager,
                        async_scheduling=cfg.async_scheduling,
                        grammar_cache_bytes=cfg.grammar_cache_bytes, speculative=cfg.speculative,
                        kv_events=cfg.kv_events, kv_transfer=cfg.kv_transfer)


def _engine(cfg: ServeConfig, model: Model, ranks: RankGroup | None, digest: bytes | None,
            tokenizer_json: str | None, eos_token_id: int, barred_token_ids: tuple[int, ...]
            ) -> tuple[LLMEngine, EngineConfig]:
    econf = engine_config(cfg, model, tokenizer_json, barred_token_ids)
    if digest is not None and econf.kv_store_dir is not None:
        econf = replace(econf, weights_digest=digest)  # rank 0 holds a shard: its tensors are not the model's
    engine = LLMEngine(model, econf, eos_token_id=eos_token_id, ranks=ranks)
    if cfg.engine_hook:
        module, _, name = cfg.engine_hook.partition(":")
        getattr(importlib.import_module(module), name)(engine)
    return engine, econf


def build_engine(cfg: ServeConfig, tokenizer_json: str | None, eos_token_id: int,
                 barred_token_ids: tuple[int, ...] = ()) -> tuple[LLMEngine, dict[str, Any]]:
    """The engine, and what the front end needs to know of it: /version's fields and max_model_len.
    `barred_token_ids`: never sampled (the tokenizer's input-only specials)."""
    model, ranks, digest = load_ranks(cfg)
    try:
        engine, econf = _engine(cfg, model, ranks, digest, tokenizer_json, eos_token_id, barred_token_ids)
    except BaseException:
        if ranks is not None:  # they wait for rank 0's first message; nothing else would end them
            ranks.kill()
        raise
    device = next(model.parameters()).device
    split = (f", split over {cfg.tensor_parallel_size} ranks{' (experts whole)' if cfg.expert_parallel else ''}"
             if ranks is not None else "")
    kernels = model.kernels
    assert kernels is not None
    log.info("model %s (%s, DeepSeek-%s): %d layers, %.1f MB of weights%s (%d in checkpoint precision), %s on %s, "
             "%s kernels%s", cfg.model_name, cfg.model, model.family.upper(), model.cfg.num_layers,
             resident_bytes(model) / 1e6, " on rank 0" if ranks is not None else "", packed_count(model),
             str(next(model.parameters()).dtype).removeprefix("torch."), device,
             kernels.backend, (" (batch-invariant)" if kernels.batch_invariant else "") + split)
    log.info("prefix caching %s, SWA cache mode %s (%s), max model len %d",
             "on" if econf.enable_prefix_caching else "off", econf.swa_cache_mode,
             swa_mode_words(econf.swa_cache_mode, econf.swa_checkpoint_interval), econf.max_model_len)
    if is_embedded(cfg.model):
        log.info("the embedded %s model has random weights: its text is noise, but every code path of a real "
                 "DeepSeek-%s checkpoint runs (serve one with --model FOLDER)", cfg.model, model.family.upper())
    log.info("speculative decoding: %s", econf.speculative.describe() if econf.speculative else "off")
    log.info("SSD prefix store: %s", f"{econf.kv_store_dir} (at most {econf.kv_store_max_bytes / 2**30:.1f} GiB)"
             if econf.kv_store_dir else "off")
    return engine, {"version_info": {**version_info(model, econf), "cuda_graphs": engine.cuda_graphs,
                                     "async_scheduling": engine.async_scheduling},
                    "max_model_len": econf.max_model_len,
                    # vllm:cache_config_info's labels, as vLLM names them
                    "cache_info": {"block_size": engine.cache_config.block_size,
                                   "num_gpu_blocks": engine.cache_config.num_blocks,
                                   "enable_prefix_caching": econf.enable_prefix_caching}}


def swa_mode_words(mode: str, interval: int) -> str:
    """What an SWA cache mode keeps, as the startup log says it."""
    return {"full": "window state snapshotted at every block: a hit never recomputes",
            "periodic": f"window state snapshotted every {interval} tokens and at prompt and response ends",
            "zero": "no window snapshots: a hit recomputes the window",
            "auto": f"no window snapshots until a prefix is hit; then every {interval} tokens, at prompt and "
                    "response ends and at the hit's boundary"}.get(mode, mode)
