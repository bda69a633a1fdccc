"""Build and run the daemon from one frozen config."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import uvicorn

from v4serve.cache.layout import check_kv_cache_dtype
from v4serve.engine.async_engine import AsyncEngine
from v4serve.engine.engine import EngineConfig, LLMEngine
from v4serve.engine.model.checkpoint import load_model
from v4serve.engine.model.fingerprint import checkpoint_digest
from v4serve.engine.model.model import DeepseekV4
from v4serve.engine.model.packed import packed_count, resident_bytes
from v4serve.engine.model.plan import PlanSettings, plan_checkpoint
from v4serve.engine.model.resident import check_weight_dtype, resolve_weight_dtype
from v4serve.engine.model.tiny import build_tiny
from v4serve.kernels.registry import load_kernels, resolve_backend
from v4serve.server.app import VERSION, build_app
from v4serve.server.generation import DEFAULT_MAX_REQUEST_BYTES, ServerConfig
from v4serve.server.metrics import Metrics
from v4serve.server.text.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger("v4serve")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class ServeConfig:
    model: str = "tiny"
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    weight_dtype: str = "auto"
    batch_invariant: bool = False
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    num_blocks: int | None = None
    no_prefix_caching: bool = False
    kv_store_dir: str | None = None
    kv_store_max_bytes: int | None = None
    no_kv_store: bool = False
    swa_cache_mode: str = "periodic"
    swa_checkpoint_interval: int | None = None
    api_key: str | None = None
    protect_metrics: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout: float = 30.0
    seed: int = 0
    log_level: str = "info"

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no CUDA device is available")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        check_weight_dtype(self.weight_dtype)
        if self.weight_dtype in ("bf16", "fp32"):
            # Dequantized weights are the model's parameters: they are in the compute dtype.
            wanted = DTYPES[self.weight_dtype]
            if self.dtype not in ("auto", *[k for k, v in DTYPES.items() if v == wanted]):
                raise ValueError(f"--weight-dtype {self.weight_dtype} dequantizes the weights to {self.weight_dtype}, "
                                 f"which is also the compute dtype; it contradicts --dtype {self.dtype}")
            return wanted
        if self.dtype == "auto":
            # CPUs without bf16 units run bf16 matmuls far slower than fp32.
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return "v4serve-tiny" if self.model == "tiny" else Path(self.model).name


DEFAULT_STORE_BYTES = 32 << 30


def default_store_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "v4serve", "kv-store")


def load(cfg: ServeConfig) -> tuple[DeepseekV4, Tokenizer]:
    device = cfg.resolved_device()
    dtype = cfg.resolved_dtype(device)
    check_kv_cache_dtype(cfg.kv_cache_dtype)  # before minutes of loading
    backend = resolve_backend(cfg.attention_backend, device)
    kernels = load_kernels(backend, device, batch_invariant=cfg.batch_invariant)  # checked before loading
    if cfg.model == "tiny":
        model, tokenizer = build_tiny(seed=cfg.seed).to(device=device, dtype=dtype), ByteTokenizer()
    else:
        folder = Path(cfg.model)
        if not folder.is_dir():
            raise ValueError(f"--model must be 'tiny' or a checkpoint folder; {folder} is not a folder")
        check_capacity(cfg, folder, device, dtype)  # from headers, before any tensor data is read
        # auto = checkpoint precision: FP8/FP4 weights stay packed (Triton kernels on a GPU, their
        # torch twins elsewhere); bf16/fp32 dequantize them at load.
        packed = resolve_weight_dtype(cfg.weight_dtype, device.type) == "checkpoint"
        model, tokenizer = load_model(folder, device=device, dtype=dtype, packed=packed), load_tokenizer(folder)
    model.use_kernels(kernels)
    return model, tokenizer


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
        # Set by the parallelism and weight-dtype flags where this serve has them; one rank and auto otherwise.
        tensor_parallel_size=getattr(cfg, "tensor_parallel_size", None) or 1,
        expert_parallel=bool(getattr(cfg, "expert_parallel", False)),
        weight_dtype=cfg.weight_dtype, kv_cache_dtype=cfg.kv_cache_dtype,
        max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs)
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


def version_info(model: DeepseekV4, econf: EngineConfig) -> dict[str, str | bool]:
    param = next(model.parameters())
    kv_cache_dtype = "fp8_e4m3" if econf.kv_cache_dtype == "fp8" else str(econf.kv_dtype).removeprefix("torch.")
    return {"version": VERSION, "device": str(param.device), "dtype": str(param.dtype).removeprefix("torch."),
            "attention_backend": model.kernels.backend, "batch_invariant": model.kernels.batch_invariant,
            "kv_cache_dtype": kv_cache_dtype,
            "weight_dtype": "checkpoint" if packed_count(model) else str(param.dtype).removeprefix("torch.")}


def engine_config(cfg: ServeConfig, model: DeepseekV4, tokenizer: Tokenizer) -> EngineConfig:
    block = model.cfg.block_size
    max_len = cfg.max_model_len or min(model.cfg.max_position_embeddings, 32768)
    interval = cfg.swa_checkpoint_interval or max(block, (4096 // block) * block)
    store_dir = None if cfg.no_kv_store or cfg.no_prefix_caching else (cfg.kv_store_dir or default_store_dir())
    digest = None
    if store_dir is not None and cfg.model != "tiny":  # the files' bytes, cached beside the store
        digest = checkpoint_digest(cfg.model, Path(store_dir) / "weights-digests.json")
    return EngineConfig(kv_store_dir=store_dir, kv_store_max_bytes=cfg.kv_store_max_bytes or DEFAULT_STORE_BYTES,
                        weights_digest=digest, tokenizer_json=tokenizer.vocabulary_json(),
                        max_model_len=max_len, max_num_seqs=cfg.max_num_seqs, num_blocks=cfg.num_blocks,
                        max_num_batched_tokens=cfg.max_num_batched_tokens, max_waiting=cfg.max_waiting,
                        enable_prefix_caching=not cfg.no_prefix_caching, swa_cache_mode=cfg.swa_cache_mode,
                        swa_checkpoint_interval=interval, kv_dtype=next(model.parameters()).dtype,
                        kv_cache_dtype=cfg.kv_cache_dtype, seed=cfg.seed)


def build(cfg: ServeConfig):  # -> (FastAPI, AsyncEngine)
    model, tokenizer = load(cfg)
    econf = engine_config(cfg, model, tokenizer)
    engine = LLMEngine(model, econf, eos_token_id=tokenizer.eos_token_id)
    async_engine = AsyncEngine(engine)
    metrics = Metrics(cfg.model_name, lambda: async_engine.stats,
                      store_capacity_bytes=econf.kv_store_max_bytes if econf.kv_store_dir else 0,
                      healthy=lambda: async_engine.unavailable_reason() is None)
    server = ServerConfig(cfg.model_name, econf.max_model_len, api_key=cfg.api_key,
                          protect_metrics=cfg.protect_metrics, max_request_bytes=cfg.max_request_bytes,
                          version_info=version_info(model, econf))
    app = build_app(async_engine, tokenizer, server, metrics)

    device = next(model.parameters()).device
    log.info("model %s (%s): %d layers, %.1f MB of weights (%d in checkpoint precision), %s on %s, %s kernels%s",
             cfg.model_name, cfg.model, model.cfg.num_layers, resident_bytes(model) / 1e6, packed_count(model),
             str(next(model.parameters()).dtype).removeprefix("torch."), device, model.kernels.backend,
             " (batch-invariant)" if model.kernels.batch_invariant else "")
    log.info("prefix caching %s, SWA cache mode %s (snapshot every %d tokens), max model len %d",
             "on" if econf.enable_prefix_caching else "off", econf.swa_cache_mode, econf.swa_checkpoint_interval,
             econf.max_model_len)
    log.info("SSD prefix store: %s", f"{econf.kv_store_dir} (at most {econf.kv_store_max_bytes / 2**30:.1f} GiB)"
             if econf.kv_store_dir else "off")
    return app, async_engine


# Seconds uvicorn waits beyond --shutdown-timeout: time for the streams ended then to send their last
# events before it cuts what is left.
_SHUTDOWN_MARGIN = 5.0


class GracefulServer(uvicorn.Server):
    """On SIGTERM (or Ctrl-C): uvicorn stops accepting connections; running requests get
    `shutdown_timeout` seconds to finish, then the engine ends the rest with an error, so every
    stream still closes with an error event and [DONE]; queued SSD-store writes are flushed at exit."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("shutting down: running requests have %.0f s to finish", self.shutdown_timeout)
            self.engine.begin_shutdown(self.shutdown_timeout)
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once shut down, which would end the process with it: a
        # completed graceful shutdown exits 0 instead (what Docker and Kubernetes expect).
        self._captured_signals.clear()


def run(cfg: ServeConfig) -> None:
    app, engine = build(cfg)
    shown = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    log.info("serving %s at http://%s:%d/v1 (OpenAI-compatible; /health, /metrics)", cfg.model_name, shown, cfg.port)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            timeout_graceful_shutdown=cfg.shutdown_timeout + _SHUTDOWN_MARGIN)
    GracefulServer(config, engine, cfg.shutdown_timeout).run()
