"""KV-cache events in vLLM's wire format, for routers that route by what each replica has cached
(vllm-router's `kv_aware` policy, llm-d's precise prefix scorer, Dynamo's KV router).

The cache announces every block that becomes findable (`BlockStored`: its chain hash, the hash of the
block it continues, its token ids) and every block that stops being findable (`BlockRemoved`), per
tier (`medium`): "GPU" for the device Block Cache (vLLM's name for it, whatever the device) and "DISK"
for the SSD store. `AllBlocksCleared` says nothing is cached in any tier any more (a prefix-cache reset
that left nothing). State Cache snapshots (window state at a block, a prompt's or a response's end) are
not blocks and are never announced: a router can tell which prefixes a replica holds, not how much of
the window it would recompute for a hit.

`KVEventLog` (plain Python, thread-safe: the engine step and the SSD store's writer both append) buffers
them; `ZmqEventPublisher` sends them as vLLM does: a PUB socket, multipart `[topic, seq (8 bytes, big
endian), msgpack(EventBatch)]`, and a ROUTER socket that replays the batches still buffered from a
sequence number a subscriber asks for (`[identity, "", seq]` → `[identity, "", topic, seq, payload]`...,
then the end marker `[identity, "", "", -1, ""]`).

The replay socket is open to anyone who can reach it, and an answer can be the whole buffer (10,000
batches by default, tens of milliseconds of this thread holding the GIL the engine step needs). So:
- answers with batches in them are rate-limited, all clients together (a token bucket: `REPLAY_RATE` a
  second, bursts of `REPLAY_BURST`); a request over the limit gets an empty replay, the end marker
  alone. vLLM's protocol has no "refused" frame, and an empty replay is what an up-to-date subscriber
  gets, so every client reads it and none waits on its own timeout (a dropped request would leave it
  waiting); a subscriber that needed the batches sees the gap again at its next live batch and asks
  again then. A request with nothing to send (a subscriber that is up to date) is never limited;
- one answer sends at most `MAX_REPLAY_BATCHES` batches or `MAX_REPLAY_BYTES`, the oldest asked for
  first (always one): still a contiguous replay from the asked sequence, which the subscriber resumes
  from where it stopped;
- requests queue at most `REPLAY_RCVHWM` deep per connection (then ZeroMQ stops reading it: the flooder
  waits, not this thread), and the excess costs one message each. Without the limit, a flood sent in
  a tenth of a second queued thousands of full answers that this thread went on serving for minutes
  after the flood had stopped: the latency it caused outlived it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from itertools import islice
from typing import Any

log = logging.getLogger(__name__)

DEVICE, DISK = "GPU", "DISK"  # tiers, as `medium` names them (vLLM's GPU; the store's disk)
MAX_EVENTS_PER_BATCH = 1024  # routers refuse batches beyond a few thousand events
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
CLOSE_LINGER_MS = 500  # at exit, how long the last events may take to leave
REPLAY_RATE = 2.0  # replay answers with batches in them, per second, all clients together
REPLAY_BURST = 4  # such answers allowed at once after a quiet spell (a few routers starting together)
MAX_REPLAY_BATCHES = 4096  # batches one answer sends at most (the default buffer holds 10,000)
MAX_REPLAY_BYTES = 16 << 20  # payload bytes one answer sends at most (a full batch is a few hundred KB)
REPLAY_RCVHWM = 64  # replay requests queued per connection before ZeroMQ stops reading it
REPLAY_SNDHWM = 1000  # messages queued per replay client at least (ZeroMQ's default)
REPLAY_LOG_SECONDS = 60.0  # at most one warning this often about limited replays (a flood must not flood the log)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None  # None: the first block of a chain
    token_ids: tuple[int, ...]
    block_size: int
    medium: str

    def wire(self) -> dict[str, Any]:
        # vLLM's field order and its LoRA fields (always empty here); a map tagged with "type".
        return {"type": "BlockStored", "block_hashes": list(self.block_hashes),
                "parent_block_hash": self.parent_block_hash, "token_ids": list(self.token_ids),
                "block_size": self.block_size, "lora_id": None, "medium": self.medium, "lora_name": None}


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str

    def wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium}


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Events in the order they happened, until the publisher takes them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []
        self._ready = threading.Condition()
        self.appended = 0  # events ever added (the publisher's flush compares what it has sent)

    def stored(self, medium: str, block_hash: bytes, parent: bytes | None, tokens: Sequence[int]) -> None:
        self._add(BlockStored((block_hash,), parent, tuple(tokens), self.block_size, medium))

    def removed(self, medium: str, hashes: Sequence[bytes]) -> None:
        if hashes:
            self._add(BlockRemoved(tuple(hashes), medium))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def _add(self, event: KVEvent) -> None:
        with self._ready:
            self._events.append(event)
            self.appended += 1
            self._ready.notify()

    def take(self, timeout: float | None = None) -> list[KVEvent]:
        """Every event so far (waiting up to `timeout` seconds for one)."""
        with self._ready:
            if not self._events and timeout:
                self._ready.wait(timeout)
            events, self._events = self._events, []
        return events


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`, vLLM's JSON keys and defaults. Given at all, events are on unless
    `enable_kv_cache_events` is false."""

    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ send high-water mark
    max_queue_size: int = 100_000  # events waiting to be sent; beyond it the oldest are dropped (and counted)
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig | None:
        """The flag's JSON → a config (None: off); ValueError saying what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object, e.g. "
                             '{"publisher": "zmq", "endpoint": "tcp://*:5557"}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}; known: {sorted(known)}")
        if raw.get("publisher") is None:
            raw.pop("publisher", None)
        config = cls(**raw)
        if not config.enable_kv_cache_events or config.publisher == "null":
            return None
        if config.publisher != "zmq":
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' (or 'null': off), got {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) <= 0:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer")
        for name in ("endpoint", "replay_endpoint", "topic"):
            value = getattr(config, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        return config


def encode_batch(events: Sequence[KVEvent], ts: float | None = None) -> bytes:
    """vLLM's `KVEventBatch`: the array [ts, [event maps...], data_parallel_rank (None)]."""
    import msgspec

    return msgspec.msgpack.encode([time.time() if ts is None else ts, [e.wire() for e in events], None])


def _binds(endpoint: str) -> bool:
    """As vLLM: a wildcard or local transport is bound; anything else is a collector to connect to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; the clock is injectable so that tests count
    answers instead of timing them."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()

    def take(self) -> bool:
        """Spend one token if there is one."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class ZmqEventPublisher:
    """Sends what `log` collects, from a thread of its own (the engine step never waits on a socket)."""

    def __init__(self, log_: KVEventLog, config: KVEventsConfig, replay_limit: TokenBucket | None = None,
                 max_replay_batches: int = MAX_REPLAY_BATCHES, max_replay_bytes: int = MAX_REPLAY_BYTES) -> None:
        import zmq

        self.log, self.config = log_, config
        self.replay_limit = replay_limit or TokenBucket(REPLAY_RATE, REPLAY_BURST)
        self.max_replay_batches, self.max_replay_bytes = max_replay_batches, max_replay_bytes
        self.replays_answered = 0  # answers that sent batches
        self.replays_limited = 0  # requests answered with an empty replay because of the rate limit
        self._limited_logged_at: float | None = None
        self.topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        endpoint = config.endpoint
        try:
            (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
            if config.replay_endpoint:
                endpoint = config.replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A ROUTER drops what passes a peer's send HWM without a word: one whole answer must fit,
                # or a client reading it would miss batches from its middle.
                self._replay.setsockopt(zmq.SNDHWM, max(REPLAY_SNDHWM, max_replay_batches + 1))
                self._replay.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
                self._replay.bind(endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot open {endpoint}: {exc.strerror} (an endpoint with '*', "
                             "such as tcp://*:5557, is bound; any other is connected to, as vLLM does)") from None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode() if _binds(config.endpoint) else \
            config.endpoint  # with a port chosen at bind ("tcp://127.0.0.1:*"), the one it got
        self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode() if self._replay else None
        self.seq = 0
        self.dropped = 0
        self.handled = 0  # events taken from the log and sent (or dropped)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="v4serve-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s (topic %r; %s)", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "", config.topic,
                 "bound" if _binds(config.endpoint) else "connected to a collector")

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            self._publish(self.log.take(timeout=0.02 if self._replay is None else None))
            if self._replay is not None and poller.poll(timeout=20):
                self._answer_replay()

    def _publish(self, events: list[KVEvent]) -> None:
        taken, limit = len(events), self.config.max_queue_size
        if taken > limit:
            self.dropped += taken - limit
            log.warning("KV events: %d events dropped (more than max_queue_size waiting)", taken - limit)
            events = events[-limit:]
        for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
            self._send(encode_batch(events[start:start + MAX_EVENTS_PER_BATCH]))
        self.handled += taken

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event logged so far has been sent; False if that took over `timeout`."""
        deadline = time.monotonic() + timeout
        while self.handled < self.log.appended:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def _send(self, payload: bytes) -> None:
        seq = self.seq.to_bytes(8, "big")
        self._pub.send_multipart((self.topic, seq, payload))
        self._buffer.append((self.seq, payload))
        self.seq += 1

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        identity, _, start = frames
        batches = self._replay_batches(int.from_bytes(start, "big"))
        if batches and not self.replay_limit.take():
            self._limited()
            batches = []
        elif batches:
            self.replays_answered += 1
        for seq, payload in batches:
            self._replay.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))

    def _replay_batches(self, since: int) -> list[tuple[int, bytes]]:
        """The buffered batches from `since` on, oldest first, cut at the per-answer bounds (at least
        one, so a subscriber always moves on). The buffer's sequences are contiguous: no scan to find
        where `since` is."""
        first = self.seq - len(self._buffer)
        skip = min(max(0, since - first), len(self._buffer))  # any 8 bytes (or more) may come: islice takes ssize_t
        picked: list[tuple[int, bytes]] = []
        size = 0
        for seq, payload in islice(self._buffer, skip, None):
            size += len(payload)
            if picked and (len(picked) == self.max_replay_batches or size > self.max_replay_bytes):
                break
            picked.append((seq, payload))
        return picked

    def _limited(self) -> None:
        self.replays_limited += 1
        now = time.monotonic()
        if self._limited_logged_at is None or now - self._limited_logged_at >= REPLAY_LOG_SECONDS:
            self._limited_logged_at = now
            log.warning("KV events: replay requests over %.0f a second answered empty (%d so far)",
                        self.replay_limit.rate, self.replays_limited)

    def close(self) -> None:
        """Send what is left, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self._publish(self.log.take())
        for sock, linger in ((self._pub, CLOSE_LINGER_MS), (self._replay, 0)):
            if sock is not None:
                sock.close(linger=linger)
        self._ctx.term()
