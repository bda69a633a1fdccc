"""The engine: requests in, tokens out. `step()` is schedule → run → update."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from concurrent import futures
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from v4serve.cache.config import CacheConfig
from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.kv_events import KVEventLog, KVEventsConfig, ZmqEventPublisher
from v4serve.cache.kv_manager import KVCacheManager
from v4serve.cache.kv_transfer import KVTransferConfig
from v4serve.cache.layout import KVLayout, cache_table, key_record
from v4serve.cache.ssd_file import KIND_BLOCK, KIND_RESPONSE, KIND_SNAPSHOT
from v4serve.cache.ssd_store import SSDStore
from v4serve.cache.state_capture import CaptureSeq, StateCapture
from v4serve.engine.model.gpu.decode_graphs import DecodeGraphs, decode_buckets
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.model.v41.model import DeepseekV41
from v4serve.engine.model.weights.fingerprint import tensors_digest
from v4serve.engine.model.weights.packed import packed_count
from v4serve.engine.mtp import MTPLayer, MTPRows, MTPSeed, mtp_drafts, mtp_ready
from v4serve.engine.overlap import InFlight, async_scheduling
from v4serve.engine.request import GrammarSpec, Request, RequestError, RequestLimits, RequestStatus, Sample
from v4serve.engine.sampler import NonFiniteLogits, Sampler, finite_top
from v4serve.engine.scheduler import Drafter, ScheduledChunk, Scheduler, SchedulerConfig
from v4serve.engine.speculative import SpecCounters, SpeculativeConfig, accepted_count, after_pass, ngram_drafts
from v4serve.engine.stats import EngineStats
from v4serve.engine.step_plan import (
    DecodeStep,
    GraphSpec,
    KVShape,
    MirroredDeviceKV,
    MTPPass,
    Ranks,
    StepPlan,
    kv_digest,
    step_threads,
)
from v4serve.engine.structured import GRAMMAR_CACHE_TEXT_BYTES, Grammars, RequestGrammar, require
from v4serve.kernels import kv_fp8
from v4serve.kernels.attention import RowLayout, SlotTables, upload

log = logging.getLogger(__name__)

Model = DeepseekV4 | DeepseekV41

# Bumped whenever the meaning of stored KV changes (layout, pooling, rope placement).
KV_FORMAT_VERSION = 1

# Forward passes failing in a row before the engine is declared broken (one failure fails only the
# requests of that step: a bad input or a transient fault must not take everyone down).
MAX_FORWARD_FAILURES = 3


_LAST_ROW, _NO_ROWS = range(0, 1), range(0)


class EngineUnhealthy(RuntimeError):
    """The forward pass keeps failing: the device or the model is broken; serving stops."""


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 32768
    max_num_seqs: int = 16
    num_blocks: int | None = None  # default: every slot can hold max_model_len tokens
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 1024
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    swa_cache_mode: str = "periodic"
    swa_checkpoint_interval: int = 4096
    snapshot_bytes: int = 1 << 30
    kv_dtype: torch.dtype = torch.float32  # the compute dtype, and that of every KV tensor but FP8 keys
    kv_cache_dtype: str = "auto"  # "fp8": window rows and entries stored as FP8 records (cache/layout.KVRecord)
    seed: int = 0
    kv_store_dir: str | None = None  # the SSD prefix store; None = off
    kv_store_max_bytes: int | None = None
    kv_store_read_timeout: float = 10.0  # a store read still running after this is a miss
    kv_store_read_process: bool = True  # read store files in a child process (False: on this process's threads)
    kv_store_retry_seconds: float = 30.0  # after a full disk: how often to look for space again
    weights_digest: bytes | None = None  # of the checkpoint files; None: digest the tensors if needed
    tokenizer_json: str | None = None  # the vocabulary, as data, for structured outputs (None: unsupported)
    barred_token_ids: tuple[int, ...] = ()  # input-only ids (BOS, role markers, image placeholders): never sampled
    grammar_cache_bytes: int = GRAMMAR_CACHE_TEXT_BYTES  # compiled grammars kept, by their text's bytes
    enforce_eager: bool = False  # no CUDA graphs for decode steps (vLLM's flag)
    speculative: SpeculativeConfig | None = None  # draft tokens checked by each decode step (off: None)
    kv_events: KVEventsConfig | None = None  # blocks stored and removed, published for routers (off: None)
    async_scheduling: str = "auto"  # step N+1 launched before step N's tokens are read (engine/overlap.py)
    # Decode steps from the graphs' static buffers where nothing is captured (the CPU): how tests check,
    # without a GPU, the path a replayed graph takes.
    uncaptured_graphs: bool = False
    # Eager drafted passes row by row, as static ones run (kernels/attention.py `RowWrites`): None is on
    # CUDA and wherever decode graphs are; off, a CPU's torch kernels run them as chunks, 3-13% faster
    # there (each row gathers its own window and entries). Tests set it to compare static with eager.
    rowwise_drafts: bool | None = None
    kv_transfer: KVTransferConfig | None = None  # prefill and decode on separate replicas (None: neither role)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    samples: list[Sample] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    error_param: str | None = None  # set when the request itself caused it (a 400): the field to blame


def kv_namespace(model: Model, kv_dtype: torch.dtype, weights_digest: bytes,
                 kv_cache_dtype: str = "auto") -> bytes:
    """Changes whenever the weights, the KV dtype or the KV layout change: cached KV from a
    different namespace must never be served. FP8 keys and --batch-invariant (whose KV is
    bitwise reproducible, which KV written without it is not) get namespaces of their own; the
    default's is the one earlier versions wrote."""
    h = hashlib.sha256()
    h.update(json.dumps(model.cfg.to_official_dict(), sort_keys=True).encode())
    h.update(weights_digest)
    tags = f"{kv_dtype}|format={KV_FORMAT_VERSION}"
    tags += f"|keys={kv_cache_dtype}|{kv_fp8.ENCODING}" if kv_cache_dtype != "auto" else ""
    tags += "|batch-invariant" if model.kernels is not None and model.kernels.batch_invariant else ""
    # Kernels reading packed weights round differently from GEMMs over dequantized ones.
    tags += "|weights=packed" if packed_count(model) else ""
    # Partial sums added across ranks round differently from one process's sums: KV computed at one
    # parallel layout is not bitwise the KV of another, so each layout has its own namespace.
    if model.parallel is not None:
        tags += f"|tp={model.parallel.size}" + ("|ep" if model.parallel.splits_experts else "")
    h.update(tags.encode())
    return h.digest()


def _cuda_graphs(device: torch.device, config: EngineConfig, model: Model, ranks: Ranks | None) -> str:
    """Whether decode steps are captured as CUDA graphs ("on"), or why not. Captured steps must not
    depend on host values: the Triton kernels' decode path does not (tests/test_fixed_shapes.py,
    tests/test_decode_graphs.py); the torch twins read values back, and the batch-invariant kernels
    loop over the batch on the host."""
    if config.enforce_eager:
        return "off (--enforce-eager)"
    if device.type != "cuda":
        return f"off (not on CUDA: {device.type})"
    if model.abilities.graphs:
        return f"off ({model.abilities.graphs})"
    assert model.kernels is not None
    if model.kernels.backend != "triton":
        return "off (--attention-backend torch reads values back on the host)"
    if model.kernels.batch_invariant:
        return "off (--batch-invariant drives its per-row kernels from the host)"
    return "on"


def _check_abilities(model: Model, config: EngineConfig, ranks: Ranks | None) -> None:
    """A setting the model's step cannot serve, refused with its reason before anything is allocated."""
    can = model.abilities
    asked = {"batch_invariant": model.kernels is not None and model.kernels.batch_invariant,
             "parallel": ranks is not None, "speculation": config.speculative is not None,
             "fp8_keys": config.kv_cache_dtype != "auto"}
    for ability, wanted in asked.items():
        reason = getattr(can, ability)
        if wanted and reason:
            raise ValueError(reason)


def _sample_or_raise(sample: Sample | Exception) -> Sample:
    if isinstance(sample, Exception):
        raise sample
    return sample


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LLMEngine:
    def __init__(self, model: Model, config: EngineConfig, eos_token_id: int | None = None,
                 ranks: Ranks | None = None) -> None:
        """`ranks`: under tensor/expert parallelism, the other ranks this engine (rank 0) drives;
        `model` is then rank 0's shard."""
        _check_abilities(model, config, ranks)
        self.model = model
        self.ranks = ranks
        self.config = config
        cfg = model.cfg
        self.eos_token_id = cfg.eos_token_id if eos_token_id is None else eos_token_id
        record = key_record(cfg.head_dim, cfg.rope_dim, _dtype_name(config.kv_dtype), config.kv_cache_dtype)
        mtp = config.speculative is not None and config.speculative.method == "mtp"
        if mtp and not len(model.mtp):
            raise ValueError("speculative method 'mtp' needs the model loaded with its multi-token-prediction layer")
        self.layout = KVLayout.from_config(cfg, record, mtp_layers=int(mtp))
        block = cfg.block_size
        num_blocks = config.num_blocks or config.max_num_seqs * -(-config.max_model_len // block)
        device = next(model.parameters()).device
        self.cuda_graphs = _cuda_graphs(device, config, model, ranks)
        self.async_scheduling = async_scheduling(config.async_scheduling, device,
                                                 config.speculative is not None)
        if model.context_tokens and self.async_scheduling == "on":
            # The step reads the tokens before each chunk on the host: the one in flight is not there yet.
            self.async_scheduling = "off (the model reads each step's preceding tokens on the host)"
        self._in_flight: InFlight | None = None  # the last step launched ahead, its samples not yet read
        graphs = self.cuda_graphs == "on" or config.uncaptured_graphs
        # Drafted passes (the last token and k drafts per sequence) run row-wise (`RowWrites`): without a
        # loop over sequences on the host, as their static steps do (eagerly too, per `rowwise_drafts`). Not
        # under --batch-invariant, whose chunks already go row by row through its own kernels.
        spec = config.speculative
        batch_invariant = model.kernels is not None and model.kernels.batch_invariant
        self.row_width = 1 + spec.num_speculative_tokens if spec is not None and not batch_invariant else 1
        rowwise = config.rowwise_drafts if config.rowwise_drafts is not None else graphs or device.type == "cuda"
        eager_width = self.row_width if rowwise else 1  # an eager drafted pass's rows per sequence, row-wise
        scratch = int(graphs)  # a slot and a block past the pools for a graph's padding rows
        kv_class = MirroredDeviceKV if ranks is not None else DeviceKV
        self.device_kv = kv_class(self.layout, config.max_num_seqs + scratch, num_blocks + scratch, config.kv_dtype,
                                  device)
        if ranks is not None:
            ranks.start(KVShape(self.layout, config.max_num_seqs + scratch, num_blocks + scratch, config.kv_dtype,
                                eager_width))
        self.mtp = MTPLayer(model, self.device_kv, eager_width) if mtp else None
        self._eager_width = eager_width
        self.cache_config = CacheConfig(
            block_size=block, window=cfg.window, num_layers=cfg.num_layers, num_slots=config.max_num_seqs,
            num_blocks=num_blocks, swa_cache_mode=config.swa_cache_mode,
            swa_checkpoint_interval=config.swa_checkpoint_interval,
            enable_prefix_caching=config.enable_prefix_caching, snapshot_bytes=config.snapshot_bytes,
            overlap_ratio=cfg.csa_ratio if "csa" in {cfg.layer_kind(i) for i in range(cfg.num_layers)} else 0,
            snapshots_inside_chunks=not mtp and model.abilities.captures_rows)
        store = None
        persistent = bool(config.kv_store_dir and config.enable_prefix_caching)
        # KV that outlives the process is keyed by every byte of the weights; within one process the
        # weights cannot change, so the (costly on a large model) digest is only taken for the store.
        digest = config.weights_digest or (tensors_digest(model.state_dict().items()) if persistent else b"")
        namespace = kv_namespace(model, config.kv_dtype, digest, config.kv_cache_dtype)
        if persistent:
            store = SSDStore(config.kv_store_dir, namespace, self.device_kv.layout_descriptor(),
                             {KIND_BLOCK: self.device_kv.block_nbytes(), KIND_SNAPSHOT: self.device_kv.slot_nbytes(),
                              KIND_RESPONSE: self.device_kv.slot_nbytes() + self.device_kv.block_nbytes()},
                             max_bytes=config.kv_store_max_bytes, read_timeout=config.kv_store_read_timeout,
                             retry_seconds=config.kv_store_retry_seconds, read_process=config.kv_store_read_process,
                             read_reserve=self._largest_load())
            self.device_kv.reserve_host_rows(self._largest_load())
        if config.kv_transfer is not None and store is None:
            raise ValueError("--kv-transfer-config hands KV over as SSD-store files: it needs the store "
                             "(--kv-store-dir, not --no-kv-store) and prefix caching")
        if config.kv_transfer is not None and config.kv_transfer.producer and store is not None:
            store.keep_handovers_for(config.kv_transfer.hold_seconds)
        events = KVEventLog(block) if config.kv_events is not None else None
        self.kv = KVCacheManager(self.cache_config, self.device_kv, namespace, store, events)
        self.kv_events = ZmqEventPublisher(events, config.kv_events) if events and config.kv_events else None
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_prefill_chunk=config.max_prefill_chunk, max_model_len=config.max_model_len,
            max_waiting=config.max_waiting, kv_transfer=config.kv_transfer),
            self.kv, self._drafter(config.speculative), self.eos_token_id)
        # The pass of this step, while its drafted requests' drafts are judged: each row's last state
        # and token, and each request's first row (what the MTP layer reads of kept rows).
        self._pass: tuple[torch.Tensor, torch.Tensor, dict[str, int]] | None = None
        self.spec = SpecCounters()
        self._step_capture: StateCapture | None = None  # this step's slot states inside its chunks
        self.limits = RequestLimits(vocab_size=cfg.vocab_size, max_model_len=config.max_model_len,
                                    cache=self.cache_config)
        self.sampler = Sampler(config.seed, self.eos_token_id, config.barred_token_ids)
        self.grammars = (Grammars(config.tokenizer_json, cfg.vocab_size, self.eos_token_id, config.grammar_cache_bytes)
                         if config.tokenizer_json else None)
        self.requests: dict[str, Request] = {}
        self._cpu_threads = torch.get_num_threads()
        self._forward_failures = 0
        # The FP8 key records, shown beside the default for comparison where the model can keep them.
        fp8 = (key_record(cfg.head_dim, cfg.rope_dim, _dtype_name(config.kv_dtype), "fp8")
               if model.abilities.fp8_keys is None else None)
        log.info("%s", cache_table(self.layout, self.device_kv.itemsize, config.max_num_seqs, num_blocks, fp8))
        width = -(-config.max_model_len // block)
        self.slot_tables = SlotTables(config.max_num_seqs + scratch, width, device)
        self.graphs: DecodeGraphs | None = None
        if graphs:
            graph_spec = GraphSpec(decode_buckets(config.max_num_seqs), width, scratch_slot=config.max_num_seqs,
                                   scratch_block=num_blocks, capture=self.cuda_graphs == "on",
                                   row_width=self.row_width, states=mtp)
            if ranks is not None:  # first: each rank's capture runs collectives that meet rank 0's
                ranks.start_graphs(graph_spec)
            self.graphs = DecodeGraphs(model, self.device_kv, graph_spec.buckets, width, graph_spec.scratch_slot,
                                       graph_spec.scratch_block, graph_spec.capture, slot_tables=self.slot_tables,
                                       row_width=self.row_width, states=mtp)
            if self.mtp is not None:  # its commits and drafting passes (captured after the main model's)
                self.mtp.graphs = DecodeGraphs(model, self.device_kv, graph_spec.buckets, width,
                                               graph_spec.scratch_slot, graph_spec.scratch_block, graph_spec.capture,
                                               slot_tables=self.slot_tables, row_width=self.row_width, mtp=True)
            if ranks is not None:
                self.slot_tables.record()  # each step sends the other ranks its tables' changes
        log.info("CUDA graphs: %s; async scheduling: %s", self.cuda_graphs, self.async_scheduling)

    def _largest_load(self) -> int:
        """Bytes of the blocks of the longest prompt: what the largest disk hit reads at once (the store's
        reader and the host memory a load lands in are made this large at start, up to their caps)."""
        return -(-self.config.max_model_len // self.cache_config.block_size) * self.device_kv.block_nbytes()

    @staticmethod
    def _drafter(spec: SpeculativeConfig | None) -> Drafter | None:
        if spec is None:
            return None
        if spec.method == "mtp":
            return mtp_drafts
        if spec.method != "ngram":
            raise ValueError(f"speculative method {spec.method!r} is not available")
        k, lo, hi = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        return lambda request, most: ngram_drafts(request.all_token_ids, min(k, most), lo, hi)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.limits.validate(request)
        request.hold_prompt_compactly()
        if request.request_id in self.requests:
            raise RequestError(f"duplicate request id {request.request_id}")
        if request.sampling.grammar is not None:
            request.grammar = self.grammar_matcher(request.sampling.grammar)
        self.scheduler.add(request)
        self.requests[request.request_id] = request

    def grammar_compiled(self, spec: GrammarSpec) -> bool:
        """Whether a request with this grammar joins without compiling it (no grammars: nothing to compile)."""
        return self.grammars is None or self.grammars.compiled(spec)

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Raise RequestError (a 400) now if this grammar cannot be enforced; thread-safe."""
        self.grammar_matcher(spec, check_only=True)

    def grammar_matcher(self, spec: GrammarSpec, check_only: bool = False) -> RequestGrammar | None:
        grammars = require(self.grammars, spec)
        if check_only:
            grammars.check(spec)
            return None
        return grammars.matcher(spec)

    def abort(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self.sampler.forget(request_id)
        return True

    def pause(self, request_id: str, paused: bool) -> None:
        """Hold a request (its client is not reading) or let it go on; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            request.paused = paused

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.async_scheduling == "on":
            return self._step_ahead()
        chunks = self.scheduler.schedule()
        if not chunks:
            self._wait_for_loads()
            return []
        try:
            logits = self.execute(chunks)
        except Exception as exc:
            return self._forward_failed(chunks, exc)
        self._forward_failures = 0
        return self.update(chunks, logits)

    def _wait_for_loads(self) -> None:
        if self.scheduler.loading:  # only store reads in flight: wait for one, don't spin
            futures.wait(self.scheduler.pending_loads(), timeout=0.01, return_when=futures.FIRST_COMPLETED)

    # ---- one step, launched ahead (async scheduling: engine/overlap.py) -----------------------------
    def _step_ahead(self) -> list[RequestOutput]:
        """Schedule this step and launch its forward; read the previous step's samples while the device
        runs it; launch this step's sampling (its rows prepared with every token before them known:
        grammar masks, penalties and thinking budgets need them); account this step's chunks."""
        ahead, self._in_flight = self._in_flight, None
        chunks = self.scheduler.schedule()
        if not chunks:
            if ahead is None:
                self._wait_for_loads()
            return self._land(ahead) if ahead is not None else []
        try:
            logits = self.execute(chunks, ahead)
        except Exception as exc:
            self._step_capture = None
            outputs = self._land(ahead) if ahead is not None else []
            return outputs + self._forward_failed([c for c in chunks if c.request.request_id in self.requests], exc)
        self._forward_failures = 0
        plan = [(c, len(self.logit_rows(c)), c.request.num_computed_tokens, c.completes) for c in chunks]
        ending: list[tuple[Request, str]] = []  # requests to end once this step's chunks are accounted
        outputs = self._land(ahead, ending, {id(c.request) for c in chunks}) if ahead is not None else []
        failed: list[tuple[Request, Exception]] = []
        try:
            self._in_flight = self._sample_ahead(plan, logits, failed, {id(r) for r, _ in ending})
        except Exception as exc:  # the step's sampling failed: its requests end, no other
            ended = {id(r) for r, _ in ending}
            failed += [(c.request, exc) for c, _, _, completes in plan if completes and id(c.request) not in ended]
        outputs += [self._failed_after_forward(r, exc, ending) for r, exc in failed]
        self.scheduler.advance(chunks, self._captured_states())
        i, ended = 0, {id(r) for r, _ in ending}
        for chunk, n, start, _ in plan:
            i += n
            if chunk.request.sampling.prompt_logprobs is not None and n and id(chunk.request) not in ended:
                try:  # reads this step's logits back: a step with prompt logprobs waits for the device
                    self._record_prompt_logprobs(chunk.request, start, logits[i - n:i])
                except Exception as exc:
                    outputs.append(self._failed_after_forward(chunk.request, exc, ending))
        for request, reason in ending:  # stopped by a token read above, or failed: its chunk is accounted now
            self.finish(request, reason)
        return outputs

    def _sample_ahead(self, plan: list[tuple[ScheduledChunk, int, int, bool]], logits: torch.Tensor,
                      failed: list[tuple[Request, Exception]], ending: set[int]) -> InFlight | None:
        """Launch the sampling of every chunk that completes, but of requests `ending` (by id); its
        requests now have a token in flight. A request whose row cannot be prepared (its grammar
        failed) goes into `failed` with the reason."""
        sampled, rows, preps, i = [], [], [], 0
        for chunk, n, _, completes in plan:
            i += n
            if not completes or id(chunk.request) in ending:
                continue
            try:
                preps.append(self.sampler.prepare(chunk.request))
            except Exception as exc:
                failed.append((chunk.request, exc))
                continue
            sampled.append(chunk)
            rows.append(i - 1)
        if not sampled:
            return None
        picked = logits if len(rows) == len(logits) else logits.index_select(0, upload(rows, logits.device))
        launched = InFlight(sampled, self.sampler.sample_ahead(preps, picked))
        for c in sampled:
            c.request.pending_tokens += 1
        return launched

    def _land(self, ahead: InFlight, ending: list[tuple[Request, str]] | None = None,
              launched: set[int] = frozenset()) -> list[RequestOutput]:  # type: ignore[assignment]
        """Read a launched step's samples: accept each token, stop or go on. A request whose next chunk
        was launched since (its id in `launched`) ends once that chunk is accounted (into `ending`)."""
        try:
            samples: list[Sample | Exception] = ahead.rows.samples()
        except Exception as exc:  # the read back failed: its requests end, no other
            samples = [exc] * len(ahead.sampled)
        outputs = []
        for chunk, sample in zip(ahead.sampled, samples, strict=True):
            request = chunk.request
            request.pending_tokens -= 1
            if request.status is not RequestStatus.RUNNING or self.requests.get(request.request_id) is not request:
                continue  # aborted meanwhile: its token is dropped
            later = ending if id(request) in launched else None
            try:
                outputs.append(self._accept(request, _sample_or_raise(sample), later))
            except Exception as exc:
                outputs.append(self._failed_after_forward(request, exc, later))
        return outputs

    def _forward_failed(self, chunks: list[ScheduledChunk], exc: Exception) -> list[RequestOutput]:
        """Fail the requests of this step (their KV may be half written; it is private to them and
        freed) and go on, unless the forward pass keeps failing."""
        self._forward_failures += 1
        self._step_capture = None
        if self.ranks is not None:  # the ranks may be mid-collective: the group cannot go on
            self.ranks.broken = True
            cause = self.ranks.dead_rank() or type(exc).__name__
            raise EngineUnhealthy(f"a parallel step failed ({cause}); the ranks cannot continue") from exc
        log.error("the forward pass failed (%d in a row); failing its %d requests", self._forward_failures,
                  len(chunks), exc_info=exc)
        if self._forward_failures >= MAX_FORWARD_FAILURES:
            raise EngineUnhealthy(f"the forward pass failed {self._forward_failures} times in a row "
                                  f"({type(exc).__name__}; the engine's log has the detail)") from exc
        # The exception's text stays in the log: it can hold anything (paths, shapes, another request's data).
        return [self.fail(c.request, f"the forward pass failed ({type(exc).__name__}; the engine's log has the detail)")
                for c in chunks]

    @staticmethod
    def logit_rows(chunk: ScheduledChunk) -> range:
        """Rows of the chunk whose logits are needed: every prompt row when the request wants
        prompt logprobs, else the last row when the chunk completes."""
        r = chunk.request
        if chunk.num_new == 1 and not chunk.drafts and r.sampling.prompt_logprobs is None:
            return _LAST_ROW if chunk.completes else _NO_ROWS  # a decode: the common case
        if chunk.drafts:  # the last token's row, then each draft's
            return range(chunk.num_new - len(chunk.drafts) - 1, chunk.num_new)
        if r.sampling.prompt_logprobs is not None and r.num_computed_tokens < r.num_prompt_tokens:
            return range(chunk.num_new)
        return range(chunk.num_new - 1, chunk.num_new) if chunk.completes else range(0)

    def execute(self, chunks: list[ScheduledChunk], ahead: InFlight | None = None) -> torch.Tensor:
        """One forward over every scheduled chunk → the logits of `logit_rows` of each chunk. `ahead`: the
        step before, whose tokens (still on the device) are the inputs of requests that have one in flight."""
        seqs, ids = [], []
        for c in chunks:
            r, kv = c.request, c.request.kv
            assert kv.slot is not None
            start, back = r.num_computed_tokens, self.model.context_tokens
            seqs.append(SeqChunk(slot=kv.slot, block_table=kv.block_table, start=start, num_new=c.num_new,
                                 frozen_until=kv.frozen_until, window_from=kv.window_from,
                                 history=tuple(r.token_slice(max(0, start - back), start)) if back else ()))
            ids.extend(r.token_slice(r.num_computed_tokens, r.num_computed_tokens + c.num_new - len(c.drafts)))
            if r.pending_tokens:  # its token in flight: a place the device fills (`_fill_inputs`)
                ids.append(0)
            ids.extend(c.drafts)
        keep = [c.request.kv.slot for c in chunks if c.drafts]  # put back if a draft is rejected
        self.device_kv.keep_slots(keep)  # type: ignore[arg-type]
        rows = [self.logit_rows(c) for c in chunks]
        meta = AttentionMetadata.build(seqs, rows)
        self._step_capture = self._state_capture(chunks, seqs)
        threads = step_threads(len(ids), self._cpu_threads)
        width = max(seq.num_new for seq in seqs)
        if 1 < width <= self._eager_width and self._step_capture is None:
            meta.rowwise = RowLayout(self.row_width)  # a drafted pass (or as short): row by row
        static = (self.graphs is not None and self._step_capture is None
                  and (self.graphs.width_for(seqs) > 1 or (self.graphs.fits(seqs) and all(len(r) == 1 for r in rows))))
        offsets: list[int] = []  # each sequence's first row, for the MTP layer
        kept_rows: list[MTPRows] = []
        if self.mtp is not None:
            # A static drafted step's rows sit `row_width` apart, each sequence padded to as many.
            offsets = ([i * self.row_width for i in range(len(seqs))] if static and width > 1
                       else [seq.offset for seq in seqs])
            # Rows without drafts are kept whatever is sampled: the MTP layer takes them right after the
            # pass, before `update` seals blocks and snapshots the slots.
            kept_rows = [MTPRows.of(c.request, o, c.num_new) for c, o in zip(chunks, offsets, strict=True)
                         if not c.drafts]
        self.slot_tables.update([seq.slot for seq in seqs], [seq.block_table for seq in seqs])
        fill = ahead.input_fill(chunks) if ahead is not None else None
        if self.ranks is not None:
            self._send_step(ids, meta, threads, kept_rows, static, fill, keep)
            if fill and fill[0]:
                assert ahead is not None
                self.ranks.send_tokens(ahead.rows.tokens)
        meta.capture = self._step_capture  # rank 0's alone: the other ranks' slots are never snapshotted
        meta.slot_tables = self.slot_tables  # local too: the other ranks keep their own
        if static:
            assert self.graphs is not None
            # A decode step wants each sequence's one row (the static condition): no rows to name.
            out = self.graphs.run(ids, seqs, lambda ids: self._fill_inputs(ids, ahead, fill),
                                  rows if width > 1 else None)  # replayed
            logits, states, input_ids = out.logits, out.states, out.ids
        else:
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device_kv.device)
            self._fill_inputs(input_ids, ahead, fill)
            if self.device_kv.device.type == "cpu":
                torch.set_num_threads(threads)
            if self.mtp is None:
                return self.model(input_ids, meta, self.device_kv)
            logits, states = self.model.forward_states(input_ids, meta, self.device_kv)
        if self.mtp is not None:
            assert states is not None
            self._pass = (states, input_ids, {c.request.request_id: o for c, o in zip(chunks, offsets, strict=True)})
            self.mtp.commit(kept_rows, states, input_ids)
        return logits

    def _send_step(self, ids: list[int], meta: AttentionMetadata, threads: int, kept_rows: list[MTPRows],
                   static: bool, fill: tuple[list[int], list[int]] | None, keep: list[int]) -> None:
        """The step to the other ranks: a static decode step with nothing else to mirror in one
        fixed-size message, anything else as a pickled plan. `fill`: where the tokens in flight go
        (places in `ids`, rows of the tokens `send_tokens` sends next)."""
        assert self.ranks is not None and isinstance(self.device_kv, MirroredDeviceKV)
        kv_writes, table_writes = self.device_kv.take_writes(), self.slot_tables.take_writes()
        fill = fill or ([], [])
        if static and not kv_writes and not kept_rows:
            s, fill_rows = meta.seqs, [-1] * len(meta.seqs)  # a decode step: sequence i's token is place i
            for place, row in zip(*fill, strict=True):
                fill_rows[place] = row
            drafted = [q.num_new for q in s] if any(q.num_new > 1 for q in s) else []
            assert not (drafted and fill[0]), "a drafted pass has no token in flight"
            kept = set(keep)
            step = DecodeStep(ids, [q.slot for q in s], [q.start for q in s], [q.window_from for q in s],
                              [q.frozen_until for q in s], fill_rows, table_writes, threads, drafted,
                              [int(q.slot in kept) for q in s] if kept else [])
            if self.ranks.run_decode(step):
                return
        self.ranks.run_step(StepPlan(kv_writes, ids, meta, threads, kept_rows, table_writes, static, fill, keep))

    @staticmethod
    def _fill_inputs(input_ids: torch.Tensor, ahead: InFlight | None, fill: tuple[list[int], list[int]] | None
                     ) -> None:
        """The tokens still in flight into their places, device to device."""
        if ahead is None or fill is None or not fill[0]:
            return
        places, rows = fill
        device = input_ids.device
        input_ids.index_copy_(0, upload(places, device), ahead.rows.tokens.index_select(0, upload(rows, device)))

    def _state_capture(self, chunks: list[ScheduledChunk], seqs: list[SeqChunk]) -> StateCapture | None:
        """Where the step keeps the slot states at the snapshot points inside its chunks (None: no
        chunk crosses one)."""
        crossing = [CaptureSeq(c.request.request_id, seq.slot, seq.offset, seq.start, c.capture_points)
                    for c, seq in zip(chunks, seqs, strict=True) if c.capture_points]
        return StateCapture(crossing) if crossing else None

    def _captured_states(self) -> dict[str, list[tuple[int, list[torch.Tensor]]]]:
        """Each request's slot states at the snapshot points inside its chunk of the step just run."""
        capture, self._step_capture = self._step_capture, None
        if capture is None:
            return {}
        try:
            return {seq.owner: capture.states_at(self.device_kv, seq) for seq in capture.seqs}
        except Exception:  # snapshots save recompute later; losing them must not stop the engine
            log.exception("the slot states captured in this step could not be read back; no snapshots from it")
            return {}

    def update(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[RequestOutput]:
        # Row layout and completion are decided on the pre-step counts.
        plan = [(c, len(self.logit_rows(c)), c.request.num_computed_tokens, c.completes) for c in chunks]
        # A drafted chunk advances once its drafts are judged.
        self.scheduler.advance([c for c in chunks if not c.drafts], self._captured_states())
        outputs: list[RequestOutput | None] = []
        sampled: list[tuple[int, ScheduledChunk, range]] = []  # (place in outputs, chunk, its logits rows)
        i = 0
        for chunk, n, start, completes in plan:
            request = chunk.request
            i += n
            try:
                if request.sampling.prompt_logprobs is not None:
                    self._record_prompt_logprobs(request, start, logits[i - n:i])
            except Exception as exc:  # this request's own work failed: only it ends
                outputs.append(self._failed_after_forward(request, exc))
                continue
            if completes:
                sampled.append((len(outputs), chunk, range(i - 1 - len(chunk.drafts), i)))
                outputs.append(None)
        if sampled:
            samples_of = self._sample(sampled, logits)
            if self.mtp is not None:
                self._commit_kept_drafts([chunk for _, chunk, _ in sampled], samples_of)
            for (place, chunk, _), samples in zip(sampled, samples_of, strict=True):
                try:
                    outputs[place] = (self._accept_drafts(chunk, samples) if chunk.drafts
                                      else self._accept(chunk.request, _sample_or_raise(samples[0])))
                except Exception as exc:
                    outputs[place] = self._failed_after_forward(chunk.request, exc)
        if self.mtp is not None:
            self.propose_drafts([c.request for _, c, _ in sampled if c.request.request_id in self.requests
                                 and not c.request.draft_pause and mtp_ready(c.request)])
            self._pass = None
        return outputs  # type: ignore[return-value]

    def _commit_kept_drafts(self, chunks: list[ScheduledChunk], samples_of: list[list[Sample | Exception]]) -> None:
        """The MTP layer takes the rows of passes whose drafts were all kept (before `_accept_drafts`
        seals them); a pass with a rejected draft is undone whole, the layer's rows with it."""
        assert self.mtp is not None and self._pass is not None
        states, ids, offsets = self._pass
        kept = [c for c, samples in zip(chunks, samples_of, strict=True) if c.drafts and accepted_count(
            c.drafts, [s.token if isinstance(s, Sample) else None for s in samples]) == len(c.drafts)]
        if not kept:
            return
        rows = [MTPRows.of(c.request, offsets[c.request.request_id], c.num_new) for c in kept]
        if self.ranks is not None:
            assert isinstance(self.device_kv, MirroredDeviceKV)
            self.ranks.run_mtp(MTPPass(self.device_kv.take_writes(), rows=rows))
        self.mtp.commit(rows, states, ids)

    def propose_drafts(self, requests: list[Request]) -> None:
        """The MTP layer's drafts for each request (`mtp_ready`), kept on it with the token count they
        follow; the other ranks draft alike (their KV stays rank 0's)."""
        if not requests:
            return
        assert self.mtp is not None and self.config.speculative is not None
        seeds, k = [MTPSeed.of(r) for r in requests], self.config.speculative.num_speculative_tokens
        if self.ranks is not None:
            assert isinstance(self.device_kv, MirroredDeviceKV)
            self.ranks.run_mtp(MTPPass(self.device_kv.take_writes(), seeds=seeds, k=k))
        drafts = self.mtp.propose(seeds, k).tolist()  # one wait for the device, for every request
        for r, d in zip(requests, drafts, strict=True):
            r.mtp_drafts, r.mtp_drafts_at = d, r.num_tokens

    def _sample(self, sampled: list[tuple[int, ScheduledChunk, range]], logits: torch.Tensor
                ) -> list[list[Sample | Exception]]:
        """Every sampled row of the step at once → each chunk's samples (a drafted chunk's rows see the
        drafts before them as output)."""
        rows = [row for _, _, chunk_rows in sampled for row in chunk_rows]
        requests = [chunk.request for _, chunk, chunk_rows in sampled for _ in chunk_rows]
        drafted = [chunk.drafts[:k] for _, chunk, chunk_rows in sampled for k in range(len(chunk_rows))]
        picked = logits if len(rows) == len(logits) else logits.index_select(0, upload(rows, logits.device))
        try:
            flat = self.sampler.sample_rows(requests, picked, drafted if any(drafted) else None)
        except Exception as exc:  # the step's sampling failed: its requests end, no other
            flat = [exc] * len(rows)
        out, at = [], 0
        for _, _, chunk_rows in sampled:
            out.append(flat[at:at + len(chunk_rows)])
            at += len(chunk_rows)
        return out

    def _accept_drafts(self, chunk: ScheduledChunk, samples: list[Sample | Exception]) -> RequestOutput:
        """Keep the drafts that equal the samples before them, then the first sample that differs (or the
        last row's, when all were kept). A rejected draft's state is undone: the slot goes back to what it
        was before the pass, and the kept tokens are computed again in the request's next chunk."""
        request, drafts = chunk.request, chunk.drafts
        tokens = [s.token if isinstance(s, Sample) else None for s in samples]
        kept = accepted_count(drafts, tokens)
        sample = _sample_or_raise(samples[kept])
        self.spec.count(len(drafts), kept)
        request.draft_pause, request.draft_backoff = after_pass((request.draft_pause, request.draft_backoff), kept)
        if kept < len(drafts):
            assert request.kv.slot is not None
            self.device_kv.restore_kept(request.kv.slot)
        for token in drafts[:kept]:  # never a stop: the scheduler cut the drafts before any
            if request.grammar is not None:
                request.grammar.accept(token)
            self.scheduler.append_token(request, token)
        if kept == len(drafts):
            self.scheduler.advance([chunk])
        last = self._accept(request, sample)
        return RequestOutput(request.request_id, [*drafts[:kept], *last.new_token_ids],
                             [*samples[:kept], *last.samples], last.finished, last.finish_reason)  # type: ignore[list-item]

    def _failed_after_forward(self, request: Request, exc: Exception,
                              ending: list[tuple[Request, str]] | None = None) -> RequestOutput:
        if isinstance(exc, RequestError):  # the request's own doing (a grammar that cannot go on): a 400
            log.info("request %s ended: %s", request.request_id, exc)
            return self.fail(request, str(exc), param=exc.param or "request", ending=ending)
        log.error("request %s failed after the forward pass", request.request_id, exc_info=exc)
        return self.fail(request, f"sampling failed ({type(exc).__name__}; the engine's log has the detail)",
                         ending=ending)

    def _record_prompt_logprobs(self, request: Request, start: int, rows: torch.Tensor) -> None:
        """Row p predicts prompt token p+1; the first prompt token has no logprob."""
        prompt, k = request.prompt_token_ids, request.sampling.prompt_logprobs or 0
        logprobs = rows.float().log_softmax(-1)
        for j in range(len(rows)):
            p = start + j
            if p + 1 >= len(prompt) or len(request.prompt_logprobs) != p + 1:
                continue  # past the prompt, or already recorded before a preemption
            tok, top = prompt[p + 1], []
            if k:
                vals, ids = logprobs[j].topk(k)
                top = finite_top(list(zip(ids.tolist(), vals.tolist(), strict=True)))
            logprob = float(logprobs[j, tok])
            if not math.isfinite(logprob):  # the reply could not carry it (JSON has no NaN or infinity)
                raise NonFiniteLogits(f"the logits of prompt position {p} are not finite")
            request.prompt_logprobs.append(Sample(token=tok, logprob=logprob, top=top))

    def _accept(self, request: Request, sample: Sample,
                ending: list[tuple[Request, str]] | None = None) -> RequestOutput:
        """`ending`: where a request that stops goes instead of ending now (it has a step in flight)."""
        if request.grammar is not None:
            request.grammar.accept(sample.token)
        self.scheduler.append_token(request, sample.token)
        out = RequestOutput(request.request_id, [sample.token], [sample])
        reason = self._stop_reason(request, sample.token)
        if reason is not None:
            if ending is None:
                self.finish(request, reason)
            else:
                ending.append((request, reason))
            out.finished, out.finish_reason = True, reason
        return out

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.sampling
        if request.grammar is not None and request.grammar.done:  # its EOS, whatever ignore_eos says
            return "stop"
        if token == self.eos_token_id and not params.ignore_eos:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stop, length or error) and free its cache at once."""
        request.finish_reason = reason
        self.scheduler.finish(request, RequestStatus(reason))
        self.requests.pop(request.request_id, None)
        self.sampler.forget(request.request_id)

    def fail(self, request: Request, message: str, param: str | None = None,
             ending: list[tuple[Request, str]] | None = None) -> RequestOutput:
        if ending is None:
            self.finish(request, "error")
        else:
            ending.append((request, "error"))
        return RequestOutput(request.request_id, [], finished=True, finish_reason="error", error=message,
                             error_param=param)

    def reset_prefix_cache(self, store: bool = False) -> tuple[int, int]:
        """Forget every cached block no request holds (and, with `store`, the SSD store's files of
        this model's namespace). → (blocks dropped, store files removed)"""
        return self.kv.reset_prefix_cache(store=store)

    def describe(self) -> dict[str, list[str]]:
        """Each queue's requests in words: id, age, prompt and output tokens, tokens computed."""
        now = time.monotonic()

        def line(r: Request) -> str:
            return (f"{r.request_id} age {now - r.arrival_time:.1f}s prompt {len(r.prompt_token_ids)} "
                    f"output {len(r.output_token_ids)} computed {r.num_computed_tokens} {r.status.name.lower()}")

        sched = self.scheduler
        return {"running": [line(r) for r in sched.running], "loading": [line(r) for r in sched.loading],
                "waiting": [line(r) for r in sched.waiting]}

    def stats(self) -> EngineStats:
        """An immutable snapshot of the engine's numbers (taken on the engine thread)."""
        sched, cache = self.scheduler, self.kv.stats()
        s, io = sched.stats, cache.store
        stats = EngineStats(
            running=len(sched.running), waiting=len(sched.waiting) + len(sched.loading) - sched.fetching,
            fetching=sched.fetching,
            state_cache_usage=cache.state_cache_usage, block_cache_usage=cache.block_cache_usage,
            prefix_queries=s.prefix_queries, prefix_hits_device=s.prefix_hits, prefix_hits_disk=s.prefix_hits_disk,
            recomputed_tokens=s.recomputed, preemptions=s.preemptions, evictions=cache.evictions,
            restores=MappingProxyType(dict(s.restores)),
            snapshot_bytes_host=cache.snapshot_bytes_host,
            snapshot_bytes_disk=io.snapshot_bytes_written if io else 0,
            write_modes=MappingProxyType(dict(s.write_modes)), hot_prefixes=cache.hot_prefixes,
            store_read_bytes=io.bytes_read if io else 0, store_written_bytes=io.bytes_written if io else 0,
            store_usage_bytes=cache.store_usage_bytes, store_quarantine_files=cache.store_quarantine_files,
            store_errors=MappingProxyType(dict(io.errors) if io else {}),
            store_read_seconds=s.load_seconds.snapshot(),
            store_load_phases=MappingProxyType({p: h.snapshot() for p, h in s.load_phases.items()}),
            handovers=s.handovers, handover_failures=s.handover_failures, fetches=s.fetches,
            fetched_files=s.fetched_files, fetched_bytes=s.fetched_bytes, fetches_local=s.fetches_local,
            fetch_fallbacks=MappingProxyType(dict(s.fetch_fallbacks)), fetch_seconds=s.fetch_seconds.snapshot(),
            spec_drafts=self.spec.drafts, spec_draft_tokens=self.spec.draft_tokens,
            spec_accepted_tokens=self.spec.accepted_tokens,
            spec_accepted_per_position=tuple(self.spec.accepted_per_position))
        if self.grammars is not None:
            return stats.with_grammars("engine", self.grammars.text_bytes, self.grammars.compiles)
        return stats

    def kv_digests(self) -> list[str]:
        """sha256 of every rank's whole DeviceKV, rank 0 first: under parallelism they must be equal."""
        if self.ranks is None:
            return [kv_digest(self.device_kv)]
        return self.ranks.kv_digests(self.device_kv)

    def dead_rank(self) -> str | None:
        """Which rank has died, if one has (the engine cannot run without it)."""
        return self.ranks.dead_rank() if self.ranks is not None else None

    def close(self, step_in_flight: bool = False) -> None:
        """Finish queued store writes and stop the store's threads, send the last KV events, then the
        other ranks (killed, not
        told, if a step is still running: they may be inside its collectives)."""
        if self.kv.store is not None:
            self.kv.store.close()
        # Decode steps set the process's intra-op threads to one: an engine built next in this process
        # (benchmarks, tests) would take that for all it may use.
        torch.set_num_threads(self._cpu_threads)
        if self.kv_events is not None:  # after the store: its last writes are announced too
            self.kv_events.close()
        if self.ranks is not None:
            self.ranks.broken |= step_in_flight
            self.ranks.stop()

    # ---- convenience --------------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> dict[str, list[int]]:
        """Run requests to completion (tests, benchmarks); returns each one's output tokens."""
        for r in requests:
            self.add_request(r)
        while self.has_work():
            self.step()
        return {r.request_id: r.output_token_ids for r in requests}
