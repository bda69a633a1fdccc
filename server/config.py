"""The daemon's frozen configuration (every `v4serve serve` flag), shared by the front end and the
engine-core process it starts. Light on purpose: torch is imported only where a device or dtype is
resolved, which happens in the engine process."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from v4serve.cache.kv_events import KVEventsConfig
    from v4serve.cache.kv_transfer import KVTransferConfig
    from v4serve.engine.speculative import SpeculativeConfig
    from v4serve.server.tenants import ApiKeys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
# Logprob entries (a chosen token's or one of its alternatives') one request may return: ~40 MB of JSON.
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 20
# Output a stream's client may leave unread before its request ends (tokens; logprob entries count too).
DEFAULT_MAX_UNREAD_TOKENS = 65536
# Seconds a stream's requests may be held (their client reading nothing) before they end.
DEFAULT_UNREAD_TIMEOUT = 60.0
DEFAULT_STORE_BYTES = 32 << 30

# Models built in, with random weights and the byte tokenizer: DeepSeek-V4's and DeepSeek-V4.1's.
EMBEDDED_MODELS = ("tiny", "tiny-v41")


def is_embedded(model: str) -> bool:
    return model in EMBEDDED_MODELS
# Tokens one request may cost by default, in max-model-lens: a chat request's n choices at full length
# always fit (prompt + n × completion ≤ 16 contexts for n ≤ 16); many long prompts × n need max_tokens.
REQUEST_TOKENS_PER_CONTEXT = 16

# --dtype names → torch dtype names.
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


# Settings whose default is worked out at start (None in ServeConfig): what it comes to, in words.
# `--help`, `v4serve config-reference` (README's table) and configs/serve.example.yaml say these.
DERIVED_DEFAULTS = {
    "served_model_name": "v4serve-tiny, or the checkpoint folder's name",
    "max_model_len": "min(the model's max_position_embeddings, 32768)",
    "num_blocks": "every slot can hold max-model-len tokens",
    "kv_store_dir": "$XDG_CACHE_HOME/v4serve/kv-store (~/.cache/v4serve/kv-store)",
    "kv_store_max_bytes": f"{DEFAULT_STORE_BYTES} (32 GiB)",
    "swa_checkpoint_interval": "4096 (rounded down to whole blocks)",
    "max_request_tokens": f"{REQUEST_TOKENS_PER_CONTEXT} × max-model-len",
    "api_key": "none: no key asked",
    "api_keys_file": "none: no tenants",
    "allowed_origins": "none: only the daemon's own pages",
}


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
    enforce_eager: bool = False
    async_scheduling: str = "auto"
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
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
    api_keys_file: str | None = None  # one `KEY TENANT` per line: each tenant's prefix cache its own
    shared_prefix_cache: bool = False  # tenants find each other's prefixes (a shared public system prompt)
    protect_metrics: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES
    max_request_tokens: int | None = None  # prompts + n × max_tokens of one request (None: 16 × max-model-len)
    unread_timeout: float = DEFAULT_UNREAD_TIMEOUT
    grammar_cache_bytes: int = 8 << 20  # compiled grammars kept per process, weighed by their text
    speculative_config: str | None = None  # vLLM's JSON: {"method": "ngram", "num_speculative_tokens": k, ...}
    kv_events_config: str | None = None  # vLLM's JSON: {"publisher": "zmq", "endpoint": "tcp://*:5557", ...}
    # vLLM's: chat-template switches a request that names none gets ({"thinking": false}); none: the model's
    default_chat_template_kwargs: str | None = None
    kv_transfer_config: str | None = None  # vLLM's JSON: {"kv_role": "kv_producer" | "kv_consumer" | "kv_both", ...}
    allowed_origins: str | None = None  # comma-separated web origins whose pages may call the API, or "*"
    responses_store_bytes: int = 256 << 20  # stored Responses API responses, all counted (metadata, tools, ...)
    preprocess_workers: int = 2  # processes that render, tokenize and check tools (0: a thread of the front end)
    max_preprocess_seconds: float = 10.0  # CPU seconds one request's preprocessing may take, in a worker
    unknown_fields: str = "accept"  # a field no API defines: accept (dropped, logged, named in a header) or refuse
    stream_keepalive: float = 10.0  # seconds a stream may go without an event before a keep-alive is sent
    keep_alive_timeout: float = 5.0
    header_timeout: float = 10.0
    h11_max_incomplete_event_size: int = 4 << 20  # bytes of one request's headers (vLLM's name; 431 past it)
    h11_max_header_count: int = 256  # header lines of one request (vLLM's name; 431 past it)
    max_connections: int = 2048
    stall_timeout: float = 60.0  # /health answers 503 once the engine has been silent this long
    watchdog_timeout: float = 300.0  # the daemon exits 1 once it has been silent this long (0: never)
    shutdown_timeout: float = 30.0
    seed: int = 0
    log_level: str = "info"
    api_server_count: int = 1  # HTTP front-end processes over the one engine (server/api_servers.py)
    # The engine on a thread of the HTTP process instead of its own process (benchmarks, debugging).
    engine_in_process: bool = False
    # "module:function" called with the LLMEngine once it is built, in the process that runs it;
    # not a flag: tests inject faults into a real engine process with it.
    engine_hook: str | None = None

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no CUDA device is available")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        from v4serve.engine.model.weights.resident import check_weight_dtype

        check_weight_dtype(self.weight_dtype)
        if self.weight_dtype in ("bf16", "fp32"):
            # Dequantized weights are the model's parameters: they are in the compute dtype.
            wanted = DTYPES[self.weight_dtype]
            if self.dtype not in ("auto", *[k for k, v in DTYPES.items() if v == wanted]):
                raise ValueError(f"--weight-dtype {self.weight_dtype} dequantizes the weights to {self.weight_dtype}, "
                                 f"which is also the compute dtype; it contradicts --dtype {self.dtype}")
            return getattr(torch, wanted)
        if self.dtype == "auto":
            # CPUs without bf16 units run bf16 matmuls far slower than fp32.
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        return getattr(torch, DTYPES[self.dtype])

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config parsed (ValueError saying what is wrong)."""
        if not self.speculative_config:
            return None
        from v4serve.engine.speculative import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """--kv-events-config parsed (ValueError saying what is wrong; None: off)."""
        from v4serve.cache.kv_events import KVEventsConfig

        return KVEventsConfig.parse(self.kv_events_config) if self.kv_events_config else None

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """--kv-transfer-config parsed (ValueError saying what is wrong; None: neither role)."""
        if not self.kv_transfer_config:
            return None
        from v4serve.cache.kv_transfer import KVTransferConfig

        config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.no_kv_store or self.no_prefix_caching:
            raise ValueError("--kv-transfer-config hands KV over as SSD-store files: it cannot be combined with "
                             f"--{'no-kv-store' if self.no_kv_store else 'no-prefix-caching'}")
        return config

    @property
    def default_thinking(self) -> bool:
        """Whether a chat request naming no thinking mode thinks: --default-chat-template-kwargs, else the
        model's default (DeepSeek's converter thinks; the embedded tiny model's random weights would never
        end a reasoning, so it answers in chat mode)."""
        from v4serve.server.protocol import CHAT_TEMPLATE_KWARGS, template_thinking

        default = not is_embedded(self.model)
        if not self.default_chat_template_kwargs:
            return default
        try:
            kwargs = json.loads(self.default_chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--default-chat-template-kwargs is not JSON: {exc}") from exc
        if not isinstance(kwargs, dict) or set(kwargs) - CHAT_TEMPLATE_KWARGS:
            raise ValueError(f"--default-chat-template-kwargs must be a JSON object of {sorted(CHAT_TEMPLATE_KWARGS)}, "
                             'e.g. \'{"thinking": false}\' (DeepSeek-V4 has no Jinja template: only these mean '
                             "anything)")
        return template_thinking(kwargs, default)

    def kv_transfer_address(self, transfer: KVTransferConfig) -> tuple[str, int]:
        """Where decode replicas reach this prefill replica: kv_ip/kv_port, else --host/--port (a wildcard
        host is this machine's name)."""
        import socket

        host = transfer.kv_ip or ("" if self.host in ("0.0.0.0", "::", "") else self.host) or socket.getfqdn()
        return host, transfer.kv_port or self.port

    @property
    def origins(self) -> tuple[str, ...]:
        """--allowed-origins as a tuple (each an origin as browsers send it: scheme://host[:port])."""
        origins = tuple(o.strip().rstrip("/") for o in (self.allowed_origins or "").split(",") if o.strip())
        for origin in origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"--allowed-origins takes origins like https://app.example.com or *, got {origin!r}")
        return origins

    def check_http_settings(self) -> None:
        """Clear errors for the front end's settings, before the port is taken."""
        self.origins  # noqa: B018 - parsing them is the check
        self.speculative  # noqa: B018 - so is parsing this
        self.kv_events  # noqa: B018 - and this
        self.kv_transfer  # noqa: B018 - and this
        self.default_thinking  # noqa: B018 - and this
        for name in ("keep_alive_timeout", "header_timeout", "h11_max_incomplete_event_size", "h11_max_header_count",
                     "max_connections", "stall_timeout", "max_unread_tokens",
                     "max_logprob_entries", "unread_timeout", "grammar_cache_bytes", "responses_store_bytes",
                     "max_preprocess_seconds", "stream_keepalive"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        from v4serve.engine.overlap import ASYNC_SCHEDULING_CHOICES

        if self.async_scheduling not in ASYNC_SCHEDULING_CHOICES:
            raise ValueError(f"--async-scheduling must be one of {', '.join(ASYNC_SCHEDULING_CHOICES)}, "
                             f"got {self.async_scheduling!r}")
        if self.unknown_fields not in ("accept", "refuse"):
            raise ValueError(f"--unknown-fields must be accept or refuse, got {self.unknown_fields!r}")
        if self.preprocess_workers < 0:
            raise ValueError(f"--preprocess-workers must be 0 or more, got {self.preprocess_workers}")
        if self.max_request_tokens is not None and self.max_request_tokens <= 0:
            raise ValueError(f"--max-request-tokens must be positive, got {self.max_request_tokens}")
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be at least 1, got {self.api_server_count}")
        if self.api_server_count > 1 and self.engine_in_process:
            raise ValueError("--engine-in-process keeps the engine inside the one API server; it cannot be combined "
                             "with --api-server-count")
        if self.watchdog_timeout < 0:
            raise ValueError(f"--watchdog-timeout must be 0 (off) or positive, got {self.watchdog_timeout}")
        self.api_keys()  # a keys file that does not parse is refused before the port is taken
        if self.shared_prefix_cache and not self.api_keys_file:
            raise ValueError("--shared-prefix-cache shares the prefix cache between the tenants of --api-keys-file; "
                             "without that file there are no tenants (and one cache)")

    def api_keys(self) -> ApiKeys | None:
        """The keys the daemon asks for, each with its tenant (None: no key asked)."""
        from v4serve.server.tenants import ApiKeys

        if not (self.api_key or self.api_keys_file):
            return None
        try:
            return ApiKeys(self.api_key, self.api_keys_file)
        except OSError as exc:
            raise ValueError(f"--api-keys-file {self.api_keys_file}: {exc.strerror or exc}") from exc

    @property
    def model_names(self) -> tuple[str, ...]:
        """--served-model-name's names (aliases of the one model), else one made from --model."""
        names = tuple(dict.fromkeys(n.strip() for n in (self.served_model_name or "").split(",") if n.strip()))
        if names:
            return names
        return (f"v4serve-{self.model}" if is_embedded(self.model) else Path(self.model).name,)

    @property
    def model_name(self) -> str:
        """The first name: what metrics and logs are labelled with."""
        return self.model_names[0]


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in a group a launcher (`torchrun`) started: from its environment."""

    rank: int
    world_size: int
    local_rank: int


def launched_rank(environ: dict[str, str] | os._Environ[str] = os.environ) -> LaunchedRank | None:
    """The torchrun-style RANK/WORLD_SIZE/LOCAL_RANK of this process, or None when it was started alone."""
    if "WORLD_SIZE" not in environ or "RANK" not in environ:
        return None
    try:
        return LaunchedRank(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", "0")))
    except ValueError as exc:
        raise ValueError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers: {exc}") from exc


def check_parallel_flags(cfg: ServeConfig, launched: LaunchedRank | None) -> None:
    """Clear errors for parallel settings that cannot work, before anything starts."""
    if cfg.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {cfg.tensor_parallel_size}")
    if cfg.expert_parallel and cfg.tensor_parallel_size == 1:
        raise ValueError("--expert-parallel divides the experts across the ranks of --tensor-parallel-size; "
                         "set --tensor-parallel-size 2 or more")
    if cfg.tensor_parallel_size > 1 and cfg.engine_in_process:
        raise ValueError("--engine-in-process runs one rank; it cannot be combined with --tensor-parallel-size")
    if launched is not None and launched.world_size > 1 and launched.world_size != cfg.tensor_parallel_size:
        raise ValueError(f"launched as {launched.world_size} ranks (WORLD_SIZE) but --tensor-parallel-size is "
                         f"{cfg.tensor_parallel_size}; they must agree")


def default_store_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "v4serve", "kv-store")
