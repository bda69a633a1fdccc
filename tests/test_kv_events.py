"""KV events in vLLM's wire format (`--kv-events-config`): a subscriber decodes every batch against
vLLM's published schema, and the blocks it was told of are exactly the blocks the cache holds — after
every step of a churn with eviction, preemption and the SSD store (device tier "GPU", store "DISK");
a replay from any sequence number gives the same bytes; a reset that leaves nothing says so."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq

from tests.daemon import PATIENCE
from tests.helpers import engine_for, greedy, small_model, tokens
from tests.test_churn import settle_store_io
from v4serve.cache.kv_events import KVEventsConfig
from v4serve.cache.ssd_file import KIND_BLOCK

# vLLM's msgspec structs (vllm/distributed/kv_events.py), field for field: events are maps tagged with
# "type"; a batch is the array [ts, events, data_parallel_rank].
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name"]
REMOVED_KEYS = ["type", "block_hashes", "medium"]


@dataclass
class Replica:
    """What a router knows of one replica from its events: blocks per tier, and every hash ever stored."""

    blocks: dict[str, set[bytes]] = field(default_factory=lambda: {"GPU": set(), "DISK": set()})
    ever: dict[str, set[bytes]] = field(default_factory=lambda: {"GPU": set(), "DISK": set()})
    next_seq: int = 0
    clears: int = 0

    def apply(self, seq: int, payload: bytes, block_size: int) -> None:
        assert seq == self.next_seq, f"sequence {seq} after {self.next_seq - 1}: a gap or a repeat"
        self.next_seq += 1
        batch = msgspec.msgpack.decode(payload)
        assert isinstance(batch, list) and len(batch) == 3 and batch[2] is None, batch
        ts, events = batch[0], batch[1]
        assert isinstance(ts, float) and abs(ts - time.time()) < 3600 and 0 < len(events) <= 1024
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                assert list(event) == STORED_KEYS, event
                assert event["lora_id"] is None and event["lora_name"] is None
                [h] = event["block_hashes"]
                assert isinstance(h, bytes) and len(h) == 32
                assert len(event["token_ids"]) == event["block_size"] == block_size
                parent, medium = event["parent_block_hash"], event["medium"]
                # A router drops a block whose parent it never heard of: parents always come first.
                assert parent is None or parent in self.ever[medium], "a block announced before its parent"
                self.blocks[medium].add(h)
                self.ever[medium].add(h)
            elif kind == "BlockRemoved":
                assert list(event) == REMOVED_KEYS, event
                for h in event["block_hashes"]:
                    assert h in self.blocks[event["medium"]], "a block removed that was never announced"
                    self.blocks[event["medium"]].discard(h)
            else:
                assert event == {"type": "AllBlocksCleared"}, event
                self.clears += 1
                for tier in self.blocks.values():
                    tier.clear()


class Subscriber:
    def __init__(self, endpoint: str, block_size: int, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.topic, self.block_size = topic, block_size
        self.replica = Replica()
        self.received: dict[int, bytes] = {}

    def drain(self, until_seq: int, timeout: float = PATIENCE) -> None:
        """Apply what has arrived, waiting until batch `until_seq - 1` has (nothing when it is 0)."""
        deadline = time.monotonic() + timeout
        while self.replica.next_seq < until_seq or self.sock.poll(0):
            assert self.sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), "events stopped arriving"
            topic, seq_bytes, payload = self.sock.recv_multipart()
            assert topic == self.topic and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            self.received[seq] = payload
            self.replica.apply(seq, payload, self.block_size)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def replay(endpoint: str, since: int) -> list[tuple[int, bytes]]:
    """vLLM's replay: a DEALER sends ["", since]; answers are ["", topic, seq, payload]... then seq -1."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", since.to_bytes(8, "big")])
    got = []
    try:
        while True:
            assert sock.poll(int(PATIENCE * 1000)), "the replay did not answer"
            empty, _, seq_bytes, payload = sock.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return got
            got.append((seq, payload))
    finally:
        sock.close(linger=0)
        ctx.term()


@contextmanager
def subscribed(engine, model) -> Iterator[Subscriber]:
    """A subscriber whose subscription has reached the publisher (a PUB socket sends nothing to a
    subscriber it does not know of yet; the events meanwhile are fetched by replay)."""
    sub = Subscriber(engine.kv_events.endpoint, model.cfg.block_size)
    try:
        for i in range(200):  # requests of one block each, until one's events arrive live
            engine.generate([greedy(f"probe{i}", tokens(model.cfg.block_size + 1, 900 + i), 1)])
            assert engine.kv_events.flush(PATIENCE)
            if sub.sock.poll(200):
                break
        first = int.from_bytes(sub.sock.recv_multipart()[1], "big")
        for seq, payload in replay(engine.kv_events.replay_endpoint, 0):
            if seq <= first:
                sub.received[seq] = payload
                sub.replica.apply(seq, payload, model.cfg.block_size)
        yield sub
    finally:
        sub.close()


def catch_up(engine, sub: Subscriber) -> None:
    assert engine.kv_events.flush(PATIENCE), "the publisher fell behind"
    sub.drain(engine.kv_events.seq)


def device_hashes(engine) -> set[bytes]:
    return {b.block_hash for b in engine.kv.pool.blocks if b.block_hash is not None and
            engine.kv.pool.cached_block(b.block_hash) == b.block_id}


def disk_hashes(engine) -> set[bytes]:
    return {h for kind, h in engine.kv.store._index if kind == KIND_BLOCK}


EVENTS = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")


@pytest.mark.parametrize("store", [False, True], ids=["device", "device+disk"])
def test_events_match_the_cache_after_every_step_of_a_churn(tmp_path, store: bool) -> None:
    rng = random.Random(f"events-{store}")
    model = small_model()  # 16-token blocks
    extra = {"kv_store_dir": str(tmp_path), "kv_store_read_timeout": PATIENCE, "kv_store_max_bytes": 40 << 20} \
        if store else {}
    engine = engine_for(model, max_num_seqs=3, num_blocks=10, max_num_batched_tokens=40, max_prefill_chunk=24,
                        kv_events=EVENTS, **extra)
    bases = [tokens(rng.randint(20, 90), 300 + i) for i in range(4)]
    hits = 0
    with subscribed(engine, model) as sub:
        for i in range(16):
            base = rng.choice(bases)
            engine.add_request(greedy(f"r{i}", base[: rng.randint(1, len(base))] + tokens(rng.randint(1, 20), 400 + i),
                                      n=rng.randint(1, 20)))
            for _ in range(rng.randint(1, 4)):
                engine.step()
                if store:
                    settle_store_io(engine)
                catch_up(engine, sub)
                assert sub.replica.blocks["GPU"] == device_hashes(engine)
                if store:
                    assert sub.replica.blocks["DISK"] == disk_hashes(engine)
                # Every block a running request took from the cache was announced and not yet removed.
                for r in engine.scheduler.running:
                    hit = {engine.kv.pool.blocks[b].block_hash for b in r.kv.plan.hit_blocks}
                    hits += len(hit)
                    assert hit <= sub.replica.blocks["GPU"]
        while engine.has_work():
            engine.step()
            if store:
                settle_store_io(engine)
            catch_up(engine, sub)
            assert sub.replica.blocks["GPU"] == device_hashes(engine)
        assert hits > 0 and engine.kv.pool.evictions > 0  # the churn hit and evicted
        assert sub.replica.ever["DISK"] if store else not sub.replica.ever["DISK"]
        # A replay from any point gives the bytes that were published live.
        since = sub.replica.next_seq // 2
        again = replay(engine.kv_events.replay_endpoint, since)
        assert [seq for seq, _ in again] == list(range(since, sub.replica.next_seq))
        assert all(sub.received[seq] == payload for seq, payload in again)
        # A reset that leaves nothing cached in any tier (the store emptied too) clears everything.
        engine.reset_prefix_cache(store=True)
        catch_up(engine, sub)
        assert sub.replica.clears == 1 and sub.replica.blocks == {"GPU": set(), "DISK": set()}
        assert not device_hashes(engine)
    engine.close()


def test_the_flag_takes_vllms_keys_and_refuses_others() -> None:
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                '"endpoint": "tcp://*:6000", "topic": "kv"}') == \
        KVEventsConfig(endpoint="tcp://*:6000", topic="kv")
    assert KVEventsConfig.parse("{}") == KVEventsConfig()  # given at all: on, vLLM's defaults
    assert KVEventsConfig.parse('{"publisher": null}') == KVEventsConfig()
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    assert KVEventsConfig.parse('{"publisher": "null"}') is None
    for bad, says in (('{"endpont": "tcp://*:1"}', "unknown keys \\['endpont'\\]"),
                      ('{"publisher": "kafka"}', "publisher must be 'zmq'"),
                      ('{"hwm": 0}', "hwm must be a positive integer"),
                      ("[1]", "must be a JSON object"), ("{", "is not JSON")):
        with pytest.raises(ValueError, match=says):
            KVEventsConfig.parse(bad)


def test_an_endpoint_that_cannot_be_bound_is_a_clear_error() -> None:
    from v4serve.cache.kv_events import KVEventLog, ZmqEventPublisher

    first = ZmqEventPublisher(KVEventLog(16), KVEventsConfig(endpoint="tcp://127.0.0.1:*"))
    try:
        taken = first.endpoint.replace("127.0.0.1", "*")
        with pytest.raises(ValueError, match=f"cannot open {taken.replace('*', '[*]')}: Address already in use"):
            ZmqEventPublisher(KVEventLog(16), KVEventsConfig(endpoint=taken))
    finally:
        first.close()


# ---- the replay socket under a flood --------------------------------------------------------------------------
class FrozenClock:
    """The rate limit's clock, moved only by the test: what is answered never depends on machine speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def publish_one(publisher, i: int) -> None:
    """One event, sent as a batch of its own."""
    publisher.log.stored("GPU", i.to_bytes(32, "big"), None, list(range(16)))
    assert publisher.flush(PATIENCE)


def live_subscriber(publisher) -> tuple[zmq.Context, zmq.Socket, list[int]]:
    """A SUB socket whose subscription has reached the publisher, and the sequences it has had so far."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.connect(publisher.endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    for i in range(200):
        publish_one(publisher, 10_000 + i)
        if sock.poll(200):
            return ctx, sock, [int.from_bytes(sock.recv_multipart()[1], "big")]
    raise AssertionError("the subscription never reached the publisher")


def drain_live(sock: zmq.Socket, seqs: list[int], until_seq: int) -> None:
    while seqs[-1] < until_seq - 1:
        assert sock.poll(int(PATIENCE * 1000)), "live events stopped arriving"
        seqs.append(int.from_bytes(sock.recv_multipart()[1], "big"))


def read_answers(sock: zmq.Socket, count: int) -> list[list[int]]:
    """The sequences in each of `count` replay answers, in the order they came."""
    answers: list[list[int]] = [[]]
    while len(answers) <= count:
        assert sock.poll(int(PATIENCE * 1000)), "a replay was not answered"
        _, _, seq_bytes, _ = sock.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == -1:
            answers.append([])
        else:
            answers[-1].append(seq)
    return answers[:-1]


def test_a_replay_flood_is_answered_at_the_rate_limit_and_live_events_keep_flowing() -> None:
    """60 replays from 0 sent at once from one client, events published among them: with the clock
    still, exactly the burst (4) get batches, each cut at 5 batches from the sequence asked for; the
    rest get the end marker alone. Every live batch arrives, during the flood and after; an up-to-date
    subscriber's replay (nothing to send) is answered however spent the limit; a second of the clock
    buys two more answers, which resume where the first ones stopped."""
    from v4serve.cache.kv_events import KVEventLog, TokenBucket, ZmqEventPublisher

    clock = FrozenClock()
    publisher = ZmqEventPublisher(KVEventLog(16), EVENTS, replay_limit=TokenBucket(2.0, 4, clock),
                                  max_replay_batches=5)
    ctx, live, seqs = live_subscriber(publisher)
    flooder = ctx.socket(zmq.DEALER)
    flooder.connect(publisher.replay_endpoint)
    try:
        for i in range(12):
            publish_one(publisher, i)
        for i in range(60):
            flooder.send_multipart([b"", (0).to_bytes(8, "big")])
            if i % 10 == 0:
                publish_one(publisher, 100 + i)  # publishing goes on among the replays
        answers = read_answers(flooder, 60)
        assert [a for a in answers if a] == [[0, 1, 2, 3, 4]] * 4
        assert publisher.replays_answered == 4 and publisher.replays_limited == 56
        drain_live(live, seqs, publisher.seq)  # every batch published during the flood arrived, in order
        for i in range(3):
            publish_one(publisher, 200 + i)
        drain_live(live, seqs, publisher.seq)
        assert seqs == list(range(seqs[0], publisher.seq))
        flooder.send_multipart([b"", publisher.seq.to_bytes(8, "big")])  # up to date: nothing to send
        flooder.send_multipart([b"", b"\xff" * 8])  # sequences past any buffer, unsigned or longer
        flooder.send_multipart([b"", b"\x7f" * 100])
        assert read_answers(flooder, 3) == [[], [], []] and publisher.replays_limited == 56
        clock.now += 1.0  # two more tokens
        for since in (5, 10, 0):
            flooder.send_multipart([b"", since.to_bytes(8, "big")])
        assert read_answers(flooder, 3) == [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], []]
        publisher.max_replay_bytes = 1  # the byte bound: one batch a reply, never none
        clock.now += 1.0
        flooder.send_multipart([b"", (7).to_bytes(8, "big")])
        assert read_answers(flooder, 1) == [[7]]
    finally:
        flooder.close(linger=0)
        live.close(linger=0)
        ctx.term()
        publisher.close()
